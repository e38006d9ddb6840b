"""Header-only commands do not import torch (docs/decisions.md, "A fully cached certify loads
neither torch nor numpy"): ``inspect``,
``canary show`` and ``verify --recheck`` read safetensors headers, the canary's stored bytes
and file digests; importing torch cost each of them ~1.5–3 s. They, and a fully cached
``certify``, load no numpy either (~0.05 s of a 0.3 s warm certify)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from signed import signed_statement
from support.torch_free import PROBE, ROOT, _modules_after  # noqa: E402

SAMPLES = ROOT / "sample_checkpoints"
CKPT = SAMPLES / "healthy" / "checkpoint-250"

pytestmark = pytest.mark.skipif(not CKPT.is_dir(), reason="sample runs not built")


def test_inspect_and_canary_show_do_not_import_torch() -> None:
    loaded = _modules_after(
        [
            ["inspect", str(CKPT)],
            ["inspect", str(CKPT), "--json"],
            ["canary", "show", str(SAMPLES / "canary.safetensors")],
        ]
    )
    assert loaded == []  # neither torch nor numpy


def test_verify_recheck_does_not_import_torch(tmp_path: Path) -> None:
    from moeaudit.attest.certificate import sign_statement, statement
    from moeaudit.attest.signing import generate_key
    from moeaudit.checkpoint.digest import root_digest
    from moeaudit.jsonio import dumps
    from moeaudit.run import checkpoint_dirs

    key = generate_key(tmp_path / "key")
    # every checkpoint of the run: one it does not list would be a finding (added since), exit 1
    subjects = [{"name": p.name, "digest": {"sha256": root_digest(p)[0]}} for _, p in checkpoint_dirs(CKPT.parent)]
    stmt = statement(subjects, {"verdict": "PASS", "gates": [], "run": {"name": "healthy", "path": str(CKPT.parent)}})
    signed = sign_statement(stmt, key, issued_at="2026-01-01T00:00:00Z")
    (tmp_path / "cert.json").write_text(dumps(signed))
    loaded = _modules_after(
        [["verify", str(tmp_path / "cert.json"), "--pubkey", str(tmp_path / "key.pub"), "--recheck"]]
    )
    assert "torch" not in loaded


def test_a_fully_cached_certify_does_not_import_torch(tmp_path: Path) -> None:
    """With every receipt and pair in the cache, certify is JSON and algebra."""
    from moeaudit.attest.signing import generate_key

    generate_key(tmp_path / "key")
    run = [
        "certify",
        str(SAMPLES / "healthy"),
        "--key",
        str(tmp_path / "key"),
        "--canary",
        str(SAMPLES / "canary.safetensors"),
        "--policy",
        str(SAMPLES / "policy.toml"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([[*run, "--out", str(tmp_path / "a")]])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr
    assert "torch" in json.loads(first.stdout.strip().splitlines()[-1])  # it replayed
    second = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([[*run, "--out", str(tmp_path / "b")]])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1]) == []  # neither torch nor numpy
    a = json.loads((tmp_path / "a" / "certificate.json").read_text())
    b = json.loads((tmp_path / "b" / "certificate.json").read_text())
    pa = signed_statement(a)["predicate"]
    pb = signed_statement(b)["predicate"]
    for p in (pa, pb):
        p.pop("issued_at"), p.pop("from_cache", None)
    assert pa == pb  # the same numbers, from the cache
