"""The certificate as a key-based Sigstore bundle v0.3, read by independent
implementations — sigstore-python's protobuf-specs model (strict, unknown fields refused) parses
it, securesystemslib's DSSE verifies its signature, and sigstore-js (npm's Sigstore verifier,
when installed: ``npm install --prefix tests/sigstore_js``) verifies the bundle as a whole — and
by `moeaudit verify`; new keys are ECDSA P-256 (cosign and model_signing do not verify Ed25519)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from moeaudit.attest.certificate import PREDICATE_TYPE, sign_statement, statement
from moeaudit.attest.signing import generate_key, keyid, load_public_key, to_bundle
from moeaudit.checkpoint.digest import root_digest
from moeaudit.cli import cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
BUNDLE_V03 = "application/vnd.dev.sigstore.bundle.v0.3+json"
needs_samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")
SIGSTORE_JS = Path(__file__).resolve().parent / "sigstore_js"


@pytest.fixture()
def certified(tmp_path: Path, samples_cache: Path) -> tuple[Path, Path, Path]:
    """(output dir, run dir, public key): `certify` with the default key, created on first use."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (1250, 1500):
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{step}", run / f"checkpoint-{step}")
    shutil.copy(SAMPLES / "healthy" / "metrics.jsonl", run / "metrics.jsonl")
    env = {"MOEAUDIT_CACHE_DIR": str(samples_cache), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    result = CliRunner(env=env).invoke(
        cli,
        [
            "certify",
            str(run),
            "--out",
            str(tmp_path / "out"),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--policy",
            str(SAMPLES / "policy.toml"),
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert "certificate.sigstore.json" in result.stdout
    return tmp_path / "out", run, tmp_path / "cfg" / "moeaudit" / "signing-key.pem.pub"


def _spki_sha256(pub_path: Path) -> bytes:
    key = serialization.load_pem_public_key(pub_path.read_bytes())
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).digest()


def _pem_sha256_hex(pub_path: Path) -> str:
    key = serialization.load_pem_public_key(pub_path.read_bytes())
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def _independent_verify(bundle_raw: bytes, pub_path: Path) -> dict:
    """Parse with sigstore-python's bundle model, verify the DSSE signature with securesystemslib;
    return the verified in-toto statement. Raises on any failure."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import Signature, SSlibKey
    from sigstore_models.bundle.v1 import Bundle

    parsed = Bundle.from_json(bundle_raw)  # strict: a wrong or unknown field is refused
    env = parsed.dsse_envelope
    assert env is not None and len(env.signatures) == 1
    hint = parsed.verification_material.public_key.hint
    key = SSlibKey.from_crypto(serialization.load_pem_public_key(pub_path.read_bytes()), keyid=hint)
    dsse = Envelope(
        payload=env.payload,
        payload_type=env.payload_type,
        signatures={hint: Signature(hint, env.signatures[0].sig.hex())},
    )
    dsse.verify([key], 1)  # raises VerificationError unless the signature over the PAE holds
    return json.loads(env.payload)


def _tampered(bundle_raw: bytes) -> bytes:
    """The bundle with its statement's verdict changed, the signature left as it was."""
    bundle = json.loads(bundle_raw)
    stmt = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    stmt["predicate"]["verdict"] = "FAIL" if stmt["predicate"]["verdict"] == "PASS" else "PASS"
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    return json.dumps(bundle).encode()


@needs_samples
def test_certify_writes_a_bundle_of_the_same_signed_statement(certified) -> None:
    out, run, pub = certified
    envelope = json.loads((out / "certificate.json").read_bytes())
    bundle = json.loads((out / "certificate.sigstore.json").read_bytes())
    assert bundle == {
        "mediaType": BUNDLE_V03,
        # the key as model-signing 1.x names it: hex SHA-256 of the PEM SubjectPublicKeyInfo
        "verificationMaterial": {"publicKey": {"hint": _pem_sha256_hex(pub)}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": envelope["payload"],
            "payloadType": "application/vnd.in-toto+json",
            "signatures": [{"sig": envelope["signatures"][0]["sig"]}],
        },
    }
    assert envelope["signatures"][0]["keyid"] == _spki_sha256(pub).hex()
    # the default key created on first use is P-256
    assert isinstance(serialization.load_pem_public_key(pub.read_bytes()), ec.EllipticCurvePublicKey)


@needs_samples
def test_independent_parser_and_verifier_accept_it(certified) -> None:
    from securesystemslib.exceptions import VerificationError
    from sigstore_models.bundle.v1 import Bundle

    out, run, pub = certified
    raw = (out / "certificate.sigstore.json").read_bytes()
    assert Bundle.from_json(raw).to_dict() == json.loads(raw)  # every field ours, nothing dropped
    stmt = _independent_verify(raw, pub)
    # what `cosign verify-blob-attestation --type T --digest D --digestAlg sha256` checks
    assert stmt["_type"] == "https://in-toto.io/Statement/v1" and stmt["predicateType"] == PREDICATE_TYPE
    want = {root_digest(run / f"checkpoint-{s}")[0] for s in (1250, 1500)}
    assert {s["digest"]["sha256"] for s in stmt["subject"]} == want
    assert stmt["predicate"]["verdict"] == "PASS"
    with pytest.raises(VerificationError):
        _independent_verify(_tampered(raw), pub)


@needs_samples
def test_verify_cli_reads_the_bundle(certified, tmp_path: Path) -> None:
    out, run, pub = certified
    bundle = out / "certificate.sigstore.json"
    ok = CliRunner().invoke(cli, ["verify", str(bundle), "--pubkey", str(pub), "--recheck"])
    assert ok.exit_code == 0, ok.stderr
    assert "verdict PASS" in ok.stdout and "all 2 checkpoint digests match" in ok.stdout
    report = tmp_path / "report.json"
    exported = CliRunner().invoke(
        cli,
        [
            "export",
            str(bundle),
            "--framework",
            "eu-ai-act",
            "--format",
            "json",
            "--out",
            str(report),
            "--pubkey",
            str(pub),
        ],
    )
    assert exported.exit_code == 0, exported.stderr
    assert json.loads(report.read_text()) == _export_of(out / "certificate.json", pub)  # the same statement
    bad = tmp_path / "tampered.sigstore.json"
    bad.write_bytes(_tampered(bundle.read_bytes()))
    result = CliRunner().invoke(cli, ["verify", str(bad), "--pubkey", str(pub)])
    assert result.exit_code == 1 and "signature does not verify" in result.stderr


def _export_of(cert: Path, pub: Path) -> dict:
    from moeaudit.report.export import run_export

    return json.loads(run_export(cert, pub, "eu-ai-act", "json"))


def _signed_bundle(tmp_path: Path, algorithm: str) -> tuple[dict, Path]:
    key = generate_key(tmp_path / algorithm, algorithm=algorithm)
    stmt = statement([{"name": "checkpoint-1", "digest": {"sha256": "ab" * 32}}], {"verdict": "PASS", "gates": []})
    return to_bundle(
        sign_statement(stmt, key, issued_at="2026-01-01T00:00:00Z"), key.public_key()
    ), tmp_path / f"{algorithm}.pub"


@pytest.mark.parametrize("algorithm", ["ecdsa-p256", "ed25519"])
def test_both_key_types_verify_independently_and_in_the_cli(tmp_path: Path, algorithm: str) -> None:
    bundle, pub = _signed_bundle(tmp_path, algorithm)
    raw = json.dumps(bundle).encode()
    assert _independent_verify(raw, pub)["predicate"]["issuedAt"] == "2026-01-01T00:00:00Z"
    (tmp_path / "b.json").write_bytes(raw)
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "b.json"), "--pubkey", str(pub)])
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b["verificationMaterial"]["publicKey"].__setitem__("hint", "AAAA"), "not by this public key"),
        (lambda b: b.__setitem__("mediaType", "application/vnd.dev.sigstore.bundle.v0.4+json"), "mediaType"),
        (lambda b: b["verificationMaterial"].pop("publicKey"), "not key-based"),
        (lambda b: b["dsseEnvelope"]["signatures"][0].__setitem__("keyid", "00" * 32), "not by this public key"),
        (lambda b: b["dsseEnvelope"]["signatures"].append({"sig": "AAAA"}), "exactly one signature"),
        (lambda b: b.__setitem__("messageSignature", {}), "message signature"),
    ],
)
def test_malformed_bundles_are_refused(tmp_path: Path, mutate, message: str) -> None:
    bundle, pub = _signed_bundle(tmp_path, "ecdsa-p256")
    mutate(bundle)
    (tmp_path / "b.json").write_text(json.dumps(bundle))
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "b.json"), "--pubkey", str(pub)])
    assert result.exit_code == 1 and message in result.stderr, result.stderr


def test_an_earlier_versions_hint_still_verifies(tmp_path: Path) -> None:
    """Bundles written before the hint followed model-signing (base64 SHA-256 of the DER SPKI)."""
    bundle, pub = _signed_bundle(tmp_path, "ecdsa-p256")
    bundle["verificationMaterial"]["publicKey"]["hint"] = base64.b64encode(_spki_sha256(pub)).decode()
    (tmp_path / "b.json").write_text(json.dumps(bundle))
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "b.json"), "--pubkey", str(pub)])
    assert result.exit_code == 0, result.stderr


def _model_signing_verify(model: Path, bundle: Path, pub: Path) -> str:
    """What OpenSSF model-signing 1.x says of a bundle: the error it raises."""
    verifying = pytest.importorskip("model_signing.verifying")
    with pytest.raises(Exception) as caught:
        verifying.Config().use_elliptic_key_verifier(public_key=pub).verify(model, bundle)
    return f"{type(caught.value).__name__}: {caught.value}"


@needs_samples
def test_model_signing_checks_the_key_and_signature_then_refuses_the_predicate(certified, tmp_path: Path) -> None:
    """model-signing 1.1.x reads our bundle, accepts the key hint, verifies the DSSE signature,
    and only then refuses the statement: it verifies its own manifest predicate, not ours."""
    out, run, pub = certified
    bundle = out / "certificate.sigstore.json"
    said = _model_signing_verify(run / "checkpoint-1500", bundle, pub)
    assert said == (
        f"ValueError: Predicate type mismatch, expected https://model_signing/signature/v1.0, got {PREDICATE_TYPE}"
    )
    tampered = tmp_path / "tampered.sigstore.json"  # the signature is checked before the predicate
    tampered.write_bytes(_tampered(bundle.read_bytes()))
    assert _model_signing_verify(run / "checkpoint-1500", tampered, pub).startswith("InvalidSignature")
    legacy = json.loads(bundle.read_bytes())  # the hint earlier versions wrote: refused first
    legacy["verificationMaterial"]["publicKey"]["hint"] = base64.b64encode(_spki_sha256(pub)).decode()
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    assert "Key mismatch" in _model_signing_verify(run / "checkpoint-1500", tmp_path / "legacy.json", pub)
    generate_key(tmp_path / "other")
    assert "Key mismatch" in _model_signing_verify(run / "checkpoint-1500", bundle, tmp_path / "other.pub")


def test_another_keys_bundle_is_refused(tmp_path: Path) -> None:
    bundle, _ = _signed_bundle(tmp_path, "ecdsa-p256")
    generate_key(tmp_path / "other")
    (tmp_path / "b.json").write_text(json.dumps(bundle))
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "b.json"), "--pubkey", str(tmp_path / "other.pub")])
    assert result.exit_code == 1 and "not by this public key" in result.stderr
    # the given key named by its keyid too, as verify and the DSSE envelope's refusal name keys
    other = keyid(load_public_key(tmp_path / "other.pub"))
    assert f"not by this public key (keyid {other[:16]}…, key hint " in result.stderr
    assert result.stderr.count("\n") == 1


def test_keygen_default_is_p256_and_ed25519_on_request(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["keygen", "--out", str(tmp_path / "k")]).exit_code == 0
    pub = serialization.load_pem_public_key((tmp_path / "k.pub").read_bytes())
    assert isinstance(pub, ec.EllipticCurvePublicKey) and isinstance(pub.curve, ec.SECP256R1)
    result = runner.invoke(cli, ["keygen", "--out", str(tmp_path / "e"), "--key-type", "ed25519"])
    assert result.exit_code == 0 and "(ed25519)" in result.stdout
    assert isinstance(serialization.load_pem_public_key((tmp_path / "e.pub").read_bytes()), ed25519.Ed25519PublicKey)
    clash = runner.invoke(cli, ["keygen", "--out", str(tmp_path / "x"), "--ecdsa", "--key-type", "ed25519"])
    assert clash.exit_code == 2 and not (tmp_path / "x").exists()


def _sigstore_js(bundle: Path, pub: Path, digest: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shutil.which("node") or "node", str(SIGSTORE_JS / "verify_bundle.js"), str(bundle), str(pub), digest],
        cwd=SIGSTORE_JS,
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_samples
@pytest.mark.skipif(
    shutil.which("node") is None or not (SIGSTORE_JS / "node_modules/@sigstore/verify").is_dir(),
    reason="sigstore-js not installed (npm install --prefix tests/sigstore_js)",
)
def test_sigstore_js_verifies_the_bundle(certified, tmp_path: Path) -> None:
    """sigstore-js finds the key by the bundle's hint, checks the DSSE signature with no log
    entry or timestamp required, and the statement names the checkpoint's root digest."""
    out, run, pub = certified
    bundle = out / "certificate.sigstore.json"
    digest = root_digest(run / "checkpoint-1500")[0]
    ok = _sigstore_js(bundle, pub, digest)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"verified": True, "predicateType": PREDICATE_TYPE, "subjects": 2}
    bad = tmp_path / "tampered.json"
    bad.write_bytes(_tampered(bundle.read_bytes()))
    failed = _sigstore_js(bad, pub, digest)
    assert failed.returncode != 0 and "signature verification failed" in failed.stderr
    generate_key(tmp_path / "other")
    assert "key not found" in _sigstore_js(bundle, tmp_path / "other.pub", digest).stderr
    assert "no subject" in _sigstore_js(bundle, pub, "00" * 32).stderr
