"""`gate --attest-test-result` and `verify --attest-verification` write in-toto attestations that
in-toto's own tools read: each envelope's signature is checked by securesystemslib's DSSE, the
statement is parsed into in-toto's protobuf Statement (unknown fields refused) and validated by
its Python bindings, and the predicate into in-toto's TestResult message, or the Simple
Verification Result v0.2 message (v0.1's, built from in-toto's vendored svr.proto, with
``verifier.policies`` as spec/predicates/svr.md v0.2 defines it: no released Python binding, and
no upstream proto yet, has v0.2), whose policies in-toto's ResourceDescriptor bindings validate.
Each is also validated against its published JSON Schema."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
from datetime import datetime, timedelta, timezone
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from moeaudit.attest.signing import generate_key, keyid
from moeaudit.cli import cli

pytest.importorskip("in_toto_attestation")
pytest.importorskip("securesystemslib")

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
SVR_PROTO = Path(__file__).resolve().parent / "fixtures" / "in_toto" / "svr.proto"
needs_samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")
TEST_RESULT = "https://in-toto.io/attestation/test-result/v0.1"
SVR = "https://in-toto.io/attestation/svr/v0.2"


# ----- independent readers ---------------------------------------------------------------


def _open_envelope(path: Path, pub: Path) -> dict[str, Any]:
    """securesystemslib verifies the DSSE signature; in-toto's bindings parse and validate the
    statement (an unknown field anywhere in it is refused). Returns the statement as JSON."""
    from cryptography.hazmat.primitives import serialization
    from google.protobuf import json_format
    from in_toto_attestation.v1 import statement_pb2
    from in_toto_attestation.v1.statement import Statement
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    raw = json.loads(path.read_bytes())
    key = SSlibKey.from_crypto(serialization.load_pem_public_key(pub.read_bytes()), keyid=raw["signatures"][0]["keyid"])
    env = Envelope.from_dict(raw)
    env.verify([key], 1)  # raises VerificationError unless the signature over the PAE holds
    assert env.payload_type == "application/vnd.in-toto+json"
    stmt = json.loads(env.payload)  # the bytes whose signature held
    pb = json_format.ParseDict(stmt, statement_pb2.Statement(), ignore_unknown_fields=False)
    Statement.copy_from_pb(pb).validate()
    return stmt


def _parse(message: Any, doc: dict[str, Any]) -> Any:
    from google.protobuf import json_format

    return json_format.ParseDict(doc, message, ignore_unknown_fields=False)


@cache
def _svr_class() -> Any:
    """in-toto's SimpleVerificationResult (svr/v0.1) from the fields of the vendored svr.proto."""
    from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2
    from in_toto_attestation.v1 import resource_descriptor_pb2  # registers ResourceDescriptor (Any)

    del any_pb2, timestamp_pb2, resource_descriptor_pb2  # imported for their registration
    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="in_toto_attestation/predicates/svr/v0.1/svr.proto",
        syntax="proto3",
        package="in_toto_attestation.predicates.svr.v0_1",
        dependency=["google/protobuf/timestamp.proto", "google/protobuf/any.proto"],
    )
    msg = fdp.message_type.add(name="SimpleVerificationResult")
    verifier = msg.nested_type.add(name="Verifier")
    verifier.field.add(name="id", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL, json_name="id")
    verifier.field.add(
        name="policy",
        number=2,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_OPTIONAL,
        type_name=".google.protobuf.Any",
        json_name="policy",
    )
    msg.field.add(
        name="verifier",
        number=1,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_OPTIONAL,
        json_name="verifier",
        type_name=".in_toto_attestation.predicates.svr.v0_1.SimpleVerificationResult.Verifier",
    )
    msg.field.add(
        name="time_created",
        number=2,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_OPTIONAL,
        type_name=".google.protobuf.Timestamp",
        json_name="timeCreated",
    )
    msg.field.add(name="properties", number=3, type=f.TYPE_STRING, label=f.LABEL_REPEATED, json_name="properties")
    pool = descriptor_pool.Default()
    pool.AddSerializedFile(fdp.SerializeToString())
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("in_toto_attestation.predicates.svr.v0_1.SimpleVerificationResult")
    )


@cache
def _svr_v02_class() -> Any:
    """SVR v0.2 as in-toto's spec/predicates/svr.md (v0.2, in-toto/attestation 051624ce) defines
    it: the v0.1 message (vendored svr.proto) with the optional ``Any policy`` replaced by the
    required ``repeated ResourceDescriptor policies``. The upstream repository has no v0.2 proto
    yet; field numbers do not matter to the JSON mapping parsed here, names and types do."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2
    from in_toto_attestation.v1 import resource_descriptor_pb2

    del timestamp_pb2  # imported for its registration
    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="in_toto_attestation/predicates/svr/v0.2/svr.proto",
        syntax="proto3",
        package="in_toto_attestation.predicates.svr.v0_2",
        dependency=["google/protobuf/timestamp.proto", resource_descriptor_pb2.DESCRIPTOR.name],
    )
    msg = fdp.message_type.add(name="SimpleVerificationResult")
    verifier = msg.nested_type.add(name="Verifier")
    verifier.field.add(name="id", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL, json_name="id")
    verifier.field.add(
        name="policies",
        number=2,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_REPEATED,
        type_name=".in_toto_attestation.v1.ResourceDescriptor",
        json_name="policies",
    )
    msg.field.add(
        name="verifier",
        number=1,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_OPTIONAL,
        json_name="verifier",
        type_name=".in_toto_attestation.predicates.svr.v0_2.SimpleVerificationResult.Verifier",
    )
    msg.field.add(
        name="time_created",
        number=2,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_OPTIONAL,
        type_name=".google.protobuf.Timestamp",
        json_name="timeCreated",
    )
    msg.field.add(name="properties", number=3, type=f.TYPE_STRING, label=f.LABEL_REPEATED, json_name="properties")
    pool = descriptor_pool.Default()
    pool.AddSerializedFile(fdp.SerializeToString())
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("in_toto_attestation.predicates.svr.v0_2.SimpleVerificationResult")
    )


def _svr_v02(doc: dict[str, Any]) -> Any:
    """The predicate parsed by the v0.2 message; each policy validated by in-toto's bindings.
    v0.2's one parsing rule the message cannot state: ``verifier.policies`` must be present."""
    from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor

    if "policies" not in doc.get("verifier", {}):
        raise ValueError("SVR v0.2: verifier.policies is required")
    svr = _parse(_svr_v02_class()(), doc)
    for policy in svr.verifier.policies:
        ResourceDescriptor.copy_from_pb(policy).validate()
    return svr


def test_the_svr_message_is_in_totos() -> None:
    """The message above has exactly the fields (name, number, type) of in-toto's svr.proto."""
    text = SVR_PROTO.read_text()
    declared = set(re.findall(r"^\s*(?:optional |repeated )?([\w.]+) (\w+) = (\d+)", text, re.M))
    desc = _svr_class().DESCRIPTOR
    built = {
        (f.message_type.full_name if f.message_type else "string", f.name, str(f.number))
        for d in (desc, desc.nested_types_by_name["Verifier"])
        for f in d.fields
    }
    upstream = {({"Verifier": desc.full_name + ".Verifier"}.get(t, t), n, num) for t, n, num in declared}
    assert built == upstream


def _schema_valid(name: str, doc: dict[str, Any]) -> None:
    import jsonschema

    from moeaudit.schemas import load

    jsonschema.Draft202012Validator(load(name)).validate(doc)


def _model_signing_root(path: Path) -> str:
    hashing = pytest.importorskip("model_signing.hashing")
    from model_signing._signing import signing

    return str(signing.Payload(hashing.hash(path)).statement.pb.subject[0].digest["sha256"])


# ----- gate --attest-test-result ----------------------------------------------------------


@pytest.fixture()
def keypair(tmp_path: Path) -> tuple[Path, Path]:
    generate_key(tmp_path / "k")
    return tmp_path / "k", tmp_path / "k.pub"


def _gate(tmp_path: Path, cache_dir: Path, key: Path, base: Path, candidate: Path, *extra: str) -> Any:
    env = {"MOEAUDIT_CACHE_DIR": str(cache_dir), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    return CliRunner(env=env).invoke(
        cli,
        [
            "gate",
            str(base),
            str(candidate),
            "--key",
            str(key),
            "--attest-test-result",
            str(tmp_path / "tr.json"),
            "--json",
            str(tmp_path / "gate.json"),
            *extra,
        ],
    )


@needs_samples
def test_a_promotion_is_a_passed_test_result_over_the_candidates_root_digest(
    tmp_path: Path, samples_cache: Path, keypair: tuple[Path, Path]
) -> None:
    from in_toto_attestation.predicates.test_result.v0 import test_result_pb2
    from securesystemslib.exceptions import VerificationError

    from moeaudit.policy import load_policy

    key, pub = keypair
    run = SAMPLES / "healthy"
    result = _gate(tmp_path, samples_cache, key, run / "checkpoint-1250", run / "checkpoint-1500")
    assert result.exit_code == 0, result.stderr
    decision = json.loads((tmp_path / "gate.json").read_text())
    assert decision["decision"] == "PROMOTE" and decision["attestation"] == str(tmp_path / "tr.json")
    stmt = _open_envelope(tmp_path / "tr.json", pub)
    _schema_valid("test-result-v0.1.statement.schema.json", stmt)
    assert stmt["predicateType"] == TEST_RESULT
    assert stmt["subject"] == [
        {"name": "checkpoint-1500", "digest": {"sha256": _model_signing_root(run / "checkpoint-1500")}}
    ]
    pred = _parse(test_result_pb2.TestResult(), stmt["predicate"])
    by = {s: [c["name"] for c in decision["conditions"] if c["status"] == s] for s in ("pass", "fail")}
    assert pred.result == "PASSED"
    assert list(pred.passed_tests) == by["pass"] == ["candidate gate", "health", "comparison", "envelope", "finite"]
    assert list(pred.failed_tests) == list(pred.warned_tests) == []
    # the policy: its settings (whose SHA-256 certificates sign as predicate.policy.digest), and its file
    settings, file = pred.configuration
    policy = load_policy(SAMPLES / "policy.toml")
    assert hashlib.sha256(settings.content).hexdigest() == settings.digest["sha256"] == policy.digest
    assert json.loads(settings.content) == policy.to_json()
    assert file.name == "policy.toml"
    assert file.digest["sha256"] == hashlib.sha256((SAMPLES / "policy.toml").read_bytes()).hexdigest()
    # a changed verdict no longer verifies
    env = json.loads((tmp_path / "tr.json").read_bytes())
    forged = base64.b64decode(env["payload"]).replace(b'"PASSED"', b'"FAILED"')
    env["payload"] = base64.b64encode(forged).decode()
    (tmp_path / "forged.json").write_text(json.dumps(env))
    with pytest.raises(VerificationError):
        _open_envelope(tmp_path / "forged.json", pub)


@needs_samples
def test_a_hold_is_a_failed_test_result(tmp_path: Path, samples_cache: Path, keypair: tuple[Path, Path]) -> None:
    """A rollback (candidate earlier than its base) is held: FAILED, its one condition failed,
    no policy decided it (an empty configuration)."""
    from in_toto_attestation.predicates.test_result.v0 import test_result_pb2

    key, pub = keypair
    run = SAMPLES / "healthy"
    result = _gate(tmp_path, samples_cache, key, run / "checkpoint-1500", run / "checkpoint-1250")
    assert result.exit_code == 1, result.stderr
    stmt = _open_envelope(tmp_path / "tr.json", pub)
    pred = _parse(test_result_pb2.TestResult(), stmt["predicate"])
    assert (pred.result, list(pred.failed_tests), list(pred.passed_tests)) == ("FAILED", ["candidate after base"], [])
    assert list(pred.configuration) == []
    assert stmt["subject"][0]["digest"]["sha256"] == _model_signing_root(run / "checkpoint-1250")


def test_gate_attestation_options_are_checked_before_any_work(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    key, _ = keypair
    base, ckpt = SAMPLES / "healthy" / "checkpoint-1250", SAMPLES / "healthy" / "checkpoint-1500"
    lone_key = CliRunner().invoke(cli, ["gate", str(base), str(ckpt), "--key", str(key)])
    assert lone_key.exit_code == 2 and "--attest-test-result" in lone_key.stderr
    (tmp_path / "taken.json").write_text("{}")
    taken = CliRunner().invoke(
        cli, ["gate", str(base), str(ckpt), "--key", str(key), "--attest-test-result", str(tmp_path / "taken.json")]
    )
    assert taken.exit_code == 4 and (tmp_path / "taken.json").read_text() == "{}"


# ----- verify --attest-verification -------------------------------------------------------


@pytest.fixture()
def certified(tmp_path: Path, samples_cache: Path, keypair: tuple[Path, Path]) -> tuple[Path, Path]:
    """(certificate.json, public key) of two healthy sample checkpoints."""
    key, pub = keypair
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
            str(key),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--policy",
            str(SAMPLES / "policy.toml"),
        ],
    )
    assert result.exit_code == 0, result.stderr
    return tmp_path / "out" / "certificate.json", pub


@needs_samples
@pytest.mark.parametrize("cert_name", ["certificate.json", "certificate.sigstore.json"])
def test_verify_writes_a_simple_verification_result(
    tmp_path: Path, certified: tuple[Path, Path], keypair: tuple[Path, Path], cert_name: str
) -> None:

    cert, pub = certified
    cert = cert.with_name(cert_name)
    verifier_key = tmp_path / "verifier"
    generate_key(verifier_key)  # the verifier signs with its own key
    before = datetime.now(timezone.utc).replace(microsecond=0)
    result = CliRunner().invoke(
        cli,
        [
            "verify",
            str(cert),
            "--pubkey",
            str(pub),
            "--recheck",
            "--require-verdict",
            "PASS,INCONCLUSIVE",
            "--key",
            str(verifier_key),
            "--attest-verification",
            str(tmp_path / "svr.json"),
        ],
    )
    assert result.exit_code == 0, result.stderr
    stmt = _open_envelope(tmp_path / "svr.json", Path(f"{verifier_key}.pub"))
    _schema_valid("svr-v0.2.statement.schema.json", stmt)
    assert stmt["predicateType"] == SVR
    signed = json.loads(base64.b64decode(json.loads(cert.with_name("certificate.json").read_bytes())["payload"]))
    assert stmt["subject"] == [
        {"name": cert_name, "digest": {"sha256": hashlib.sha256(cert.read_bytes()).hexdigest()}},
        *signed["subject"],
    ]
    assert [s["digest"]["sha256"] for s in stmt["subject"][1:]] == [
        _model_signing_root(tmp_path / "run" / f"checkpoint-{s}") for s in (1250, 1500)
    ]
    svr = _svr_v02(stmt["predicate"])
    assert svr.verifier.id == "https://moeaudit.dev/verify/v1"
    assert list(svr.properties) == ["MOEAUDIT_SIGNATURE_VALID", "MOEAUDIT_VERDICT_PASS", "MOEAUDIT_INPUTS_UNCHANGED"]
    when = svr.time_created.ToDatetime(tzinfo=timezone.utc)
    assert before <= when <= datetime.now(timezone.utc) + timedelta(seconds=1)
    from cryptography.hazmat.primitives import serialization

    from moeaudit import canary as canary_mod
    from moeaudit.policy import load_policy

    required, settings, file, canary = svr.verifier.policies
    assert hashlib.sha256(required.content).hexdigest() == required.digest["sha256"]
    assert json.loads(required.content) == {
        "publicKeySha256": keyid(serialization.load_pem_public_key(pub.read_bytes())),  # type: ignore[arg-type]
        "recheck": True,
        "requireVerdict": ["PASS", "INCONCLUSIVE"],
        "predicateTypes": ["https://moeaudit.dev/training-health/v2", "https://moeaudit.dev/training-health/v1"],
    }
    # the criteria the certificate was judged by, each by the digest computed here from the file
    assert settings.digest["sha256"] == load_policy(SAMPLES / "policy.toml").digest
    assert (file.name, file.media_type) == ("policy.toml", "application/toml")
    assert file.digest["sha256"] == hashlib.sha256((SAMPLES / "policy.toml").read_bytes()).hexdigest()
    assert canary.digest["sha256"] == canary_mod.load(SAMPLES / "canary.safetensors").digest
    assert canary.digest["sha256"] == signed["predicate"]["canary"]["digest"]["sha256"]


def test_svr_v02_requires_policies_and_v01_stays_readable() -> None:
    """The shipped v0.2 schema and reader refuse a verifier without ``policies``; an SVR v0.1 (what
    earlier versions wrote) still reads, its one policy as a list."""
    import jsonschema

    from moeaudit.attest.intoto import svr_policies, verification_result

    subject = {"name": "certificate.json", "digest": {"sha256": "ab" * 32}}
    stmt: dict[str, Any] = dict(
        verification_result(
            subject, [], keyid="cd" * 32, verdict="PASS", required=(), rechecked=False, time="2026-01-01T00:00:00Z"
        )
    )
    _schema_valid("svr-v0.2.statement.schema.json", stmt)
    assert [p["name"] for p in svr_policies(stmt)] == ["moeaudit verify requirements"]
    bare = json.loads(json.dumps(stmt))
    del bare["predicate"]["verifier"]["policies"]
    with pytest.raises(jsonschema.ValidationError, match="'policies' is a required property"):
        _schema_valid("svr-v0.2.statement.schema.json", bare)
    with pytest.raises(ValueError, match="requires verifier.policies"):
        svr_policies(bare)
    with pytest.raises(ValueError, match="required"):
        _svr_v02(bare["predicate"])
    old = json.loads(json.dumps(stmt))
    old["predicateType"] = "https://in-toto.io/attestation/svr/v0.1"
    rd = old["predicate"]["verifier"].pop("policies")[0]
    old["predicate"]["verifier"]["policy"] = {
        "@type": "type.googleapis.com/in_toto_attestation.v1.ResourceDescriptor",
        **rd,
    }
    _schema_valid("svr-v0.1.statement.schema.json", old)
    _parse(_svr_class()(), old["predicate"])  # in-toto's v0.1 message reads it
    assert svr_policies(old) == [rd]


@needs_samples
def test_a_failed_verification_writes_no_result(tmp_path: Path, certified: tuple[Path, Path]) -> None:
    cert, pub = certified
    out = tmp_path / "svr.json"
    result = CliRunner().invoke(
        cli,
        [
            "verify",
            str(cert),
            "--pubkey",
            str(pub),
            "--require-verdict",
            "FAIL",
            "--key",
            str(tmp_path / "k"),
            "--attest-verification",
            str(out),
        ],
    )
    assert result.exit_code == 1 and not out.exists()
    lone = CliRunner().invoke(cli, ["verify", str(cert), "--pubkey", str(pub), "--key", str(tmp_path / "k")])
    assert lone.exit_code == 2 and "--attest-verification" in lone.stderr


@needs_samples
def test_across_runs_the_subject_is_the_candidate_as_replayed(
    tmp_path: Path, samples_cache: Path, keypair: tuple[Path, Path]
) -> None:
    key, pub = keypair
    candidate = SAMPLES / "sft-refine" / "checkpoint-1000"
    result = _gate(tmp_path, samples_cache, key, SAMPLES / "healthy" / "checkpoint-1500", candidate)
    assert result.exit_code == 0, result.stderr
    stmt = _open_envelope(tmp_path / "tr.json", pub)
    assert stmt["subject"] == [{"name": "checkpoint-1000", "digest": {"sha256": _model_signing_root(candidate)}}]
    assert stmt["predicate"]["result"] == "PASSED" and "refinement" in stmt["predicate"]["passedTests"]
