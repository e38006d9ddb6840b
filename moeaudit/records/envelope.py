"""The envelope report, ``moeaudit.envelope/v1`` (:mod:`moeaudit.judge.envelope`; :mod:`moeaudit.records`)."""

import sys
from typing import Annotated, Literal

from moeaudit.records.checks import Unevaluable, Violation
from moeaudit.records.common import DATA_KEYS

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


# --- the envelope report (moeaudit.envelope/v1) -------------------------------------------------------


class EnvelopeSample(TypedDict):
    step: int
    value: float | None
    bound: float | None
    margin: float | None
    compliant: bool
    window: int | None  # None: the only sample of its segment (no window follows it)
    reason: NotRequired[str]


class EnvelopeWindow(TypedDict):
    series: str
    index: int
    start: int
    end: int
    anchor_value: float | None
    samples: int
    stretched: bool
    min_margin: float | None
    compliant: bool


class DiscreteRow(TypedDict):
    series: str
    from_step: int
    to_step: int
    gap: int
    value_from: float | None
    value: float | None
    bound: float | None
    margin: float | None
    compliant: bool
    reason: NotRequired[str]


class Alert(TypedDict):
    series: str
    step: int
    since: int
    until: int
    samples: int
    max_grad: float
    value: float


class DeadExpert(TypedDict):
    layer: str
    expert: int
    since: int
    step: int
    until: int
    steps: int
    recovered: bool


class Starvation(TypedDict):
    layer: str
    expert: int
    since: int
    step: int
    until: int
    steps: int
    share: float
    fraction: float
    samples: int


class LogFinding(TypedDict):
    line: int
    step: int | None
    where: str
    what: str


class SkippedCheck(TypedDict):
    check: str
    series: str
    reason: str
    from_step: NotRequired[int]
    to_step: NotRequired[int]


class Resampled(TypedDict):
    native_gap: int | None
    block: int
    samples: int


class Sampling(TypedDict):
    policy_interval: int
    median_gap: int | None
    floor_bound: float | None
    vacuous: list[str]
    warnings: list[str]
    resampled: NotRequired[Resampled]


class EnvelopeConstants(TypedDict):
    delta: float
    epsilon: float
    window: int
    budget: float


class AlertRule(TypedDict):
    a: float
    b: float
    n: int


class DeadExpertRule(TypedDict):
    grad: float
    steps: int


class StarvationRule(TypedDict):
    share: float
    steps: int
    fraction: float


class EnvelopeRules(TypedDict):
    alert: AlertRule
    dead_expert: DeadExpertRule
    starvation: StarvationRule


StepWindow = TypedDict("StepWindow", {"from": int, "to": int})


# --- ``envelope --compare``: logs vs replays, window by window (moeaudit.judge.envelope_compare) ----------


class EndpointCheck(TypedDict):
    """The Δ-step condition between two samples of one source (compliant None: a sample is missing)."""

    value_from: float | None
    value: float | None
    bound: float | None
    margin: float | None
    compliant: bool | None
    reason: NotRequired[str]


class WorstPair(TypedDict):
    from_step: int
    to_step: int
    value_from: float | None
    value: float | None
    bound: float | None


class LogsWindow(TypedDict):
    """The logs' verdict on one window: every logged pair ending in it (compliant None: none does)."""

    samples: int
    pairs: int
    violations: int
    first_violation: int | None
    min_margin: float | None
    worst: WorstPair | None
    compliant: bool | None
    reason: NotRequired[str]


class ComparedWindow(TypedDict):
    series: str
    window: int
    start: int
    end: int
    gap: int
    replay: EndpointCheck
    logs: LogsWindow
    logs_endpoints: EndpointCheck
    agree: bool | None
    agree_endpoints: bool | None
    probe: NotRequired[EndpointCheck]
    agree_probe: NotRequired[bool | None]


class NotCompared(TypedDict):
    """A series only one source has (``series``), or a window a break falls in (``window``)."""

    series: NotRequired[str]
    window: NotRequired[int]
    start: NotRequired[int]
    end: NotRequired[int]
    reason: str


class AgreementRate(TypedDict):
    compared: int
    agree: int
    rate: float | None


class AgreementRates(TypedDict):
    logs: AgreementRate
    logs_endpoints: AgreementRate
    probe: NotRequired[AgreementRate]


class Agreement(TypedDict):
    logs: AgreementRate
    logs_endpoints: AgreementRate
    probe: NotRequired[AgreementRate]
    by_series: Annotated[dict[str, AgreementRates], DATA_KEYS]


class ViewConstants(TypedDict):
    delta: float
    epsilon: float
    budget: float
    calibrated: bool
    provenance: str


class ViewsConstants(TypedDict):
    replay: ViewConstants
    logs: ViewConstants
    logs_endpoints: ViewConstants
    probe: NotRequired[ViewConstants]


class ProbeAgreement(TypedDict):
    """How close the canary probe's V is to the replay's at the steps both have."""

    steps: list[int]
    max_rel_diff: float | None
    by_series: Annotated[dict[str, float | None], DATA_KEYS]


class WindowComparison(TypedDict):
    """:func:`moeaudit.judge.envelope_compare.compare`: the windows side by side."""

    windows: list[ComparedWindow]
    skipped: list[NotCompared]
    agreement: Agreement
    constants: ViewsConstants
    probe_vs_replay: NotRequired[ProbeAgreement]


class EnvelopeComparison(TypedDict):
    """``envelope --compare``: the report's ``comparison``, with the other sources' reports."""

    calibrated_on: str | None
    note: NotRequired[str]
    windows: list[ComparedWindow]
    skipped: list[NotCompared]
    agreement: Agreement
    constants: ViewsConstants
    probe_vs_replay: NotRequired[ProbeAgreement]
    report: "EnvelopeReport"
    probe_report: NotRequired["EnvelopeReport"]


# --- the rows of one series, before the report names their series or layer ----------------------------
# (each is the report's row less its first field: tests/test_typed_producers.py holds them equal)


class WindowCheck(TypedDict):
    """A row of :data:`EnvelopeWindow` less ``series``."""

    index: int
    start: int
    end: int
    anchor_value: float | None
    samples: int
    stretched: bool
    min_margin: float | None
    compliant: bool


class PairCheck(TypedDict):
    """A row of :data:`DiscreteRow` less ``series``."""

    from_step: int
    to_step: int
    gap: int
    value_from: float | None
    value: float | None
    bound: float | None
    margin: float | None
    compliant: bool
    reason: NotRequired[str]


class AlertRun(TypedDict):
    """An :data:`Alert` less ``series``."""

    step: int
    since: int
    until: int
    samples: int
    max_grad: float
    value: float


class DeadRun(TypedDict):
    """A :data:`DeadExpert` less ``layer``."""

    expert: int
    since: int
    step: int
    until: int
    steps: int
    recovered: bool


class StarvedWindow(TypedDict):
    """A :data:`Starvation` less ``layer``."""

    expert: int
    since: int
    step: int
    until: int
    steps: int
    share: float
    fraction: float
    samples: int


class ShownCount(TypedDict):
    """Rows of one list of a long series: how many were evaluated, shown, and non-compliant."""

    evaluated: int
    shown: int
    noncompliant: int


class ShownRows(TypedDict):
    samples: ShownCount
    windows: ShownCount
    discrete: ShownCount


class EnvelopeReport(TypedDict):
    """``moeaudit envelope --json``, ``receipts/envelope.json`` and the predicate's ``envelope``."""

    schema: Literal["moeaudit.envelope/v1"]
    source: str
    origin: str
    variant: str
    constants: EnvelopeConstants
    calibrated: bool
    provenance: str
    rules: EnvelopeRules
    series: Annotated[dict[str, list[EnvelopeSample]], DATA_KEYS]
    windows: list[EnvelopeWindow]
    discrete: list[DiscreteRow]
    compliant: bool  # every gated rule holds (starvation; the variance bound when calibrated)
    first_violation: Violation | None
    alerts: list[Alert]
    dead_experts: list[DeadExpert]
    starvation: list[Starvation]
    findings: list[LogFinding]
    skipped: list[SkippedCheck]
    sampling: Sampling
    window: NotRequired[StepWindow]
    variance_gated: bool  # the variance bound is gated (calibrated constants), else only reported
    variance_within_bound: bool  # the Grönwall and Δ-step result, gated or reported
    unevaluable: list[Unevaluable]
    shown: NotRequired[Annotated[dict[str, ShownRows], DATA_KEYS]]  # a long series' rows are thinned (docs/envelope.md)
    comparison: NotRequired[EnvelopeComparison]  # ``envelope --compare``: the other sources' reports
    # why the policy's own envelope could not be evaluated on this run, so that the built-in
    # rules were (series.envelope_evidence; docs/policy.md "envelope fallback")
    fallback: NotRequired[str]
    # the precision the series' lines were computed in, where they name one: a canary probe over
    # bf16/fp16 weights (a replay computes in float32; docs/decisions.md, "Training integrations")
    precision: NotRequired[str]
