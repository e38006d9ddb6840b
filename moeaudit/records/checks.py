"""The check list a verdict is decided on, and the decision (:mod:`moeaudit.judge.decide`;
:mod:`moeaudit.records`)."""

import sys

from moeaudit.records.common import Interval, Promotion, Status

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


# --- checks -------------------------------------------------------------------------------------------


class Violation(TypedDict):
    """The first sample that broke an envelope rule."""

    layer: str
    step: int
    check: str
    value: float | None
    bound: float | None
    series: NotRequired[list[str]]
    from_step: NotRequired[int]
    expert: NotRequired[int]
    steps: NotRequired[int]
    fraction: NotRequired[float]


class Unevaluable(TypedDict):
    check: str
    reason: str


class Check(TypedDict):
    """One row of the check list a verdict is decided on (status None: not evaluated)."""

    name: str
    evaluated: bool
    status: Status | None
    reason: str
    value: NotRequired[float | None]
    ci95: NotRequired[Interval | None]
    problems: NotRequired[list[str]]
    basis: NotRequired[str]
    deciding: NotRequired[Violation]
    unevaluable: NotRequired[list[Unevaluable]]


class Decision(TypedDict):
    """:func:`moeaudit.judge.decide.decide`: one verdict for certify and gate alike."""

    verdict: Status
    verdict_reason: str
    promotion: Promotion
    checks: list[Check]
    stage: str
    stage_source: str
