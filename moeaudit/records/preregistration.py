"""The statement ``moeaudit preregister`` signs: the criteria a run will be certified under,
fixed before training (:mod:`moeaudit.attest.preregistration`; :mod:`moeaudit.records`)."""

import sys
from typing import Literal

from moeaudit.records.common import Sha256, Subject, ToolRecord

if sys.version_info >= (3, 11):
    from typing import TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import TypedDict


class PreregisteredPolicy(TypedDict):
    file: str
    sha256: str  # of the file's bytes
    settingsDigest: str  # what certificates sign as predicate.policy.digest
    calibrated: bool


class PreregisteredCanary(TypedDict):
    file: str
    digest: Sha256  # the canary's content digest (docs/glossary.md, "Canary")


class PreregistrationPredicate(TypedDict):
    """``https://moeaudit.dev/preregistration/v1``: the criteria a run will be certified under."""

    run: str
    createdAt: str
    policy: PreregisteredPolicy
    canary: PreregisteredCanary
    tool: ToolRecord


class PreregistrationStatement(TypedDict):
    _type: Literal["https://in-toto.io/Statement/v1"]
    subject: list[Subject]
    predicateType: Literal["https://moeaudit.dev/preregistration/v1"]
    predicate: PreregistrationPredicate
