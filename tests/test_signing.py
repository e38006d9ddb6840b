"""DSSE signing: the PAE test vector, verify(sign(x)) = x, any flipped byte fails, and an
independent DSSE implementation (securesystemslib) verifies our envelopes."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from moeaudit.attest.certificate import PREDICATE_TYPE, STATEMENT_TYPE, canonical_json, sign_statement
from moeaudit.attest.signing import (
    PAYLOAD_TYPE,
    SignatureInvalid,
    generate_key,
    key_hint,
    keyid,
    load_private_key,
    load_public_key,
    pae,
    sign_envelope,
    verify_envelope,
)
from moeaudit.cli import cli
from moeaudit.errors import InputError


def test_pae_vector() -> None:
    assert (
        pae("http://example.com/HelloWorld", b"hello world")
        == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


@given(st.text(max_size=20), st.binary(max_size=40), st.text(max_size=20), st.binary(max_size=40))
def test_pae_injective(t1: str, b1: bytes, t2: str, b2: bytes) -> None:
    if (t1, b1) != (t2, b2):
        assert pae(t1, b1) != pae(t2, b2)


@pytest.fixture(params=["ed25519", "ecdsa-p256"])
def keypair(request, tmp_path: Path):
    key = generate_key(tmp_path / "k", algorithm=request.param)
    return key, tmp_path / "k", tmp_path / "k.pub"


def _statement() -> dict:
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": "checkpoint-1", "digest": {"sha256": "ab" * 32}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {"verdict": "PASS", "gates": []},
    }


def test_round_trip_and_independent_verifier(keypair, tmp_path: Path) -> None:
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    key, _, pub_path = keypair
    env = sign_statement(_statement(), key, issued_at="2026-01-01T00:00:00Z")
    raw = json.dumps(env).encode()
    verified = verify_envelope(raw, load_public_key(pub_path), tmp_path / "c.json")
    body = json.loads(verified.body)
    # v2 predicate: lowerCamelCase on the wire (in-toto's convention), as an independent reader sees it
    assert body["predicate"]["verdict"] == "PASS" and body["predicate"]["issuedAt"] == "2026-01-01T00:00:00Z"
    assert verified.body == canonical_json(body)
    ssl_key = SSlibKey.from_crypto(key.public_key(), keyid=keyid(key.public_key()))
    assert Envelope.from_dict(env).verify([ssl_key], 1)


def test_ed25519_is_deterministic(tmp_path: Path) -> None:
    key = generate_key(tmp_path / "k", algorithm="ed25519")
    a = sign_statement(_statement(), key, issued_at="2026-01-01T00:00:00Z")
    b = sign_statement(_statement(), key, issued_at="2026-01-01T00:00:00Z")
    assert a == b


def test_p256_same_payload_fresh_signature(tmp_path: Path) -> None:
    """ECDSA signatures are randomized: the signed bytes are identical, the signatures are not,
    and both verify (the determinism rule is about the payload; docs/decisions.md)."""
    key = generate_key(tmp_path / "k")  # the default: P-256
    a = sign_statement(_statement(), key, issued_at="2026-01-01T00:00:00Z")
    b = sign_statement(_statement(), key, issued_at="2026-01-01T00:00:00Z")
    assert a["payload"] == b["payload"] and a["signatures"][0]["sig"] != b["signatures"][0]["sig"]
    for env in (a, b):
        assert verify_envelope(
            json.dumps(env).encode(), key.public_key(), tmp_path / "c.json"
        ).body == base64.b64decode(a["payload"])


def _flip(b64: str, index: int) -> str:
    raw = bytearray(base64.b64decode(b64))
    raw[index % len(raw)] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


@given(st.integers(min_value=0, max_value=10_000), st.sampled_from(["payload", "sig"]))
def test_any_flipped_byte_fails(tmp_path_factory, index: int, where: str) -> None:
    d = tmp_path_factory.mktemp("flip")
    key = generate_key(d / "k")
    env = sign_envelope(key, canonical_json(_statement()))
    if where == "payload":
        env["payload"] = _flip(env["payload"], index)
    else:
        env["signatures"][0]["sig"] = _flip(env["signatures"][0]["sig"], index)
    with pytest.raises(SignatureInvalid):
        verify_envelope(json.dumps(env).encode(), key.public_key(), d / "c.json")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda e: e.__setitem__("payloadType", "application/json"), "payloadType"),
        (lambda e: e["signatures"].append(dict(e["signatures"][0])), "exactly one signature"),
        (lambda e: e["signatures"][0].__setitem__("keyid", "00" * 32), "not by this public key"),
        (lambda e: e.__setitem__("extra", 1), "not a DSSE envelope"),
        (lambda e: e.__setitem__("payload", "%%%"), "not valid base64"),
    ],
)
def test_malformed_envelopes(tmp_path: Path, mutate, message: str) -> None:
    key = generate_key(tmp_path / "k")
    env = sign_envelope(key, canonical_json(_statement()))
    mutate(env)
    with pytest.raises(SignatureInvalid, match=message):
        verify_envelope(json.dumps(env).encode(), key.public_key(), tmp_path / "c.json")


def test_other_key_fails(tmp_path: Path) -> None:
    key, other = generate_key(tmp_path / "a"), generate_key(tmp_path / "b")
    env = sign_envelope(key, canonical_json(_statement()))
    with pytest.raises(SignatureInvalid, match="not by this public key"):
        verify_envelope(json.dumps(env).encode(), other.public_key(), tmp_path / "c.json")


def test_keygen_cli_modes_and_refusal(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["keygen", "--out", str(tmp_path / "key")])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(os.stat(tmp_path / "key").st_mode) == 0o600
    public = load_public_key(tmp_path / "key.pub")
    # both names of the key: the keyid verify prints, the hint Sigstore bundles carry (claims list)
    assert f"; keyid {keyid(public)}; key hint {key_hint(public)}" in result.output
    again = runner.invoke(cli, ["keygen", "--out", str(tmp_path / "key")])
    assert again.exit_code == 4 and "--force" in again.stderr


def test_passphrase_key_and_world_readable_warning(tmp_path: Path, monkeypatch) -> None:
    generate_key(tmp_path / "k", passphrase=b"s3cret")
    with pytest.raises(InputError, match="encrypted"):
        load_private_key(tmp_path / "k")
    monkeypatch.setenv("MOEAUDIT_KEY_PASSPHRASE", "s3cret")
    key, warnings = load_private_key(tmp_path / "k")
    assert not warnings
    os.chmod(tmp_path / "k", 0o644)
    _, warnings = load_private_key(tmp_path / "k")
    assert "readable by other users" in warnings[0]


def test_garbage_pem(tmp_path: Path) -> None:
    (tmp_path / "bad.pub").write_text("-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n")
    with pytest.raises(InputError, match="not a PEM public key"):
        load_public_key(tmp_path / "bad.pub")


def test_verify_cli_exit_codes(tmp_path: Path) -> None:
    key = generate_key(tmp_path / "k")
    stmt = _statement()
    stmt["predicate"]["run"] = {"path": str(tmp_path)}
    env = sign_statement(stmt, key)
    cert = tmp_path / "certificate.json"
    cert.write_text(json.dumps(env))
    runner = CliRunner()
    ok = runner.invoke(cli, ["verify", str(cert), "--pubkey", str(tmp_path / "k.pub")])
    assert ok.exit_code == 0 and "valid" in ok.output
    env["payload"] = _flip(env["payload"], 30)
    cert.write_text(json.dumps(env))
    bad = runner.invoke(cli, ["verify", str(cert), "--pubkey", str(tmp_path / "k.pub")])
    assert bad.exit_code == 1 and bad.stderr.count("\n") == 1
    assert PAYLOAD_TYPE == "application/vnd.in-toto+json"
