"""The promotion decision, ``moeaudit.gate/v1`` (:mod:`moeaudit.judge.promote`; :mod:`moeaudit.records`)."""

import sys
from typing import Literal

from moeaudit.records.checks import Check
from moeaudit.records.common import Promotion, Status
from moeaudit.records.envelope import EnvelopeReport
from moeaudit.records.gate import GateEntry

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


# --- the promotion decision (moeaudit gate --json) ----------------------------------------------------


class ConditionFailure(TypedDict):
    what: str
    value: float | None
    threshold: float | None


class Condition(TypedDict):
    """One row a promotion decision shows: the candidate's own gate, then each check."""

    name: str
    status: Literal["pass", "fail", "inconclusive", "skipped"]
    value: float | None
    threshold: float | None
    detail: str
    failed: NotRequired[list[ConditionFailure]]


class JudgedInRun(TypedDict):
    run: str
    checkpoints: list[int]
    baseline: int


class GateResult(TypedDict):
    """:func:`moeaudit.judge.promote.gate_from_audit` and friends: the promotion decision."""

    decision: Promotion
    verdict: Status | None
    verdict_reason: str
    conditions: list[Condition]
    base: str
    candidate: str
    stage: str | None
    stage_source: str | None
    gates: list[GateEntry]
    checks: list[Check]
    envelope: EnvelopeReport | None
    judged_in_run: JudgedInRun | None
    notes: NotRequired[list[str]]
    # why the decision is not the run verdict's reading (an INCONCLUSIVE on a PASS run)
    decision_reason: NotRequired[str]
    attestation: NotRequired[str]


class GateDocument(GateResult):
    """``moeaudit gate --json``."""

    schema: Literal["moeaudit.gate/v1"]
