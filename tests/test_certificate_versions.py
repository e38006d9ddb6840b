"""An auditor handed a certificate from another moeaudit version, or another statement moeaudit
signs: a training-health predicate type this version does not read, an export report or an
attestation is named as such (exit 4, one line), not as "not a moeaudit statement"; the v1
fixture still verifies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeaudit import __version__
from moeaudit.attest.certificate import canonical_json
from moeaudit.attest.signing import generate_key, load_private_key, sign_envelope
from moeaudit.cli import cli

STATEMENT = Path(__file__).parent / "fixtures" / "statement_example.json"


def _signed(tmp_path: Path, edit: dict[str, object]) -> tuple[Path, Path]:
    key = tmp_path / "key"
    generate_key(key)
    stmt = {**json.loads(STATEMENT.read_text()), **edit}
    cert = tmp_path / "certificate.json"
    cert.write_text(json.dumps(sign_envelope(load_private_key(key)[0], canonical_json(stmt))))
    return cert, Path(f"{key}.pub")


def _verify(cert: Path, pub: Path) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["verify", str(cert), "--pubkey", str(pub)])
    return result.exit_code, result.stdout, result.stderr


def test_a_newer_predicate_version_is_named_as_one(tmp_path: Path) -> None:
    cert, pub = _signed(tmp_path, {"predicateType": "https://moeaudit.dev/training-health/v3"})
    code, out, err = _verify(cert, pub)
    assert code == 4 and out == ""
    assert err.count("\n") == 1
    assert err == (
        f"moeaudit: error: {cert}: the signature is valid, but its predicateType "
        f"'https://moeaudit.dev/training-health/v3' is a training-health version this moeaudit "
        f"({__version__}) does not read (it reads v1 and v2) — verify it with the moeaudit version "
        "that wrote it, or a newer one\n"
    )


def test_another_predicate_family_is_still_not_a_moeaudit_statement(tmp_path: Path) -> None:
    cert, pub = _signed(tmp_path, {"predicateType": "https://slsa.dev/provenance/v1"})
    code, _, err = _verify(cert, pub)
    assert code == 4 and "signed payload is not a moeaudit training-health statement" in err


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("https://moeaudit.dev/compliance-export/v1", "an export report (export --sign)"),
        ("https://in-toto.io/attestation/svr/v0.2", "a verification result (verify --attest-verification)"),
        ("https://in-toto.io/attestation/test-result/v0.1", "a promotion check's result (gate --attest-test-result)"),
        ("https://moeaudit.dev/preregistration/v1", "a preregistration (moeaudit preregister)"),
    ],
)
def test_moeaudits_other_signed_statements_are_named(tmp_path: Path, kind: str, what: str) -> None:
    """An auditor handing verify OUT.dsse.json or an attestation is told what it holds."""
    cert, pub = _signed(tmp_path, {"predicateType": kind})
    code, out, err = _verify(cert, pub)
    hint = (
        "check an export with verify FILE --certificate CERT (the certificate it was made from)"
        if "export" in kind
        else "give verify certificate.json or certificate.sigstore.json as certify wrote it"
    )
    assert code == 4 and out == ""
    assert err == (
        f"moeaudit: error: {cert}: the signature is valid, but this is {what}, not a training-health "
        f"certificate — {hint}\n"
    )


def test_the_v1_fixture_still_verifies(tmp_path: Path) -> None:
    cert, pub = _signed(tmp_path, {})
    code, out, _ = _verify(cert, pub)
    assert code == 0 and out.startswith(f"valid: {cert} signed by keyid ")
    assert "; verdict INCONCLUSIVE; 5 checkpoint(s);" in out
