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
* ``verify --attest-verification FILE``: predicate type ``https://in-toto.io/attestation/svr/v0.1``.
  Subjects: the verified certificate file, then the checkpoints it certifies. ``properties``:
  ``MOEAUDIT_SIGNATURE_VALID``, ``MOEAUDIT_VERDICT_<verdict>`` and, after ``--recheck``,
  ``MOEAUDIT_INPUTS_UNCHANGED``. ``verifier.policy`` (a protobuf ``Any`` in in-toto's SVR v0.1
  message, hence its ``@type``) holds what ``verify`` required: the key, the verdicts, the recheck.

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
    PolicyDescriptor,
    Promotion,
    ResourceDescriptor,
    Subject,
    SvrStatement,
    TestResultStatement,
)

STATEMENT_TYPE: Literal["https://in-toto.io/Statement/v1"] = "https://in-toto.io/Statement/v1"
TEST_RESULT_TYPE: Literal["https://in-toto.io/attestation/test-result/v0.1"] = (
    "https://in-toto.io/attestation/test-result/v0.1"
)
SVR_TYPE: Literal["https://in-toto.io/attestation/svr/v0.1"] = "https://in-toto.io/attestation/svr/v0.1"
VERIFIER_ID = "https://moeaudit.dev/verify/v1"  # bumped when what `verify` checks changes
RESOURCE_DESCRIPTOR_ANY: Literal["type.googleapis.com/in_toto_attestation.v1.ResourceDescriptor"] = (
    "type.googleapis.com/in_toto_attestation.v1.ResourceDescriptor"
)
RESULT_OF: dict[Promotion, Literal["PASSED", "WARNED", "FAILED"]] = {
    "PROMOTE": "PASSED",
    "INCONCLUSIVE": "WARNED",
    "HOLD": "FAILED",
}


def _canonical_settings(settings: dict[str, Any]) -> bytes:
    """The policy settings as :attr:`moeaudit.policy.Policy.digest` hashes them."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()


def policy_configuration(source: str, settings: dict[str, Any], file: Path | None) -> list[ResourceDescriptor]:
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


def verification_result(
    certificate: Subject,
    checkpoints: list[Subject],
    *,
    keyid: str,
    verdict: str,
    required: tuple[str, ...],
    rechecked: bool,
    time: str,
) -> SvrStatement:
    """What ``verify`` established about a certificate, as an in-toto Simple Verification Result.
    Written only when ``verify`` succeeds: every property listed held."""
    rules = {
        "publicKeySha256": keyid,
        "requireVerdict": list(required),
        "recheck": rechecked,
        "predicateTypes": ["https://moeaudit.dev/training-health/v2", "https://moeaudit.dev/training-health/v1"],
    }
    content = canonical_json(rules)
    policy: PolicyDescriptor = {
        "@type": RESOURCE_DESCRIPTOR_ANY,
        "name": "moeaudit verify requirements",
        "digest": {"sha256": hashlib.sha256(content).hexdigest()},
        "mediaType": "application/json",
        "content": base64.b64encode(content).decode("ascii"),
    }
    properties = ["MOEAUDIT_SIGNATURE_VALID", f"MOEAUDIT_VERDICT_{verdict}"]
    if rechecked:
        properties.append("MOEAUDIT_INPUTS_UNCHANGED")
    return {
        "_type": STATEMENT_TYPE,
        "subject": [certificate, *checkpoints],
        "predicateType": SVR_TYPE,
        "predicate": {"verifier": {"id": VERIFIER_ID, "policy": policy}, "timeCreated": time, "properties": properties},
    }


def sign(stmt: TestResultStatement | SvrStatement, key: PrivateKey) -> bytes:
    """The signed DSSE envelope of ``stmt``, as the bytes to write (laid out as certificate.json)."""
    from moeaudit.jsonio import dumps

    return dumps(sign_envelope(key, canonical_json(stmt))).encode("utf-8")


def file_subject(name: str, sha256: str) -> Subject:
    return {"name": name, "digest": {"sha256": sha256}}
