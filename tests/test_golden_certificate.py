"""Golden certificate for the healthy sample run, signed with a fixed test key (Ed25519 is
deterministic) at a fixed issue time: the payload, signature and HTML bytes are pinned.

After an intended change to receipts or rendering, regenerate with
``MOEAUDIT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_certificate.py`` and review the diff.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import pytest

from moeaudit.attest.signing import load_private_key, load_public_key, verify_envelope
from moeaudit.canary import load
from moeaudit.certify import audit_run, write_outputs
from moeaudit.judge.policy import load_policy

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
ISSUED_AT = "2026-01-01T00:00:00Z"

pytestmark = pytest.mark.skipif(not (ROOT / "sample_checkpoints" / "healthy").is_dir(),
                                reason="sample runs not built")


def _certify(out: Path) -> tuple[dict, bytes, bytes]:
    key, _ = load_private_key(GOLDEN / "test-signing-key.pem")
    audit = audit_run(Path("sample_checkpoints/healthy"), load(ROOT / "sample_checkpoints/canary.safetensors"),
                      load_policy(Path("sample_checkpoints/policy.toml")))
    paths = write_outputs(audit, key, out, issued_at=ISSUED_AT)
    return audit.statement, paths["certificate"].read_bytes(), paths["html"].read_bytes()


def test_healthy_certificate_is_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    _, cert, html = _certify(tmp_path / "a")
    envelope = json.loads(cert)
    verified = verify_envelope(cert, load_public_key(GOLDEN / "test-signing-key.pem.pub"), tmp_path / "c.json")
    statement = json.loads(verified.body)
    pretty = json.dumps(statement, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    pinned = {"signature": envelope["signatures"][0]["sig"],
              "payload_sha256": hashlib.sha256(verified.body).hexdigest(),
              "html_sha256": hashlib.sha256(html).hexdigest()}
    if os.environ.get("MOEAUDIT_UPDATE_GOLDEN"):
        (GOLDEN / "healthy.statement.json").write_text(pretty, encoding="utf-8")
        (GOLDEN / "healthy.pins.json").write_text(json.dumps(pinned, indent=1) + "\n", encoding="utf-8")
    assert pretty == (GOLDEN / "healthy.statement.json").read_text(encoding="utf-8")
    assert pinned == json.loads((GOLDEN / "healthy.pins.json").read_text(encoding="utf-8"))
    assert statement["predicate"]["verdict"] == "PASS"
    assert base64.b64decode(envelope["payload"]) == verified.body


def test_same_inputs_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    _, cert_a, html_a = _certify(tmp_path / "a")
    _, cert_b, html_b = _certify(tmp_path / "b")
    assert cert_a == cert_b and html_a == html_b
