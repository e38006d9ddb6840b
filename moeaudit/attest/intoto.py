"""Attestations in predicate types other in-toto tools already read: the promotion check as a
Test Result, and ``verify``'s answer as a Simple Verification Result.

* ``gate --attest-test-result FILE``: an in-toto Statement v1 with predicate type
  ``https://in-toto.io/attestation/test-result/v0.1`` whose subject is the candidate checkpoint
  (its OpenSSF model-signing root digest, as in a certificate's subjects). ``result`` is the
  promotion decision — PROMOTE → ``PASSED``, INCONCLUSIVE → ``WARNED``, HOLD → ``FAILED`` — and
  ``passedTests`` / ``warnedTests`` / ``failedTests`` name the decision's conditions by status
  (a condition that was not evaluated is in none of them). ``configuration`` is the policy: its
  settings as signed into certificates (``content``, whose SHA-256 is the certificate's
  ``predicate.policy.digest``) and, when it came from a file, that file's SHA-256.
* ``verify --attest-verification FILE``: predicate type ``https://in-toto.io/attestation/svr/v0.2``.
  Subjects: the verified certificate file, then the checkpoints it certifies. ``properties``:
  ``MOEAUDIT_SIGNATURE_VALID``, ``MOEAUDIT_VERDICT_<verdict>`` and, after ``--recheck``,
  ``MOEAUDIT_INPUTS_UNCHANGED``, and ``MOEAUDIT_CRITERIA_PREREGISTERED`` when the certificate
  signs that its criteria match a preregistration that predates the first audited checkpoint
  (:mod:`moeaudit.attest.preregistration`). ``verifier.policies`` (mandatory in v0.2) lists, as
  in-toto ResourceDescriptors: what ``verify`` required (the key, the verdicts, the recheck; its
  bytes inline), then the criteria the certificate was judged by — the policy settings (the
  digest certificates sign as ``predicate.policy.digest``), the policy file (its SHA-256, when the
  policy came from one), the canary (its content digest, docs/glossary.md, "Canary") and the preregistration file.
  SVR v0.1 (one ``verifier.policy``, a protobuf ``Any``) is no longer written; :func:`svr_policies`
  still reads it.

Both are signed DSSE envelopes (the same key types and PAE as certificates), their statements
canonical JSON. Torch-free.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from moeaudit.attest.certificate import canonical_json
from moeaudit.attest.signing import PrivateKey, sign_envelope
from moeaudit.records import (
    GateResult,
    PolicySettings,
    Predicate,
    Promotion,
    ResourceDescriptor,
    Subject,
    SvrStatement,
    SvrStatementV02,
    TestResultStatement,
)

STATEMENT_TYPE: Literal["https://in-toto.io/Statement/v1"] = "https://in-toto.io/Statement/v1"
TEST_RESULT_TYPE: Literal["https://in-toto.io/attestation/test-result/v0.1"] = (
    "https://in-toto.io/attestation/test-result/v0.1"
)
SVR_TYPE: Literal["https://in-toto.io/attestation/svr/v0.2"] = "https://in-toto.io/attestation/svr/v0.2"
SVR_TYPE_V01: Literal["https://in-toto.io/attestation/svr/v0.1"] = "https://in-toto.io/attestation/svr/v0.1"
VERIFIER_ID = "https://moeaudit.dev/verify/v1"  # bumped when what `verify` checks changes
RESOURCE_DESCRIPTOR_ANY: Literal["type.googleapis.com/in_toto_attestation.v1.ResourceDescriptor"] = (
    "type.googleapis.com/in_toto_attestation.v1.ResourceDescriptor"
)
RESULT_OF: dict[Promotion, Literal["PASSED", "WARNED", "FAILED"]] = {
    "PROMOTE": "PASSED",
    "INCONCLUSIVE": "WARNED",
    "HOLD": "FAILED",
}


def _canonical_settings(settings: PolicySettings) -> bytes:
    """The policy settings as :attr:`moeaudit.policy.Policy.digest` hashes them."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()


def policy_configuration(source: str, settings: PolicySettings, file: Path | None) -> list[ResourceDescriptor]:
    """The Test Result's ``configuration``: the policy settings (their bytes and digest, the
    certificate's ``predicate.policy.digest``) and, when they came from a file, the file."""
    content = _canonical_settings(settings)
    out: list[ResourceDescriptor] = [
        {
            "name": "moeaudit policy settings",
            "mediaType": "application/json",
            "digest": {"sha256": hashlib.sha256(content).hexdigest()},
            "content": base64.b64encode(content).decode("ascii"),
            "annotations": {"source": source},
        }
    ]
    if file is not None:
        out.append(
            {
                "name": file.name,
                "mediaType": "application/toml",
                "digest": {"sha256": hashlib.sha256(file.read_bytes()).hexdigest()},
            }
        )
    return out


def promotion_result(
    result: GateResult, candidate: Subject, configuration: list[ResourceDescriptor]
) -> TestResultStatement:
    """The promotion decision as an in-toto Test Result over the candidate checkpoint."""
    by_status: dict[str, list[str]] = {"pass": [], "inconclusive": [], "fail": [], "skipped": []}
    for cond in result["conditions"]:
        by_status[cond["status"]].append(cond["name"])
    return {
        "_type": STATEMENT_TYPE,
        "subject": [candidate],
        "predicateType": TEST_RESULT_TYPE,
        "predicate": {
            "result": RESULT_OF[result["decision"]],
            "configuration": configuration,
            "passedTests": by_status["pass"],
            "warnedTests": by_status["inconclusive"],
            "failedTests": by_status["fail"],
        },
    }


def certified_criteria(predicate: Predicate) -> list[ResourceDescriptor]:
    """The criteria a verified certificate was judged by, as ResourceDescriptors: the policy
    settings (``predicate.policy.digest``), the policy file when it came from one
    (``predicate.inputs.policy_file``) and the canary (its content digest). Only what the
    certificate signs is named; nothing is read from disk."""
    out: list[ResourceDescriptor] = []
    policy = predicate.get("policy") or {}
    if isinstance(policy.get("digest"), str):
        out.append(
            {
                "name": "moeaudit policy settings",
                "digest": {"sha256": policy["digest"]},
                "mediaType": "application/json",
                "annotations": {"source": str(policy.get("source", ""))},
            }
        )
    file = (predicate.get("inputs") or {}).get("policy_file")
    if isinstance(file, dict) and isinstance(file.get("sha256"), str):
        out.append(
            {
                "name": str(file.get("path", "policy.toml")),
                "digest": {"sha256": file["sha256"]},
                "mediaType": "application/toml",
            }
        )
    canary = (predicate.get("canary") or {}).get("digest") or {}
    if isinstance(canary.get("sha256"), str):
        out.append(
            {
                "name": "moeaudit canary",
                "digest": {"sha256": canary["sha256"]},
                "annotations": {
                    "digestOf": "the canary's token windows (moeaudit content digest, not the file's bytes)"
                },
            }
        )
    prereg = predicate.get("preregistration")
    file = prereg.get("file") if isinstance(prereg, dict) else None
    if prereg and isinstance(file, dict) and isinstance(file.get("sha256"), str):
        out.append(
            {
                "name": str(file.get("path", "preregistration.json")),
                "digest": {"sha256": file["sha256"]},
                "mediaType": "application/json",
                "annotations": {"status": str(prereg.get("status")), "ordering": str(prereg.get("ordering"))},
            }
        )
    return out


def criteria_preregistered(predicate: Predicate) -> bool:
    """The certificate signs that its policy and canary are the preregistered ones and that the
    preregistration predates the first audited checkpoint."""
    prereg = predicate.get("preregistration")
    return isinstance(prereg, dict) and prereg.get("status") == "matched" and prereg.get("ordering") == "before"


def verification_result(
    certificate: Subject,
    checkpoints: list[Subject],
    *,
    keyid: str,
    verdict: str,
    required: tuple[str, ...],
    rechecked: bool,
    time: str,
    criteria: list[ResourceDescriptor] | None = None,
    preregistered: bool = False,
) -> SvrStatementV02:
    """What ``verify`` established about a certificate, as an in-toto Simple Verification Result
    v0.2. Written only when ``verify`` succeeds: every property listed held. ``criteria``: the
    certificate's own policy and canary (:func:`certified_criteria`)."""
    rules = {
        "publicKeySha256": keyid,
        "requireVerdict": list(required),
        "recheck": rechecked,
        "predicateTypes": ["https://moeaudit.dev/training-health/v2", "https://moeaudit.dev/training-health/v1"],
    }
    content = canonical_json(rules)
    requirements: ResourceDescriptor = {
        "name": "moeaudit verify requirements",
        "digest": {"sha256": hashlib.sha256(content).hexdigest()},
        "mediaType": "application/json",
        "content": base64.b64encode(content).decode("ascii"),
    }
    properties = ["MOEAUDIT_SIGNATURE_VALID", f"MOEAUDIT_VERDICT_{verdict}"]
    if rechecked:
        properties.append("MOEAUDIT_INPUTS_UNCHANGED")
    if preregistered:
        properties.append("MOEAUDIT_CRITERIA_PREREGISTERED")
    return {
        "_type": STATEMENT_TYPE,
        "subject": [certificate, *checkpoints],
        "predicateType": SVR_TYPE,
        "predicate": {
            "verifier": {"id": VERIFIER_ID, "policies": [requirements, *(criteria or [])]},
            "timeCreated": time,
            "properties": properties,
        },
    }


def svr_policies(stmt: dict[str, Any]) -> list[dict[str, Any]]:
    """The policies a Simple Verification Result names, v0.2 (``verifier.policies``, required)
    or v0.1 (the one optional ``verifier.policy``, its ``@type`` dropped). Anything else is a
    ValueError."""
    kind = stmt.get("predicateType")
    verifier = (stmt.get("predicate") or {}).get("verifier")
    if not isinstance(verifier, dict):
        raise ValueError("no predicate.verifier")
    if kind == SVR_TYPE:
        policies = verifier.get("policies")
        if not isinstance(policies, list):
            raise ValueError("SVR v0.2 requires verifier.policies (an empty list when none)")
        return list(policies)
    if kind == SVR_TYPE_V01:
        one = verifier.get("policy")
        return [] if one is None else [{k: v for k, v in one.items() if k != "@type"}]
    raise ValueError(f"not a Simple Verification Result: predicateType {kind!r}")


def sign(stmt: TestResultStatement | SvrStatement | SvrStatementV02, key: PrivateKey) -> bytes:
    """The signed DSSE envelope of ``stmt``, as the bytes to write (laid out as certificate.json)."""
    from moeaudit.jsonio import dumps

    return dumps(sign_envelope(key, canonical_json(stmt))).encode("utf-8")


def file_subject(name: str, sha256: str) -> Subject:
    return {"name": name, "digest": {"sha256": sha256}}
