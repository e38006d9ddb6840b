"""torch.distributed.checkpoint (DCP) directories: written here by the real
``dcp.save``, read by moeaudit without unpickling anything but the DCP metadata classes.

The sample run's Mixtral weights are saved as DCP under Hugging Face names (as
``dcp.save(model.state_dict())`` does, bare or under torchtitan's ``model.`` wrapper prefix)
and under torchtitan's names (stacked ``moe.experts.w1/w2/w3``, optimizer state beside them);
every tensor moeaudit reads must equal the safetensors original bit for bit, and certify on a
DCP copy of a run must give the numbers of the safetensors run.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from safetensors.torch import load_file
from signed import signed_statement
from support.dcp import assert_same_weights, save  # noqa: E402

from moeaudit.checkpoint import Checkpoint
from moeaudit.checkpoint.dcp import DcpDirectory
from moeaudit.cli import cli
from moeaudit.errors import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
SOURCE = SAMPLES / "healthy" / "checkpoint-250"
pytestmark = pytest.mark.skipif(not SOURCE.is_dir(), reason="sample runs not built")


def hf_weights(src: Path = SOURCE) -> dict[str, torch.Tensor]:
    return load_file(str(src / "model.safetensors"))  # the safetensors package, not our reader


def torchtitan_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sample Mixtral under torchtitan's model FQNs, written out by hand (its MoE module:
    ``moe.router.gate``, GroupedExperts ``moe.experts.w1/w3`` [E, I, H], ``w2`` [E, H, I])."""
    cfg = json.loads((SOURCE / "config.json").read_text())
    out = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p, t = f"model.layers.{i}.", f"layers.{i}."
        out[t + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[t + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        for tt, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            out[t + f"attention.{tt}.weight"] = sd[p + f"self_attn.{hf}.weight"]
        out[t + "moe.router.gate.weight"] = sd[p + "block_sparse_moe.gate.weight"]
        for w in ("w1", "w2", "w3"):
            out[t + f"moe.experts.{w}"] = torch.stack(
                [sd[p + f"block_sparse_moe.experts.{e}.{w}.weight"] for e in range(cfg["num_local_experts"])]
            )
    return out


# torchtitan deepseek_v3 names (its state_dict_adapter's from_hf_map), written out by hand
DEEPSEEK_TT = {
    "self_attn.q_a_proj.weight": "attention.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
    "self_attn.q_b_proj.weight": "attention.wq_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.gate.e_score_correction_bias": "moe.expert_bias",
    "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}


def deepseek_torchtitan_names(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    out = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, tt in DEEPSEEK_TT.items():
            if p + hf in sd:
                out[f"layers.{i}.{tt}"] = sd[p + hf]
        if p + "mlp.gate.weight" in sd:
            for w, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"layers.{i}.moe.experts.{w}"] = torch.stack(
                    [sd[p + f"mlp.experts.{e}.{hf}.weight"] for e in range(cfg["n_routed_experts"])]
                )
    assert len(out) < len(sd)
    return out


def test_deepseek_torchtitan_names_bit_exact(tmp_path: Path) -> None:
    src = SAMPLES / "deepseek" / "checkpoint-250"
    cfg = json.loads((src / "config.json").read_text())
    save(deepseek_torchtitan_names(hf_weights(src), cfg), tmp_path / "c")
    shutil.copy(src / "config.json", tmp_path / "c")
    ours, ref = Checkpoint(tmp_path / "c"), Checkpoint(src)
    assert ours.spec.family == "deepseek_v3" and ours.warnings == [] and ours.fused
    n = assert_same_weights(ours, ref)
    # 3 globals + dense layer 0 (2 norms, 7 MLA, 3 MLP) + 3 routed layers × (2 + 7 + router, bias,
    # 3 shared + 8 experts × 3)
    assert n == 3 + 12 + 3 * (14 + 24)


def dcp_copy(src: Path, dst: Path, form: str) -> Path:
    """``src`` (a safetensors checkpoint) as a DCP directory with its config.json beside."""
    sd = hf_weights(src)
    if form == "hf":
        state: dict = sd
    elif form == "hf-wrapped":
        state = {"model": sd, "train_state": {"step": 250}}
    else:
        tt = torchtitan_names(sd)
        state = {
            **tt,
            "freqs_cis": torch.zeros(4, 2),
            "optimizer": {"state": {"tok_embeddings.weight": {"exp_avg": torch.ones(3)}}},
            "train_state": {"step": 250},
        }
    save(state, dst)
    for name in ("config.json", "trainer_state.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


@pytest.mark.parametrize("form", ["hf", "hf-wrapped", "torchtitan"])
def test_dcp_reads_bit_exact(tmp_path: Path, form: str) -> None:
    path = dcp_copy(SOURCE, tmp_path / "ckpt", form)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "config.json", "trainer_state.json"]
    ours, ref = Checkpoint(path), Checkpoint(SOURCE)
    assert ours.is_dcp and ours.warnings == []
    # 3 globals + 4 layers × (4 attention + 2 norms + router) + 4 × 8 experts × 3 matrices
    assert assert_same_weights(ours, ref) == 3 + 4 * 7 + 4 * 8 * 3
    summary = ours.summary()
    assert summary["files"] == [".metadata", "__0_0.distcp"]
    assert summary["parameters"] == ref.summary()["parameters"]
    assert summary["expert_storage"] == ("fused" if form == "torchtitan" else "per-expert")
    if form == "torchtitan":  # rope buffer dropped silently; optimizer state and step are noted
        assert summary["notes"] == [
            "1 DCP tensor(s) and 1 pickled entry that are not model weights left out "
            "(optimizer or trainer state: optimizer.state.tok_embeddings.weight.exp_avg, "
            "train_state.step…)"
        ]


def test_digest_covers_metadata_and_distcp(tmp_path: Path) -> None:
    path = dcp_copy(SOURCE, tmp_path / "ckpt", "hf")
    before = Checkpoint(path).digest
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1  # the zip trailer of the last record: not a weight byte, still in the digest
    data.write_bytes(bytes(raw))
    assert Checkpoint(path).digest != before
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    assert Checkpoint(path).digest == before
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes() + b"\n")  # bytes after STOP: the unpickler never sees them
    assert Checkpoint(path).digest != before


def test_multi_chunk_tensor_is_reassembled_and_must_tile(tmp_path: Path) -> None:
    """Two shards of one tensor (as FSDP ranks write them): the .metadata is rewritten with
    torch's own classes to say ``w`` is two row chunks; torch's dcp.load is the oracle."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    w = torch.randn(6, 5, dtype=torch.bfloat16)
    save({"w.top": w[:4].clone(), "w.bottom": w[4:].clone()}, tmp_path)
    meta_path = tmp_path / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())  # our own file, written a line above
    top, bottom = meta.state_dict_metadata.pop("w.top"), meta.state_dict_metadata.pop("w.bottom")
    top.size = torch.Size([6, 5])
    top.chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 5])),
        ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([2, 5])),
    ]
    meta.state_dict_metadata["w"] = top
    del bottom
    storage = {}
    for index, info in meta.storage_data.items():
        offset = torch.Size([0, 0]) if index.fqn == "w.top" else torch.Size([4, 0])
        storage[MetadataIndex("w", offset, 0)] = info
    meta.storage_data = storage
    meta_path.write_bytes(pickle.dumps(meta))

    got = DcpDirectory(tmp_path).read_entry("w")
    assert got.dtype == torch.bfloat16 and torch.equal(got, w)
    oracle = {"w": torch.zeros(6, 5, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(oracle, checkpoint_id=str(tmp_path))
    assert torch.equal(oracle["w"], got)

    meta.state_dict_metadata["w"].chunks[1] = ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 5]))
    meta.storage_data = {
        MetadataIndex("w", torch.Size([0, 0]) if i.offset == torch.Size([0, 0]) else torch.Size([3, 0]), 0): v
        for i, v in storage.items()
    }
    meta_path.write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match=r"tensor 'w': chunks at \[0, 0\] and \[3, 0\] overlap"):
        DcpDirectory(tmp_path)
    meta.state_dict_metadata["w"].chunks = meta.state_dict_metadata["w"].chunks[:1]
    meta_path.write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="tensor 'w': chunks cover 20 of 30 elements"):
        DcpDirectory(tmp_path)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MOEAUDIT_CACHE_DIR": str(cwd / "cache"),
        "XDG_CONFIG_HOME": str(cwd / "config"),
    }
    return subprocess.run(
        [sys.executable, "-m", "moeaudit", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


class _System:  # pickles as posix.system("touch MARKER")
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Exec:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize(
    "payload, refused", [("system", "posix.system"), ("exec", "builtins.exec"), ("nested", "builtins.exec")]
)
def test_malicious_metadata_is_refused_and_nothing_runs(tmp_path: Path, payload: str, refused: str) -> None:
    ckpt = dcp_copy(SOURCE, tmp_path / "ckpt", "hf")
    marker = tmp_path / "PWNED"
    meta_path = ckpt / ".metadata"
    if payload == "system":
        evil = pickle.dumps(_System(marker))
    elif payload == "exec":
        evil = pickle.dumps(_Exec(marker))
    else:  # a real Metadata whose storage_meta is a call: refused mid-stream, after the DCP classes
        meta = pickle.loads(meta_path.read_bytes())  # our own file
        meta.storage_meta = _Exec(marker)
        evil = pickle.dumps(meta)
    assert not marker.exists()
    meta_path.write_bytes(evil)
    proc = _cli("inspect", str(ckpt), cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"refusing to unpickle global {refused}: not a DCP metadata class" in lines[0]
    assert str(meta_path) in lines[0]
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=f"refusing to unpickle global {refused}"):
        Checkpoint(ckpt)
    assert not marker.exists()


def test_malicious_tensor_record_is_refused(tmp_path: Path) -> None:
    """The data.pkl inside a .distcp record goes through its own allow-list: a torch.save-style
    zip archive whose data.pkl calls os.system, put where the metadata says the tensor is."""
    marker = tmp_path / "PWNED"
    save({"model.embed_tokens.weight": torch.ones(2, 2)}, tmp_path / "c")
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(_System(marker), protocol=2))
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", bytes(16))
    (tmp_path / "c" / "__0_0.distcp").write_bytes(archive.getvalue())
    meta_path = tmp_path / "c" / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())  # our own file
    for info in meta.storage_data.values():
        info.offset, info.length = 0, len(archive.getvalue())
    meta_path.write_bytes(pickle.dumps(meta))
    d = DcpDirectory(tmp_path / "c")
    with pytest.raises(CheckpointError, match="refusing to unpickle global posix.system"):
        d.read_entry("model.embed_tokens.weight")
    assert not marker.exists()


def test_truncated_distcp_is_a_clear_error(tmp_path: Path) -> None:
    ckpt = dcp_copy(SOURCE, tmp_path / "ckpt", "hf")
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-1000])
    proc = _cli("inspect", str(ckpt), cwd=tmp_path)
    assert proc.returncode == 4
    line = proc.stderr.strip()
    assert "\n" not in line
    assert str(data) in line and "run past the end of the" in line and "truncated" in line


def test_no_config_and_ambiguous_format(tmp_path: Path) -> None:
    ckpt = dcp_copy(SOURCE, tmp_path / "ckpt", "hf")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json — copy the model's Hugging Face config.json"):
        Checkpoint(ckpt)
    shutil.copy(SOURCE / "config.json", ckpt)
    shutil.copy(SOURCE / "model.safetensors", ckpt)
    with pytest.raises(CheckpointError, match="both .metadata and model.safetensors"):
        Checkpoint(ckpt)
    (ckpt / "model.safetensors").rename(ckpt / "adapter_model.safetensors")  # another reader's weights
    with pytest.raises(CheckpointError, match=r"1 weight file\(s\) beside .metadata: adapter_model.safetensors"):
        Checkpoint(ckpt)


def json_diff(a: object, b: object, at: str = "") -> list[str]:
    """Where two JSON values differ (paths), for a readable failure."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in json_diff(a.get(k), b.get(k), f"{at}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in json_diff(x, y, f"{at}[{i}]")]
    return [] if a == b and type(a) is type(b) else [f"{at}: {a!r} != {b!r}"]


def _pop_left_out(doc: object) -> list[object]:
    """Remove (and return) every receipts document's ``checkpoint.left_out``."""
    if isinstance(doc, list):
        return [x for d in doc for x in _pop_left_out(d)]
    if not isinstance(doc, dict):
        return []
    found = (
        [doc["checkpoint"].pop("left_out")]
        if isinstance(doc.get("checkpoint"), dict) and "left_out" in doc["checkpoint"]
        else []
    )
    return found + [x for v in doc.values() for x in _pop_left_out(v)]


def test_certify_dcp_run_equals_safetensors_run(tmp_path: Path) -> None:
    """A run whose checkpoints are DCP (torchtitan names) certifies with the numbers of the
    same run saved as safetensors; the DCP receipts also name the optimizer state left out."""
    runs = {}
    for kind in ("safetensors", "dcp"):
        run = tmp_path / kind / "healthy"  # one run name: it is in the certificate
        run.mkdir(parents=True)
        for step in (250, 500):
            src = SAMPLES / "healthy" / f"checkpoint-{step}"
            if kind == "dcp":
                dcp_copy(src, run / f"step-{step}", "torchtitan")  # torchtitan's directory name
            else:
                shutil.copytree(src, run / f"checkpoint-{step}")
        for log in ("metrics.jsonl", "canary_probe.jsonl"):
            shutil.copy(SAMPLES / "healthy" / log, run)
        runs[kind] = run
    env = {"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    key = tmp_path / "key"
    assert CliRunner(env=env).invoke(cli, ["keygen", "--out", str(key)]).exit_code == 0
    docs: dict[str, dict[str, str]] = {}
    for kind, run in runs.items():
        out = tmp_path / f"out-{kind}"
        result = CliRunner(env=env).invoke(
            cli,
            [
                "certify",
                str(run),
                "--key",
                str(key),
                "--out",
                str(out),
                "--canary",
                str(SAMPLES / "canary.safetensors"),
            ],
        )
        assert result.exit_code == 0, result.stderr
        docs[kind] = {p.name: p.read_text() for p in sorted((out / "receipts").iterdir())}
        envelope = json.loads((out / "certificate.json").read_text())
        docs[kind]["predicate"] = json.dumps(signed_statement(envelope))
    assert (
        sorted(docs["dcp"])
        == sorted(docs["safetensors"])
        == ["checkpoint-250.json", "checkpoint-500.json", "envelope.json", "pair-500-vs-250.json", "predicate"]
    )
    # the checkpoints' digests, names and the run's path differ; every other byte must be the same
    renames = {str(runs["dcp"]): str(runs["safetensors"])}
    for step in (250, 500):
        ours, ref = (
            json.loads(docs[k][f"checkpoint-{step}.json"])["checkpoint"]["digest"]["sha256"]
            for k in ("dcp", "safetensors")
        )
        assert ours != ref
        renames[ours] = ref
    for name, text in docs["dcp"].items():
        for old, new in renames.items():
            text = text.replace(old, new)
        text = re.sub(r"\bstep-(250|500)\b", r"checkpoint-\1", text)  # the checkpoints' directory names
        ours, ref = json.loads(text), json.loads(docs["safetensors"][name])
        if name == "predicate":  # when it was signed
            for doc in (ours, ref):
                del doc["predicate"]["issued_at"]
            # the NLL interval is cached under its inputs, the per-window NLLs, which are the same
            assert "from_cache" not in ref["predicate"]
            assert ours["predicate"].pop("from_cache") == [{"kind": "nll_interval"}]
            for doc in (ours, ref):  # each lists its own files: DCP's .metadata and .distcp, or safetensors
                files = doc["predicate"].pop("checkpoint_files")
                assert [f["name"] for f in files] == [s["name"] for s in doc["subject"]]
        assert _pop_left_out(ref) == []
        lefts = _pop_left_out(ours)  # what is not replayed is in the receipts
        assert lefts or not name.startswith("checkpoint-"), name
        for left in lefts:
            assert left == [
                {
                    "what": "DCP entries that are not model weights",
                    "reason": "optimizer or trainer state",
                    "tensors": 2,
                    "names": ["optimizer.state.tok_embeddings.weight.exp_avg", "train_state.step"],
                }
            ]
        assert json_diff(ours, ref) == [], name


def test_torchtitan_step_dirs_are_a_run_and_may_not_repeat_a_step(tmp_path: Path) -> None:
    from moeaudit.errors import InputError
    from moeaudit.run import discover

    dcp_copy(SOURCE, tmp_path / "step-250", "hf")
    run = discover(tmp_path)
    assert run.steps == [250] and run.checkpoints[0][1].is_dcp
    shutil.copytree(SOURCE, tmp_path / "checkpoint-250")
    with pytest.raises(InputError, match="checkpoint-250 and step-250 are both step 250"):
        discover(tmp_path)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("metadata", r"unreadable DCP metadata \(UnpicklingError"),
        ("magic", r"tensor 'model.embed_tokens.weight': bytes at \d+ are not a torch.save record"),
        (
            "storage",
            r"tensor 'model.embed_tokens.weight': unreadable torch.save record \(archive/data/0 fails its CRC\)",
        ),
    ],
)
def test_damaged_files_are_clear_errors(tmp_path: Path, damage: str, message: str) -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save({"model.embed_tokens.weight": w}, tmp_path)
    if damage == "metadata":
        meta = tmp_path / ".metadata"
        meta.write_bytes(meta.read_bytes()[:200])
        with pytest.raises(CheckpointError, match=message):
            DcpDirectory(tmp_path)
        return
    chunk = DcpDirectory(tmp_path).entries["model.embed_tokens.weight"].chunks[0]
    data = tmp_path / chunk.file
    raw = bytearray(data.read_bytes())
    at = chunk.begin if damage == "magic" else raw.index(w.numpy().tobytes()) + 5
    raw[at] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=message):
        DcpDirectory(tmp_path).read_entry("model.embed_tokens.weight")
