"""What a certificate binds of a checkpoint directory: every file by name, not only the root.

* The OpenSSF model-signing root digest hashes the file digests in sorted order and binds no
  name: two renames that keep the sorted order keep the root. The certificate therefore signs
  each checkpoint's file list (name, size, SHA-256, as model-signing's predicate lists its
  resources), and ``verify --recheck`` compares names as well as bytes (exit 1, file named).
* A weight file a loader could read that moeaudit would not (a shard the index does not
  reference, any weight file beside ``model.safetensors``) or a tensor stored in two shards is
  refused (exit 4, named), as a tensor the replay does not use already is: transformers 5.24
  loads whichever copy it reads last.

The checkpoints are the bad-input corpus's tiny Mixtral (``make_bad_inputs``): model A (seed 0)
and model B (seed 1), same shapes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import make_bad_inputs as corpus
import pytest
from click.testing import CliRunner, Result
from signed import signed_statement

from moeaudit.checkpoint import Checkpoint
from moeaudit.checkpoint.digest import root_digest
from moeaudit.checkpoint.safetensors import SafetensorsFile
from moeaudit.cli import cli
from moeaudit.errors import CheckpointError

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
# files a loader reads besides the weights (generation config, tokenizer)
LOADER_FILES = {
    "generation_config.json": '{"bos_token_id": 1, "eos_token_id": 2}\n',
    "tokenizer.json": '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {}}}\n',
    "tokenizer_config.json": '{"model_max_length": 64}\n',
}


def invoke(*argv: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in argv])


def _one_error(result: Result) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith("moeaudit: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def write_shards(ckpt: Path, ts: corpus.Tensors, extra: dict[str, Any] | None = None) -> dict[str, list[str]]:
    """``ts`` as two shards and their index; ``extra`` tensors go into the second shard, the
    index mapping none of them. Returns shard → the names the index maps to it."""
    names = sorted(ts)
    split = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2 :]}
    for shard, keys in split.items():
        more = extra or {} if shard == SHARDS[1] else {}
        ckpt.joinpath(shard).write_bytes(corpus.pack({**{k: ts[k] for k in keys}, **more}, {"format": "pt"}))
    weight_map = {k: shard for shard, keys in split.items() for k in keys}
    ckpt.joinpath(INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    return split


def sharded(path: Path, ts: corpus.Tensors) -> Path:
    corpus.save_checkpoint(path, ts)
    (path / "model.safetensors").unlink()
    write_shards(path, ts)
    return path


def router(path: Path, name: str = corpus.ROUTER) -> list[float]:
    return SafetensorsFile(path).read(name).flatten().tolist()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """canary.safetensors, fast.toml (no bootstrap) and key/key.pub."""
    from moeaudit.attest.signing import generate_key

    root = tmp_path_factory.mktemp("binding")
    corpus.write_canaries(root, root / "canaries")
    (root / "fast.toml").write_text("[receipts]\nbootstrap = 0\n")
    generate_key(root / "key")
    return root


def certify(work: Path, run: Path, out: Path) -> Result:
    return invoke(
        "certify", run, "--canary", work / "canary.safetensors", "--policy", work / "fast.toml",
        "--key", work / "key", "--out", out,
    )  # fmt: skip


def recheck(work: Path, cert: Path, run: Path) -> Result:
    return invoke("verify", cert, "--pubkey", work / "key.pub", "--recheck", "--run-dir", run)


@pytest.fixture(scope="module")
def certified(work: Path) -> tuple[Path, Path]:
    """(run, certificate): one checkpoint, model A in one file plus a loader's other files."""
    run = work / "run"
    ckpt = corpus.save_checkpoint(run / "checkpoint-1", corpus.tensors())
    for name, text in LOADER_FILES.items():
        (ckpt / name).write_text(text)
    result = certify(work, run, work / "out")
    assert result.exit_code == 0, result.stderr
    return run, work / "out" / "certificate.json"


# ----- the signed file list -------------------------------------------------------------------


def test_the_predicate_lists_every_file_of_each_checkpoint(certified: tuple[Path, Path]) -> None:
    run, cert = certified
    stmt = signed_statement(json.loads(cert.read_text()))
    (entry,) = stmt["predicate"]["checkpoint_files"]
    ckpt = run / "checkpoint-1"
    assert entry["name"] == "checkpoint-1" == stmt["subject"][0]["name"]
    want = sorted(["config.json", "model.safetensors", *LOADER_FILES])
    assert [r["name"] for r in entry["resources"]] == want
    _, per_file = root_digest(ckpt)
    for r in entry["resources"]:
        assert r == {
            "name": r["name"],
            "size": (ckpt / r["name"]).stat().st_size,
            "algorithm": "sha256",
            "digest": per_file[r["name"]],
        }
    assert stmt["subject"][0]["digest"]["sha256"] == _model_signing(ckpt)["subject"]
    assert [(r["name"], r["digest"]) for r in entry["resources"]] == _model_signing(ckpt)["resources"]


def _model_signing(path: Path) -> dict[str, Any]:
    """model-signing's own statement of a directory: subject digest and its resources."""
    pytest.importorskip("OpenSSL")
    hashing = pytest.importorskip("model_signing.hashing")
    from model_signing._signing import signing

    manifest = hashing.hash(path)
    payload = signing.Payload(manifest)
    return {
        "subject": payload.statement.pb.subject[0].digest["sha256"],
        "resources": [(d.identifier, d.digest.digest_hex) for d in manifest.resource_descriptors()],
    }


def _rename(src: str, dst: str) -> Any:
    return lambda ckpt: (ckpt / src).rename(ckpt / dst)


def _add(name: str) -> Any:
    return lambda ckpt: (ckpt / name).write_text('{"chat_template": "{{ messages }}"}\n')


def _remove(name: str) -> Any:
    return lambda ckpt: (ckpt / name).unlink()


def _change(name: str) -> Any:
    return lambda ckpt: (ckpt / name).write_text((ckpt / name).read_text().replace("64", "65"))


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (_rename("tokenizer.json", "tokenizer.jsom"), {"missing": "tokenizer.json", "added": "tokenizer.jsom"}),
        (_rename("generation_config.json", "Generation_config.json"),
         {"missing": "generation_config.json", "added": "Generation_config.json"}),
        (_add("chat_template.jinja"), {"added": "chat_template.jinja"}),
        (_add("sub/special_tokens_map.json"), {"added": "sub/special_tokens_map.json"}),
        (_remove("generation_config.json"), {"missing": "generation_config.json"}),
        (_change("tokenizer_config.json"), {"changed": "tokenizer_config.json"}),
    ],
    ids=["rename", "rename-case", "add", "add-nested", "remove", "change"],
)  # fmt: skip
def test_renaming_adding_removing_any_file_fails_recheck(
    work: Path, certified: tuple[Path, Path], tmp_path: Path, edit: Any, named: dict[str, str]
) -> None:
    run, cert = certified
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    ckpt = copy / "checkpoint-1"
    (ckpt / "sub").mkdir()
    edit(ckpt)
    if not any((ckpt / "sub").iterdir()):
        (ckpt / "sub").rmdir()
    result = recheck(work, cert, copy)
    assert result.exit_code == 1, result.output
    found = [line for line in result.stdout.splitlines() if line.startswith("recheck: ") and "match" not in line]
    assert found == [
        f"recheck: {status}: {ckpt / name} (file of checkpoint checkpoint-1): " + found[i].split("): ", 1)[1]
        for i, (status, name) in enumerate(sorted(named.items(), key=lambda kv: kv[1]))
    ], result.stdout
    assert "since certification" in result.stderr


def test_unchanged_checkpoint_rechecks(work: Path, certified: tuple[Path, Path]) -> None:
    run, cert = certified
    result = recheck(work, cert, run)
    assert result.exit_code == 0, result.output
    assert "recheck: all 1 checkpoint digests match" in result.stdout


def test_a_file_list_that_does_not_hash_to_the_subject_is_not_trusted(certified: tuple[Path, Path]) -> None:
    """Signed, but inconsistent: the list names another file order than the root it claims."""
    from moeaudit.attest.recheck import recheck as recheck_stmt
    from moeaudit.errors import InputError

    _, cert = certified
    stmt = signed_statement(json.loads(cert.read_text()))
    stmt["predicate"]["checkpoint_files"][0]["resources"].reverse()
    with pytest.raises(InputError, match="file list of checkpoint checkpoint-1 does not hash to its root digest"):
        recheck_stmt(stmt)


def test_a_reference_checkpoint_is_bound_by_its_files_too(
    work: Path, certified: tuple[Path, Path], tmp_path: Path
) -> None:
    run, _ = certified
    ref = Path(shutil.copytree(run / "checkpoint-1", tmp_path / "reference"))
    result = invoke(
        "certify", run, "--canary", work / "canary.safetensors", "--policy", work / "fast.toml",
        "--key", work / "key", "--out", tmp_path / "out", "--reference", ref,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    cert = tmp_path / "out" / "certificate.json"
    entry = signed_statement(json.loads(cert.read_text()))["predicate"]["inputs"]["reference"]
    assert entry["kind"] == "checkpoint" and entry["root_sha256"] == root_digest(ref)[0]
    assert [r["name"] for r in entry["resources"]] == sorted(["config.json", "model.safetensors", *LOADER_FILES])
    verify = ("verify", cert, "--pubkey", work / "key.pub", "--recheck", "--run-dir", run, "--reference", ref)
    result = invoke(*verify)
    assert result.exit_code == 0, result.output
    assert f"reference {ref}" in result.stdout
    (ref / "tokenizer.json").rename(ref / "tokenizer.jsom")
    result = invoke(*verify)
    assert result.exit_code == 1, result.output
    found = [x for x in result.stdout.splitlines() if x.startswith("recheck: ") and "match" not in x]
    assert [x.split(" (")[0] for x in found] == [
        f"recheck: added: {ref / 'tokenizer.jsom'}",
        f"recheck: missing: {ref / 'tokenizer.json'}",
    ]
    assert all("(file of the reference)" in x for x in found)


# ----- issue §1's attack: two renames that keep the sorted order keep the root digest ---------


def test_order_keeping_renames_keep_the_root_but_fail_recheck(work: Path, tmp_path: Path) -> None:
    """Certified: model A as two shards and their index, with model B's single file parked as
    ``model.safetensorr`` (a name no loader reads). Renaming the index to ``…index.jsom`` and
    ``model.safetensorr`` to ``model.safetensors`` changes no byte and keeps the sorted order, so
    the root digest (ours and model-signing's) is unchanged — but a loader now reads model B."""
    run = tmp_path / "run"
    ckpt = sharded(run / "checkpoint-1", corpus.tensors())
    (ckpt / "model.safetensorr").write_bytes(corpus.pack(corpus.tensors(seed=1), {"format": "pt"}))
    assert router(ckpt / SHARDS[0]) == corpus.tensors()[corpus.ROUTER].flatten().tolist()
    result = certify(work, run, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    cert = tmp_path / "out" / "certificate.json"
    before = root_digest(ckpt)[0]

    (ckpt / INDEX).rename(ckpt / (INDEX[:-1] + "m"))
    (ckpt / "model.safetensorr").rename(ckpt / "model.safetensors")

    assert root_digest(ckpt)[0] == before == _model_signing(ckpt)["subject"]  # the root binds no name
    # the file a loader reads (model.safetensors, no index) is now model B's
    assert router(ckpt / "model.safetensors") == corpus.tensors(seed=1)[corpus.ROUTER].flatten().tolist()
    result = recheck(work, cert, run)
    assert result.exit_code == 1, result.output
    lines = [x for x in result.stdout.splitlines() if x.startswith("recheck: ")]
    for status, name in (
        ("missing", INDEX),
        ("missing", "model.safetensorr"),
        ("added", INDEX[:-1] + "m"),
        ("added", "model.safetensors"),
    ):
        assert any(x.startswith(f"recheck: {status}: {ckpt / name} (file of checkpoint") for x in lines), lines
    assert "4 bound inputs missing" not in result.stderr and "2 bound inputs missing, 2 added" in result.stderr


def test_the_issues_parked_shards_are_refused_at_certify(work: Path, tmp_path: Path) -> None:
    """The attack as reported: a healthy model.safetensors with model B's two shards and their
    index parked as ``model.safetensors.index.jsom``. certify used to sign PASS; the shards are
    weight files beside model.safetensors, which a rename makes the checkpoint: refused."""
    run = tmp_path / "run"
    ckpt = corpus.save_checkpoint(run / "checkpoint-1", corpus.tensors())
    write_shards(ckpt, corpus.tensors(seed=1))
    (ckpt / INDEX).rename(ckpt / (INDEX[:-1] + "m"))
    result = certify(work, run, tmp_path / "out")
    assert result.exit_code == 4, result.output
    line = _one_error(result)
    assert f"{ckpt / SHARDS[0]}: 2 weight file(s) beside model.safetensors: {SHARDS[0]}, {SHARDS[1]}" in line
    assert not (tmp_path / "out" / "certificate.json").exists()


# ----- weight files and tensors that one loader reads and another does not ---------------------


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path: Path) -> None:
    """The second shard holds zeroed copies of the routers under the same names; the index maps
    the routers to the first shard. moeaudit used to replay the index's routers, and sign PASS,
    while transformers 5.24 loads the zeros."""
    torch = pytest.importorskip("torch")
    ts = corpus.tensors()
    routers = sorted(k for k in ts if k.endswith("block_sparse_moe.gate.weight"))
    ckpt = corpus.save_checkpoint(tmp_path / "ckpt", ts)
    (ckpt / "model.safetensors").unlink()
    first = sorted(set(ts) - set(routers))[: len(ts) // 2]  # shard 1: these and the routers
    rest = sorted(set(ts) - set(first) - set(routers))  # shard 2: the rest and zeroed routers
    ckpt.joinpath(SHARDS[0]).write_bytes(corpus.pack({k: ts[k] for k in first + routers}, {"format": "pt"}))
    zeros = {k: torch.zeros_like(ts[k]) for k in routers}
    ckpt.joinpath(SHARDS[1]).write_bytes(corpus.pack({**{k: ts[k] for k in rest}, **zeros}, {"format": "pt"}))
    weight_map = {**dict.fromkeys(first + routers, SHARDS[0]), **dict.fromkeys(rest, SHARDS[1])}
    ckpt.joinpath(INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError) as err:
        Checkpoint(ckpt)
    assert err.value.what == (
        f"tensor {routers[0]!r} is stored in {SHARDS[0]} and {SHARDS[1]} (and 1 more tensor(s)): "
        "which copy is the checkpoint depends on the loader"
    )
    result = invoke("inspect", ckpt)
    assert result.exit_code == 4 and routers[0] in _one_error(result)

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    loaded = model.state_dict()
    for key in routers:  # transformers' Mixtral names the router mlp.gate
        assert float(loaded[key.replace("block_sparse_moe", "mlp")].abs().sum()) == 0.0
        assert float(ts[key].abs().sum()) > 1.0


def test_a_shard_the_index_does_not_reference_is_refused(tmp_path: Path) -> None:
    ckpt = sharded(tmp_path / "ckpt", corpus.tensors())
    Checkpoint(ckpt)  # the two shards and their index: fine
    (ckpt / "model-00003-of-00003.safetensors").write_bytes(corpus.pack(corpus.tensors(seed=1), {"format": "pt"}))
    with pytest.raises(CheckpointError) as err:
        Checkpoint(ckpt)
    assert err.value.what == "1 weight file(s) the shard index does not reference: model-00003-of-00003.safetensors"
    result = invoke("inspect", ckpt)
    assert result.exit_code == 4 and "model-00003-of-00003.safetensors" in _one_error(result)


@pytest.mark.parametrize(
    "stray",
    ["adapter_model.safetensors", "consolidated.safetensors", "pytorch_model.bin", "model-00001-of-00002.safetensors"],
)
def test_a_weight_file_beside_model_safetensors_is_refused(tmp_path: Path, stray: str) -> None:
    ckpt = corpus.save_checkpoint(tmp_path / "ckpt", corpus.tensors())
    for harmless in ("training_args.bin", "optimizer.pt", "rng_state.pth", "model.safetensorr"):
        (ckpt / harmless).write_bytes(b"not weights a loader reads")  # Trainer's files stay fine
    Checkpoint(ckpt)
    (ckpt / stray).write_bytes(corpus.pack(corpus.tensors(seed=1), {"format": "pt"}))
    with pytest.raises(CheckpointError) as err:
        Checkpoint(ckpt)
    assert err.value.what == f"1 weight file(s) beside model.safetensors: {stray}"


# ----- the Hugging Face cache layout -----------------------------------------------------------


def hub_snapshot(cache: Path, run: Path, rev: str = "0123abcd") -> Path:
    """``run`` as ``huggingface_hub`` would download it: every file a blob named by its hash in
    ``models--org--run/blobs/``, the snapshot's names relative links into it. Returns the
    snapshot (the run directory)."""
    import hashlib

    repo = cache / "models--org--run"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        rel = path.relative_to(run)
        blob = hashlib.sha256(path.read_bytes()).hexdigest()
        (repo / "blobs" / blob).write_bytes(path.read_bytes())
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).symlink_to(Path(*[".."] * (len(rel.parts) + 1), "blobs", blob))
    return snap


def test_a_run_in_the_hugging_face_cache_is_certified_by_its_names(
    work: Path, certified: tuple[Path, Path], tmp_path: Path
) -> None:
    run, local_cert = certified
    snap = hub_snapshot(tmp_path / "hub", run)
    assert (snap / "checkpoint-1" / "config.json").is_symlink()
    result = invoke("inspect", snap / "checkpoint-1", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["digest"]["sha256"] == root_digest(run / "checkpoint-1")[0]

    result = certify(work, snap, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    cert = tmp_path / "out" / "certificate.json"
    stmt, local = (signed_statement(json.loads(c.read_text())) for c in (cert, local_cert))
    assert stmt["subject"] == local["subject"]  # the bytes the links point to, the same names
    assert stmt["predicate"]["checkpoint_files"] == local["predicate"]["checkpoint_files"]
    assert recheck(work, cert, snap).exit_code == 0

    # a link pointed elsewhere: refused, and named
    link = snap / "checkpoint-1" / "tokenizer.json"
    outside = tmp_path / "tokenizer.json"
    outside.write_text(LOADER_FILES["tokenizer.json"])
    link.unlink()
    link.symlink_to(outside)
    result = recheck(work, cert, snap)
    assert result.exit_code == 1, result.output
    assert "symbolic links are not followed" in result.stdout and str(link) in result.stdout
