"""The in-toto attestations other tools read: the test-result and SVR statements
(:mod:`moeaudit.attest.intoto`; :mod:`moeaudit.records`)."""

import sys
from typing import Any, Literal

from moeaudit.records.common import Subject

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


# --- attestations other in-toto tools read (gate --attest-test-result, verify --attest-verification) ---
# Field names as the in-toto specifications spell them (already lowerCamelCase: no renaming).


class ResourceDescriptor(TypedDict):
    """in-toto's ResourceDescriptor (attestation v1), the fields moeaudit writes."""

    name: str
    digest: dict[str, str]
    mediaType: NotRequired[str]
    content: NotRequired[str]  # base64 of the resource's bytes (the digest is theirs)
    annotations: NotRequired[dict[str, Any]]


class TestResultPredicate(TypedDict):
    """``https://in-toto.io/attestation/test-result/v0.1``: the promotion check's result."""

    result: Literal["PASSED", "WARNED", "FAILED"]
    configuration: list[ResourceDescriptor]
    passedTests: list[str]
    warnedTests: list[str]
    failedTests: list[str]


class TestResultStatement(TypedDict):
    _type: Literal["https://in-toto.io/Statement/v1"]
    subject: list[Subject]
    predicateType: Literal["https://in-toto.io/attestation/test-result/v0.1"]
    predicate: TestResultPredicate


# ``verifier.policy`` is a protobuf ``Any`` in in-toto's SVR v0.1 message: a ResourceDescriptor
# with its ``@type``, so in-toto's own bindings can read it back.
PolicyDescriptor = TypedDict(
    "PolicyDescriptor",
    {
        "@type": Literal["type.googleapis.com/in_toto_attestation.v1.ResourceDescriptor"],
        "name": str,
        "digest": dict[str, str],
        "mediaType": str,
        "content": str,
    },
)


class SvrVerifier(TypedDict):
    id: str
    policy: PolicyDescriptor


class SvrPredicate(TypedDict):
    """``https://in-toto.io/attestation/svr/v0.1``: what ``verify`` checked, and when."""

    verifier: SvrVerifier
    timeCreated: str
    properties: list[str]


class SvrStatement(TypedDict):
    _type: Literal["https://in-toto.io/Statement/v1"]
    subject: list[Subject]
    predicateType: Literal["https://in-toto.io/attestation/svr/v0.1"]
    predicate: SvrPredicate


class SvrVerifierV02(TypedDict):
    id: str
    policies: list[ResourceDescriptor]  # required by v0.2 (``[]`` when none)


class SvrPredicateV02(TypedDict):
    """``https://in-toto.io/attestation/svr/v0.2``: what ``verify`` checked, under which policies, and when."""

    verifier: SvrVerifierV02
    timeCreated: str
    properties: list[str]


class SvrStatementV02(TypedDict):
    _type: Literal["https://in-toto.io/Statement/v1"]
    subject: list[Subject]
    predicateType: Literal["https://in-toto.io/attestation/svr/v0.2"]
    predicate: SvrPredicateV02
