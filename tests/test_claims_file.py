"""``moeaudit claims``: claims.jsonl beside a checkpoint, one Sigstore bundle per line whose
statement names the directory's OpenSSF model-signing root digest. The digest is checked against
model-signing's own (``ignore_paths=[claims.jsonl]``, and its default before the file exists),
every line is verified by sigstore-js (npm's Sigstore verifier) when installed, and appends are
whole-file renames that keep the earlier bytes."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from moeaudit.attest.signing import generate_key
from moeaudit.cli import cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
SIGSTORE_JS = Path(__file__).resolve().parent / "sigstore_js"
needs_samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")
has_sigstore_js = shutil.which("node") is not None and (SIGSTORE_JS / "node_modules/@sigstore/verify").is_dir()


def _ms_root(path: Path, *ignored: str) -> str:
    """model-signing 1.1.1's root digest of ``path`` (its default configuration, plus ``ignored``)."""
    hashing = pytest.importorskip("model_signing.hashing")
    from model_signing._signing import signing

    config = hashing.Config().set_ignored_paths(paths=[path / name for name in ignored], ignore_git_paths=True)
    return str(signing.Payload(config.hash(path)).statement.pb.subject[0].digest["sha256"])


def _sigstore_js(bundle: dict[str, Any], pub: Path, digest: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    f = tmp / "line.sigstore.json"
    f.write_text(json.dumps(bundle))
    return subprocess.run(
        ["node", str(SIGSTORE_JS / "verify_bundle.js"), str(f), str(pub), digest],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _run(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner(env=env).invoke(cli, list(args))


@pytest.fixture()
def certified(tmp_path: Path, samples_cache: Path) -> tuple[Path, Path, Path]:
    """(run dir, out dir, signer's key) for two healthy sample checkpoints, certified."""
    generate_key(tmp_path / "k")
    run = tmp_path / "run"
    run.mkdir()
    for step in (1250, 1500):
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{step}", run / f"checkpoint-{step}")
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(samples_cache)}).invoke(
        cli,
        [
            "certify",
            str(run),
            "--out",
            str(tmp_path / "out"),
            "--key",
            str(tmp_path / "k"),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--policy",
            str(SAMPLES / "policy.toml"),
        ],
    )
    assert result.exit_code == 0, result.stderr
    return run, tmp_path / "out", tmp_path / "k"


@needs_samples
def test_claims_add_list_verify_round_trip(certified: tuple[Path, Path, Path], tmp_path: Path) -> None:
    run, out, key = certified
    pub = Path(f"{key}.pub")
    ckpt = run / "checkpoint-1500"
    before = _ms_root(ckpt)  # model-signing's default digest, no claims.jsonl yet
    added = _run("claims", "add", str(ckpt), str(out / "certificate.sigstore.json"), "--pubkey", str(pub))
    assert added.exit_code == 0, added.stderr
    assert f"added line 1 to {ckpt / 'claims.jsonl'} (subject sha256:{before})" in added.stdout
    first = (ckpt / "claims.jsonl").read_bytes()
    # the DSSE envelope of the same certificate is the same bundle: not added twice
    again = _run("claims", "add", str(ckpt), str(out / "certificate.json"), "--pubkey", str(pub))
    assert again.exit_code == 0 and "holds this claim already (line 1)" in again.stdout
    assert (ckpt / "claims.jsonl").read_bytes() == first
    # an unsigned statement is signed with --key; without subjects it gets the directory's
    stmt = {
        "_type": "https://in-toto.io/Statement/v1",
        "predicateType": "https://example.com/eval/v1",
        "predicate": {"score": 0.5},
    }
    (tmp_path / "stmt.json").write_text(json.dumps(stmt))
    second = _run("claims", "add", str(ckpt), str(tmp_path / "stmt.json"), "--key", str(key))
    assert second.exit_code == 0, second.stderr
    raw = (ckpt / "claims.jsonl").read_bytes()
    assert raw.startswith(first) and raw.count(b"\n") == 2 and raw.endswith(b"\n")  # appended, old bytes kept
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".")] == []  # no temp file left
    # the digest leaves claims.jsonl out: model-signing agrees with ignore_paths, and the
    # certificate's recheck still holds
    assert _ms_root(ckpt, "claims.jsonl") == before != _ms_root(ckpt)
    recheck = _run("verify", str(out / "certificate.json"), "--pubkey", str(pub), "--recheck")
    assert recheck.exit_code == 0, recheck.stdout + recheck.stderr
    lines = [json.loads(line) for line in raw.splitlines()]
    statements = [json.loads(base64.b64decode(b["dsseEnvelope"]["payload"])) for b in lines]
    assert statements[0]["predicateType"] == "https://moeaudit.dev/training-health/v2"
    assert {s["digest"]["sha256"] for s in statements[0]["subject"]} == {_ms_root(run / "checkpoint-1250"), before}
    assert statements[1]["subject"] == [{"name": "checkpoint-1500", "digest": {"sha256": before}}]
    listed = _run("claims", "list", str(ckpt), "--json")
    assert listed.exit_code == 0, listed.stderr
    rows = json.loads(listed.stdout)["claims"]
    assert [(r["line"], r["predicate_type"], r["names_this_directory"]) for r in rows] == [
        (1, "https://moeaudit.dev/training-health/v2", True),
        (2, "https://example.com/eval/v1", True),
    ]
    # another signer's keyless line (a Fulcio certificate): listed, not verified, not a failure
    keyless = json.loads(json.dumps(lines[1]))
    keyless["verificationMaterial"] = {"certificate": {"rawBytes": "MIIB"}, "tlogEntries": [{"logIndex": "1"}]}
    with open(ckpt / "claims.jsonl", "ab") as f:
        f.write(json.dumps(keyless, separators=(",", ":")).encode() + b"\n")
    ok = _run("claims", "verify", str(ckpt), "--pubkey", str(pub))
    assert ok.exit_code == 0, ok.stdout + ok.stderr
    assert ok.stdout.count(": verified: ") == 2
    assert "line 3: not-verified: a keyless bundle" in ok.stdout
    # verify names the signer by both of its names, so a line of `claims list` (key hint) can be
    # matched to `verify`'s and `keygen`'s keyid
    from moeaudit.attest.signing import key_hint, keyid, load_public_key

    public = load_public_key(pub)
    assert ok.stdout.count(f"(keyid {keyid(public)[:16]}…; key hint {key_hint(public)[:16]}…)") == 2
    assert _run("claims", "list", str(ckpt)).stdout.count(f"key hint {key_hint(public)[:16]}…") == 2
    if has_sigstore_js:  # each line, verified by sigstore-js against model-signing's digest
        for bundle in lines:
            done = _sigstore_js(bundle, pub, before, tmp_path)
            assert done.returncode == 0 and '"verified":true' in done.stdout, done.stderr


@needs_samples
def test_claims_verify_fails_on_changed_files_tampering_and_other_keys(
    certified: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    run, out, key = certified
    pub = Path(f"{key}.pub")
    ckpt = run / "checkpoint-1500"
    assert _run("claims", "add", str(ckpt), str(out / "certificate.json"), "--pubkey", str(pub)).exit_code == 0
    generate_key(tmp_path / "other")
    other = _run("claims", "verify", str(ckpt), "--pubkey", str(tmp_path / "other.pub"))
    assert other.exit_code == 1 and "not one of the keys given" in other.stdout
    # the signer's hint and the given key's hint, each once and under its own role
    from moeaudit.attest.signing import key_hint, load_public_key

    signer, given = key_hint(load_public_key(pub))[:16], key_hint(load_public_key(tmp_path / "other.pub"))[:16]
    assert f"line 1: not-verified: signed by key hint {signer}…, not one of the keys given (key hint {given}…)\n" in (
        other.stdout
    )
    assert other.stdout.count(signer) == 1
    assert "no claim in the file is signed by a key given" in other.stderr
    # a signed byte changed: the signature no longer holds
    good = (ckpt / "claims.jsonl").read_bytes()
    bundle = json.loads(good)
    payload = base64.b64decode(bundle["dsseEnvelope"]["payload"]).replace(b'"PASS"', b'"FAIL"', 1)
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(payload).decode()
    (ckpt / "claims.jsonl").write_text(json.dumps(bundle) + "\n")
    tampered = _run("claims", "verify", str(ckpt), "--pubkey", str(pub))
    assert tampered.exit_code == 1 and "line 1: invalid: signature does not verify" in tampered.stdout
    if has_sigstore_js:
        assert _sigstore_js(bundle, pub, _ms_root(ckpt, "claims.jsonl"), tmp_path).returncode != 0
    # the model's files changed since: the claim is about other bytes
    (ckpt / "claims.jsonl").write_bytes(good)
    config = (ckpt / "config.json").read_bytes()
    (ckpt / "config.json").write_bytes(config + b"\n")
    changed = _run("claims", "verify", str(ckpt), "--pubkey", str(pub))
    assert changed.exit_code == 1 and "line 1: other-subject" in changed.stdout
    assert "the files changed since it was signed" in changed.stdout
    (ckpt / "config.json").write_bytes(config)
    # half a line (a writer that did not rename whole): an input error, not a claim
    (ckpt / "claims.jsonl").write_bytes(good + good[: len(good) // 2])
    half = _run("claims", "verify", str(ckpt), "--pubkey", str(pub))
    assert half.exit_code == 4 and "line 2 is not JSON" in half.stderr
    refused = _run("claims", "add", str(ckpt), str(out / "certificate.json"), "--pubkey", str(pub))
    assert refused.exit_code == 4 and (ckpt / "claims.jsonl").read_bytes() == good + good[: len(good) // 2]


@needs_samples
def test_claims_add_refuses_a_claim_about_other_bytes_and_writes_nothing(
    certified: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    run, out, key = certified
    pub = Path(f"{key}.pub")
    elsewhere = tmp_path / "checkpoint-250"
    shutil.copytree(SAMPLES / "healthy" / "checkpoint-250", elsewhere)  # not certified above
    result = _run("claims", "add", str(elsewhere), str(out / "certificate.sigstore.json"), "--pubkey", str(pub))
    assert result.exit_code == 1 and "does not name this directory" in result.stderr
    assert not (elsewhere / "claims.jsonl").exists()
    generate_key(tmp_path / "other")
    forged = _run(
        "claims",
        "add",
        str(run / "checkpoint-1500"),
        str(out / "certificate.json"),
        "--pubkey",
        str(tmp_path / "other.pub"),
    )
    assert forged.exit_code == 1 and not (run / "checkpoint-1500" / "claims.jsonl").exists()
    missing = _run("claims", "verify", str(elsewhere), "--pubkey", str(pub))
    assert missing.exit_code == 4 and "claims file not found" in missing.stderr
    not_dir = _run("claims", "verify", str(tmp_path / "nope"), "--pubkey", str(pub))
    assert not_dir.exit_code == 4
    (tmp_path / "elsewhere.jsonl").write_bytes(b"")
    (elsewhere / "claims.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    linked = _run("claims", "verify", str(elsewhere), "--pubkey", str(pub))
    assert linked.exit_code == 4 and "symbolic link" in linked.stderr


def test_appends_are_serialised_and_whole(tmp_path: Path) -> None:
    """Two processes appending at once: every line lands whole, none is lost (the lock on the
    directory; the rename writes the whole file)."""
    from concurrent.futures import ThreadPoolExecutor

    from moeaudit.attest.certificate import canonical_json
    from moeaudit.attest.claims_file import append, read_claims
    from moeaudit.attest.signing import sign_envelope, to_bundle

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.bin").write_bytes(b"x")
    key = generate_key(tmp_path / "k")
    bundles = [
        to_bundle(
            sign_envelope(key, canonical_json({"_type": "https://in-toto.io/Statement/v1", "n": i})), key.public_key()
        )
        for i in range(12)
    ]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda b: append(tmp_path / "m", b), bundles))
    _, lines = read_claims(tmp_path / "m")
    assert sorted(json.loads(base64.b64decode(line.bundle["dsseEnvelope"]["payload"]))["n"] for line in lines) == list(
        range(12)
    )


def test_the_digest_never_covers_an_appends_temporary_file(tmp_path: Path) -> None:
    """An append's temporary file lies beside claims.jsonl until its rename; a root digest taken
    meanwhile (another `claims add`, `list` or `verify`) must wait for it, not cover it — else
    concurrent adds sign claims about a directory that never existed."""
    import threading

    from moeaudit.attest.claims_file import _directory_lock, subject_digest

    model = tmp_path / "m"
    model.mkdir()
    (model / "w.bin").write_bytes(b"x")
    clean = subject_digest(model)
    inside, seen = threading.Event(), []

    def writer() -> None:
        with _directory_lock(model):
            tmp = model / ".claims.jsonl.abc.tmp"
            tmp.write_bytes(b"half")
            inside.set()
            time.sleep(0.5)
            tmp.unlink()

    thread = threading.Thread(target=writer)
    thread.start()
    assert inside.wait(10)
    seen.append(subject_digest(model))
    thread.join()
    assert seen == [clean]
