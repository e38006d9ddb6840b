"""A signed export names the files whose bytes it digests, and ``verify OUT.dsse.json
--certificate CERT`` checks the export against them (docs/security.md, "Signed exports"):

* the first subject is the certificate file as exported (``certificate.sigstore.json`` when the
  bundle was exported, its bytes' SHA-256), the second the report file beside the signature;
* verify exits 0 when the signature holds and both files hash to the signed digests, 1 (one line
  naming the file) when the certificate is another, the report was edited or is gone, or the
  signature does not hold; the other statements moeaudit signs name what they digest."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from moeaudit.attest.certificate import sign_statement
from moeaudit.attest.signing import (
    default_key_path,
    generate_key,
    load_public_key,
    sign_envelope,
    to_bundle,
    verify_signed,
)
from moeaudit.cli import cli
from moeaudit.jsonio import atomic_write, dumps

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "healthy.statement.json"


@pytest.fixture
def signer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    """The default moeaudit key (export --sign signs with it) and its public key."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    default_key_path().parent.mkdir(parents=True)
    return generate_key(default_key_path()), Path(f"{default_key_path()}.pub")


def _certificates(key: Any, pub: Path, where: Path) -> tuple[Path, Path]:
    """certificate.json and certificate.sigstore.json of the healthy golden statement."""
    where.mkdir(exist_ok=True)
    env = sign_statement(json.loads(GOLDEN.read_text()), key, issued_at="2026-05-02T14:03:11Z")
    cert = atomic_write(where / "certificate.json", dumps(env))
    bundle = atomic_write(where / "certificate.sigstore.json", dumps(to_bundle(env, load_public_key(pub))))
    return cert, bundle


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def _export(cert: Path, out: Path) -> Path:
    code, _, err = _run("export", str(cert), "--framework", "eu-ai-act", "--out", str(out), "--sign")
    assert code == 0, err
    return Path(f"{out}.dsse.json")


def _body(signed: Path, pub: Path) -> dict[str, Any]:
    return json.loads(verify_signed(signed.read_bytes(), load_public_key(pub), signed).body)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("which", ["certificate.json", "certificate.sigstore.json"])
@pytest.mark.parametrize("suffix", [".md", ".html", ".json"])
def test_the_subjects_name_the_files_whose_bytes_they_digest(
    signer: tuple[Any, Path], tmp_path: Path, which: str, suffix: str
) -> None:
    key, pub = signer
    cert = dict(zip(("certificate.json", "certificate.sigstore.json"), _certificates(key, pub, tmp_path / "c")))[which]
    out = tmp_path / f"report{suffix}"
    body = _body(_export(cert, out), pub)
    assert body["subject"] == [
        {"name": which, "digest": {"sha256": _sha(cert)}},
        {"name": f"report{suffix}", "digest": {"sha256": _sha(out)}},
    ]


def test_verify_with_certificate_checks_the_export(signer: tuple[Any, Path], tmp_path: Path) -> None:
    key, pub = signer
    cert, bundle = _certificates(key, pub, tmp_path / "c")
    out = tmp_path / "eu.md"
    signed = _export(bundle, out)
    code, stdout, err = _run("verify", str(signed), "--certificate", str(bundle), "--pubkey", str(pub))
    assert (code, err) == (0, "")
    assert stdout == (
        f"valid: {signed} signed by keyid {_keyid(signed)}; eu-ai-act export of {bundle} "
        f"(sha256 {_sha(bundle)[:16]}…); report {out} unchanged\n"
    )
    # the same statement in certificate.json is other bytes: not the certificate exported
    code, stdout, err = _run("verify", str(signed), "--certificate", str(cert), "--pubkey", str(pub))
    assert (code, stdout) == (1, "")
    assert err == (
        f"moeaudit: error: {cert}: digest {_sha(cert)[:16]}… is not the certificate the export signs "
        f"(certificate.sigstore.json, {_sha(bundle)[:16]}…): another certificate, or changed since the export — "
        "pass the certificate the report was exported from\n"
    )
    # the report edited: one line naming it
    signed_digest = _sha(out)
    out.write_text(out.read_text() + "covered: everything\n")
    code, stdout, err = _run("verify", str(signed), "--certificate", str(bundle), "--pubkey", str(pub))
    assert (code, stdout) == (1, "")
    assert err == (
        f"moeaudit: error: {out}: changed since it was signed: digest now {_sha(out)[:16]}…, signed "
        f"{signed_digest[:16]}… — do not trust this copy of the report; export it again from the certificate\n"
    )
    out.unlink()
    code, _, err = _run("verify", str(signed), "--certificate", str(bundle), "--pubkey", str(pub))
    assert code == 1 and err.startswith(f"moeaudit: error: {out}: missing: the export signs this report file")
    assert err.count("\n") == 1


def _keyid(signed: Path) -> str:
    return str(json.loads(signed.read_bytes())["signatures"][0]["keyid"])


def test_another_signer_or_an_edited_statement_is_exit_1(signer: tuple[Any, Path], tmp_path: Path) -> None:
    key, pub = signer
    cert, _ = _certificates(key, pub, tmp_path / "c")
    signed = _export(cert, tmp_path / "eu.json")
    other = generate_key(tmp_path / "other.pem")
    code, stdout, err = _run("verify", str(signed), "--certificate", str(cert), "--pubkey", f"{tmp_path}/other.pem.pub")
    assert (code, stdout) == (1, "") and err.startswith(f"moeaudit: error: {signed}: signed by key ")
    env = json.loads(signed.read_bytes())
    stmt = json.loads(base64.b64decode(env["payload"]))
    stmt["subject"][0]["digest"]["sha256"] = "0" * 64
    env["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    signed.write_text(json.dumps(env))
    code, stdout, err = _run("verify", str(signed), "--certificate", str(cert), "--pubkey", str(pub))
    assert (code, stdout) == (1, "") and err.startswith(f"moeaudit: error: {signed}: ") and err.count("\n") == 1
    assert other is not None


def test_an_export_signed_before_reports_were_bound_checks_the_certificate(
    signer: tuple[Any, Path], tmp_path: Path
) -> None:
    """A statement with the certificate as its only subject (moeaudit 0.3) still checks."""
    key, pub = signer
    cert, _ = _certificates(key, pub, tmp_path / "c")
    stmt = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": "certificate.json", "digest": {"sha256": _sha(cert)}}],
        "predicateType": "https://moeaudit.dev/compliance-export/v1",
        "predicate": {"framework": {"key": "sr-11-7"}},
    }
    signed = atomic_write(tmp_path / "old.md.dsse.json", dumps(sign_envelope(key, json.dumps(stmt).encode())))
    code, stdout, _ = _run("verify", str(signed), "--certificate", str(cert), "--pubkey", str(pub))
    assert code == 0
    assert stdout.endswith(
        "; it binds no report file (signed before reports were bound): its signed report is the JSON in it\n"
    )
    cert.write_bytes(cert.read_bytes() + b"\n")
    code, _, err = _run("verify", str(signed), "--certificate", str(cert), "--pubkey", str(pub))
    assert code == 1 and "is not the certificate the export signs (certificate.json, " in err


def test_certificate_options_and_other_statements_are_refused(signer: tuple[Any, Path], tmp_path: Path) -> None:
    key, pub = signer
    cert, _ = _certificates(key, pub, tmp_path / "c")
    signed = _export(cert, tmp_path / "eu.md")
    code, _, err = _run("verify", str(signed), "--certificate", str(cert), "--recheck", "--pubkey", str(pub))
    assert code == 2 and "--certificate checks a signed export; --recheck is for certificates" in err
    args = ("--require-verdict", "PASS", "--run-dir", str(tmp_path))
    code, _, err = _run("verify", str(signed), "--certificate", str(cert), *args, "--pubkey", str(pub))
    assert (
        code == 2 and "--certificate checks a signed export; --require-verdict, --run-dir are for certificates" in err
    )
    # a certificate handed where the export belongs: named, exit 4
    code, _, err = _run("verify", str(cert), "--certificate", str(cert), "--pubkey", str(pub))
    assert code == 4 and "this is not an export report (predicateType 'https://moeaudit.dev/training-health/v2')" in err
    # without --certificate, verify says to pass it
    code, _, err = _run("verify", str(signed), "--pubkey", str(pub))
    assert code == 4 and err.endswith(
        "check an export with verify FILE --certificate CERT (the certificate it was made from)\n"
    )


def test_the_verification_result_names_the_bundle_it_digested(signer: tuple[Any, Path], tmp_path: Path) -> None:
    """verify --attest-verification's first subject is the file whose signature was checked."""
    key, pub = signer
    _, bundle = _certificates(key, pub, tmp_path / "c")
    svr = tmp_path / "svr.json"
    code, _, err = _run("verify", str(bundle), "--pubkey", str(pub), "--attest-verification", str(svr))
    assert code == 0, err
    assert _body(svr, pub)["subject"][0] == {"name": "certificate.sigstore.json", "digest": {"sha256": _sha(bundle)}}


def test_the_preregistration_digests_the_canary_file_it_names(tmp_path: Path) -> None:
    """Its subjects are the policy and canary files, each by its bytes' SHA-256; the canary's
    content digest (what certify compares) is the predicate's."""
    from moeaudit import canary as canary_mod

    samples = ROOT / "sample_checkpoints"
    policy, canary = samples / "policy.toml", samples / "canary.safetensors"
    generate_key(tmp_path / "k")
    out = tmp_path / "preregistration.json"
    args = [
        "--policy",
        str(policy),
        "--canary",
        str(canary),
        "--run",
        "r",
        "-o",
        str(out),
        "--key",
        str(tmp_path / "k"),
    ]
    code, _, err = _run("preregister", *args)
    assert code == 0, err
    stmt = _body(out, tmp_path / "k.pub")
    assert stmt["subject"] == [
        {"name": "policy.toml", "digest": {"sha256": _sha(policy)}},
        {"name": "canary.safetensors", "digest": {"sha256": _sha(canary)}},
    ]
    content = canary_mod.load(canary).digest
    assert content != _sha(canary)  # two different numbers: the subject would have mislabelled one
    assert stmt["predicate"]["canary"]["digest"] == {"sha256": content}
