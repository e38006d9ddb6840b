"""The documents moeaudit writes and reads, as types: receipts, pair and compare documents, gate
entries, checks, margins, the envelope report, the promotion decision and the v2 predicate.

Torch-free, and nothing here runs: every record is a :class:`TypedDict`, so at runtime a record
is the plain ``dict`` moeaudit has always built, read and signed, and ``mypy`` catches a
misspelt or missing key where one is built or read. Field names are moeaudit's own
(snake_case); the signed v2 predicate carries their lowerCamelCase form
(:mod:`moeaudit.attest.naming`), except in the maps whose keys are data — layer indices, series
names, canary domain names — marked here ``Annotated[..., DATA_KEYS]``, which ``naming`` reads.

The JSON Schemas shipped in ``moeaudit/schemas/`` are generated from these types
(:mod:`moeaudit.schemas`); a test fails when a shipped schema and the types disagree.

A record listed in :data:`OPEN` may carry fields beyond the ones named (the machine description,
a family's router note, a receipt section that grows with the family): its schema allows them.
Every other record is closed.
"""

import sys
from typing import Annotated, Any, Literal

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


class DataKeys:
    """Marks a ``dict`` whose keys are data (``Annotated[dict[str, X], DATA_KEYS]``): never renamed
    on the wire, and not field names in the schema."""

    def __repr__(self) -> str:
        return "DATA_KEYS"


DATA_KEYS = DataKeys()

Status = Literal["PASS", "FAIL", "INCONCLUSIVE"]
GateStatus = Literal["BASELINE", "GREEN", "YELLOW", "RED"]
Promotion = Literal["PROMOTE", "HOLD", "INCONCLUSIVE"]
Interval = list[float]  # a 95% interval [low, high]


class Sha256(TypedDict):
    sha256: str


# --- shared parts ----------------------------------------------------------------------------------


class ToolRecord(TypedDict):
    name: str
    version: str


class EnvironmentRecord(TypedDict):
    """What computed the numbers (open: the machine description may grow)."""

    torch: str
    python: str
    device: str
    dtype: str
    devices: NotRequired[dict[str, str]]  # part → device, when several computed them
    world_size: NotRequired[int]  # an expert-parallel replay's ranks (issue 28)
    backend: NotRequired[str]  # its torch.distributed backend: gloo, nccl
    rank_devices: NotRequired[list[str]]  # each rank's compute device, by rank
    world_sizes: NotRequired[dict[str, int]]  # part → world size, when the parts' differ
    precision: NotRequired[str]  # --precision other than fp32: what ran (tf32 off CUDA ran fp32)


class CanaryMismatch(TypedDict):
    """Where the audited run records another canary than the one audited (signed only when
    certify was told to accept it)."""

    source: str  # canary_probe.jsonl, canary.safetensors, checkpoint-N/tokenizer.json
    recorded: str  # SHA-256: the digest the run records (a tokenizer.json's own)
    given: str  # SHA-256: the audited canary's digest (its tokenizer_sha256)


class CanaryRecord(TypedDict):
    digest: Sha256
    windows: int
    window_len: int
    domains: list[str]
    origin: NotRequired[str]
    tokenizer_sha256: NotRequired[str]  # a canary built from text: its tokenizer.json's SHA-256
    text_sha256: NotRequired[str]  # … and its text file's
    mismatches: NotRequired[list[CanaryMismatch]]  # the run recorded another canary (accepted)


# --- the policy as signed -----------------------------------------------------------------------------


class ReceiptsPolicy(TypedDict):
    bootstrap: int
    seed: int
    flip_sigma: float
    boundary_etas: list[float]
    boundary_layer_eta: float
    beta_adj: float


class MarginsPolicy(TypedDict):
    tau: float
    lambda1: float
    lambda2: float
    mu1: float
    mu2: float
    mu3: float
    beta_r: float
    beta_pi: float
    beta_h: float
    protected_layers: list[int] | None


class EnvelopePolicy(TypedDict):
    variant: str
    delta: float
    epsilon: float
    window: int
    calibrated: bool
    calibration_c: float
    source: str
    provenance: str
    calibrated_model: str
    calibrated_stage: str
    sampling_interval: int
    warmup_steps: int
    alert_a: float
    alert_b: float
    alert_n: int
    dead_grad: float
    dead_steps: int
    starve_share: float
    starve_steps: int
    starve_fraction: float


class GatesPolicy(TypedDict):
    nll_tol: float
    tol_c2: float
    tol_c2_rel: float
    tol_dead: int
    escalate_after: int
    pi_min_ratio_floor: float
    entropy_ratio_floor: float
    floor_dead_fraction: float
    floor_pi_share: float
    floor_entropy_norm: float
    inconclusive_band: float
    stage: str | None
    calibrated: bool
    provenance: str


class PolicySettings(TypedDict):
    """:meth:`moeaudit.policy.Policy.to_json`."""

    receipts: ReceiptsPolicy
    margins: MarginsPolicy
    envelope: EnvelopePolicy
    gates: GatesPolicy


class PolicyRecord(PolicySettings):
    source: str
    digest: str
    calibrated: bool
    origin: NotRequired[str]


# --- margins -----------------------------------------------------------------------------------------


class MarginLayer(TypedDict, total=False):
    layer: int
    exact: float | None
    smooth: float | None
    ci95: Interval | None
    load_exact: float | None
    load_smooth: float | None
    load_ci95: Interval | None


class AlsoAgainst(TypedDict):
    against_step: int
    exact: float | None


class Margin(TypedDict, total=False):
    """A refinement (r_ex) or handoff (h_ex) margin; ``exact`` None when undefined (``reason``)."""

    exact: float | None
    smooth: float | None
    ci95: Interval | None
    ci_method: str
    smooth_note: str
    tau: float
    betas: dict[str, float]
    per_layer: list[MarginLayer]
    reason: str
    notes: list[str]
    reference: str
    against_step: int
    also_against: list[AlsoAgainst]
    stage: str  # refinement: the stage in force at its base step, which decides whether it is gated


class Margins(TypedDict):
    refinement: Margin | None
    handoff: Margin | None


# --- receipts (moeaudit.receipts/v1) -----------------------------------------------------------------


class ReceiptsCheckpoint(TypedDict):
    name: str
    digest: Sha256
    family: str
    routed_layers: list[int]
    experts: int
    top_k: int
    quantization: NotRequired[Any]
    left_out: NotRequired[list[Any]]


class ReceiptsSettings(TypedDict):
    receipts: ReceiptsPolicy
    policy_digest: str


class ReceiptsLayer(TypedDict):
    """One routed layer's receipts (open: a family may add a section)."""

    layer: int
    occupancy: dict[str, Any]
    boundary: dict[str, Any]
    overlap: dict[str, Any]
    domains: dict[str, Any]
    gate: NotRequired[dict[str, Any]]  # a biased / group-limited router's note and bias telemetry
    gradients: NotRequired[dict[str, Any]]
    monitors: NotRequired[dict[str, Any]]  # Megatron-Core / NeMo load metrics (docs/monitors.md)


class NonFinite(TypedDict):
    """A number that was not finite, written null (:func:`moeaudit.jsonio.finite_document`)."""

    path: str
    value: str
    reason: str


class FlipRates(TypedDict):
    overall: float  # mean over routed layers
    max: float
    layers: Annotated[dict[str, float], DATA_KEYS]  # routed layer → fraction of tokens whose R_k differs


class NllAgreement(TypedDict):
    reference: float | None  # the fp32 replay's NLL on the agreement windows
    measured: float | None  # the reduced-precision replay's
    relative_difference: float | None


class GradNormAgreement(TypedDict):
    max: float  # over every expert with a nonzero fp32 gradient norm, all routed layers
    median: float
    experts: int


class Resolution(TypedDict):
    rule: str
    layers: Annotated[dict[str, float], DATA_KEYS]


class PrecisionAgreement(TypedDict):
    """A reduced-precision replay against the fp32 reference on the same canary windows (SPEC §3)."""

    reference: Literal["fp32"]
    precision: str
    expert_kernel: NotRequired[str]  # bf16: grouped_mm, per-expert matmul (or mixed)
    windows: list[int]
    tokens_per_layer: int
    topk_flip_rate: FlipRates
    nll: NllAgreement
    grad_norm_relative_difference: GradNormAgreement
    resolution: Resolution  # the boundary receipts' own, per routed layer (docs/policy.md)
    within_resolution: bool


class CheckpointAgreement(PrecisionAgreement):
    checkpoint: str
    step: int


class Receipts(TypedDict):
    """``moeaudit receipts --json`` and ``receipts/checkpoint-<step>.json``."""

    schema: Literal["moeaudit.receipts/v1"]
    tool: ToolRecord
    checkpoint: ReceiptsCheckpoint
    canary: CanaryRecord
    settings: ReceiptsSettings
    environment: EnvironmentRecord
    nll: float | None
    nll_by_domain: Annotated[dict[str, float | None], DATA_KEYS]
    nll_windows: list[float | None]
    predictive_entropy: float | None
    nonfinite_weights: list[Any]
    layers: list[ReceiptsLayer]
    pooled: NotRequired[dict[str, Any]]
    conflict: NotRequired[dict[str, Any]]
    generation: NotRequired[dict[str, Any]]
    nonfinite: NotRequired[list[NonFinite]]
    precision_agreement: NotRequired[PrecisionAgreement]  # only when not computed in fp32


class PairLayer(TypedDict):
    """One layer of a pair receipt (open: the drift sections grow with the router)."""

    layer: int
    drift: dict[str, Any]


class PairDocument(TypedDict):
    """``receipts/pair-<step>-vs-<base>.json``: drift of a checkpoint against its baseline."""

    schema: Literal["moeaudit.pair/v1"]
    base_step: int
    step: int
    environment: EnvironmentRecord
    layers: list[PairLayer]
    nonfinite: NotRequired[list[NonFinite]]


class CompareDocument(TypedDict):
    """``moeaudit compare --json`` (open: the report grows)."""

    schema: Literal["moeaudit.compare/v1"]
    base: Receipts
    candidate: Receipts
    protected_layers: list[int]
    layers: list[PairLayer]
    margins: Margins


# --- gate entries --------------------------------------------------------------------------------------


class LayerSummary(TypedDict):
    layer: int
    c2: float | None
    c2_ci95: Interval | None
    dead: int  # no token routed to it, or no canary gradient reaching it (gates.dead_experts)
    no_gradient: NotRequired[list[int]]  # routed experts with no canary gradient (zero weights)
    c2_excluded_tokens: NotRequired[int]  # canary tokens left out of C2 (pair weight 0)
    pi_min: float
    state1: float | None
    entropy_norm: float


class GateReceipts(TypedDict):
    """The receipts summary a gate row shows."""

    checkpoint: str
    digest: Sha256
    nll: float | None
    c2_mean: float | None
    state1_mean: float | None
    dead: int
    cv_mean: float | None
    entropy_norm_min: float | None
    nll_by_domain: Annotated[dict[str, float | None], DATA_KEYS]
    per_layer: list[LayerSummary]
    training_loss: NotRequired[float | None]
    training_losses: NotRequired[dict[str, float]]


class HealthFailure(TypedDict):
    layer: int
    what: str
    value: float | None  # None: the receipt itself was not finite
    threshold: float


class Health(TypedDict):
    ok: bool
    problems: list[str]
    failed: list[HealthFailure]


NllChange = TypedDict(
    "NllChange", {"from": float | None, "to": float | None, "delta": float | None, "ci95": Interval | None}
)


class Comparison(TypedDict):
    """Against one earlier baseline (``also_against``)."""

    against: str
    ok: bool
    c2_ok: bool
    occupancy_ok: bool
    c2_min_delta: float | None
    pi_min_ratio: float
    entropy_ratio: float


class Structural(TypedDict):
    """A checkpoint's structure against its baseline(s): the deciding comparison."""

    against: str
    c2_ok: bool
    c2_min_delta: float | None
    c2_deltas: Annotated[dict[str, float | None], DATA_KEYS]
    c2_tolerance: Annotated[dict[str, float], DATA_KEYS]
    c2_fallen_layers: list[int]
    # absent: C2 held or fell on the protected layers (c2_ok says which); "not applicable": no
    # co-active pairs (top-1 routing, E = k; the reason per layer); "not computed": a C2 that
    # should exist and does not. Neither is ever signed as held (gates.claims).
    c2_status: NotRequired[Literal["not applicable", "not computed"]]
    c2_not_applicable: NotRequired[Annotated[dict[str, str], DATA_KEYS]]
    c2_not_computed_layers: NotRequired[list[int]]
    # per protected layer, canary tokens left out of C2 at this gate (pair weight 0), of c2_tokens
    c2_excluded_tokens: NotRequired[Annotated[dict[str, int], DATA_KEYS]]
    c2_tokens: NotRequired[int | None]
    occupancy_ok: bool
    layers_with_more_dead: list[int]
    pi_min_ratio: float
    entropy_ratio: float
    # 95% interval of the lowest π_min and entropy ratio, and the occupancy quantities below their
    # floor beyond that noise (name → layers): these, not the point ratios, decide occupancy_ok
    ratio_ci95: NotRequired[dict[str, Interval | None]]
    below_floor: NotRequired[Annotated[dict[str, list[int]], DATA_KEYS]]  # quantity name → layers
    ok: bool
    active: NotRequired[str]
    also_against: NotRequired[list[Comparison]]


class GateClaims(TypedDict):
    licensed: list[str]
    not_licensed: list[str]


class DriftLayer(TypedDict):
    layer: int
    coordinate: float | None
    boundary: float | None
    transition: float | None
    content: float | None
    ci95: dict[str, Interval | None]


class DriftSummary(TypedDict):
    against_step: int
    layers: list[DriftLayer]


class GateEntry(TypedDict):
    """One checkpoint of a run, judged: BASELINE, GREEN, YELLOW or RED."""

    step: int
    scalar: str
    nll_change: NllChange | None
    receipts: GateReceipts
    health: Health
    status: GateStatus
    baseline: int
    consecutive_bad: int
    claims: GateClaims
    duplicate_of: NotRequired[int]
    reason: NotRequired[str]
    new_baseline: NotRequired[bool]
    structural: NotRequired[Structural]
    continuity: NotRequired[Structural]
    drift: NotRequired[DriftSummary]


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


# --- the envelope report (moeaudit.envelope/v1) -------------------------------------------------------


class EnvelopeSample(TypedDict):
    step: int
    value: float | None
    bound: float | None
    margin: float | None
    compliant: bool
    window: int
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
    comparison: NotRequired[dict[str, Any]]  # ``envelope --compare``: the other sources' reports
    # why the policy's own envelope could not be evaluated on this run, so that the built-in
    # rules were (series.envelope_evidence; docs/policy.md "envelope fallback")
    fallback: NotRequired[str]


# --- the v2 predicate ---------------------------------------------------------------------------------


class RunEvent(TypedDict):
    step: int
    event: str
    note: str
    source: str


class Abandoned(TypedDict):
    """An abandoned branch of the run, still audited (open: :meth:`moeaudit.lineage` grows it)."""

    name: str
    reason: str


class RunRecord(TypedDict):
    name: str
    path: str
    stage: str
    stage_source: str
    checkpoints: list[int]
    skipped: list[str]
    events: list[RunEvent]
    abandoned: NotRequired[list[Abandoned]]


class InputFile(TypedDict):
    path: str
    sha256: str
    bytes: int


class FileResource(TypedDict):
    """One file a checkpoint's root digest covers, as OpenSSF model-signing's predicate lists
    its ``resources`` (``name``, ``algorithm``, ``digest``), with its size in bytes."""

    name: str  # path relative to the checkpoint directory, POSIX separators
    size: int
    algorithm: Literal["sha256"]
    digest: str  # hex


class ReferenceInput(TypedDict):
    path: str
    kind: Literal["checkpoint", "receipts"]
    root_sha256: NotRequired[str]
    resources: NotRequired[list[FileResource]]  # a checkpoint's files, as a subject's
    sha256: NotRequired[str]
    bytes: NotRequired[int]


class Inputs(TypedDict, total=False):
    metrics: InputFile
    probe: InputFile
    events: InputFile
    policy_file: InputFile
    reference: ReferenceInput


class Occupancy(TypedDict):
    layers: list[int]
    pi: list[list[float]]


class DomainHeatmap(TypedDict):
    names: list[str]
    layers: Annotated[dict[str, Annotated[dict[str, list[float]], DATA_KEYS]], DATA_KEYS]


class Heatmaps(TypedDict):
    checkpoint: str
    occupancy: Occupancy
    domains: DomainHeatmap


class MonitorLayer(TypedDict):
    """One routed layer's values of the live monitors' metrics, under their own names
    (docs/monitors.md): Megatron-Core's router-health operations, NeMo's load-balance keys."""

    layer: int
    megatron: Annotated[dict[str, float | None], DATA_KEYS]
    nemo: Annotated[dict[str, float | None], DATA_KEYS]


class MonitorsSection(TypedDict):
    checkpoint: str  # the last audited checkpoint, as the heatmaps
    layers: list[MonitorLayer]


class ClaimRow(TypedDict):
    receipt: str
    measures: str
    licenses: str
    does_not_license: str


class RouterCheckpoint(TypedDict):
    step: int
    pi_min: float
    dead: int
    bias_min: float | None
    bias_max: float | None
    bias_std: float | None
    bias_drift: float | None


class RouterLayer(TypedDict):
    layer: int
    checkpoints: list[RouterCheckpoint]


class RouterSection(TypedDict):
    """What a biased / group-limited router changes, and its bias telemetry over the run (open:
    the router's note is the family's)."""

    layers: list[RouterLayer]


class CacheUse(TypedDict):
    kind: str
    checkpoints: NotRequired[list[str]]


class CheckpointFiles(TypedDict):
    """The files of one subject (``name`` is the subject's name), in model-signing's order:
    their digests hash to the subject's root digest, and their names are what it does not bind."""

    name: str
    resources: list[FileResource]


class ParameterCount(TypedDict):
    """The last audited checkpoint's parameters, from its headers (moeaudit.checkpoint.params):
    ``active`` = all but the routed experts, plus top_k/num_experts of the routed experts."""

    checkpoint: str
    total: int
    active: int
    routed_experts: int
    shared_experts: int
    top_k: int
    num_experts: int


class ReplayCompute(TypedDict):
    """One replay this audit ran: the FLOPs counted and the GPU energy NVML measured."""

    receipt: str  # the receipts file the replay produced
    flops: int
    energy_joules: float | None
    energy_reason: NotRequired[str]  # why the energy was not measured


class ComputeRecord(TypedDict):
    """The audit's own compute (moeaudit.receipts.measured): summed over ``replays``."""

    flops: int | None  # None: no replay ran (every receipt from the cache)
    counted_by: str
    energy_joules: float | None  # None: not measured (``energy_reason``)
    energy_by: str
    energy_reason: NotRequired[str]
    replays: list[ReplayCompute]


class FirstCheckpoint(TypedDict):
    name: str
    step: int
    written_at: str | None  # RFC 3339: the earliest modification time of its files
    evidence: str  # what ``written_at`` was taken from


class PreregisteredDigests(TypedDict):
    settings_digest: str
    canary_sha256: str


class PreregistrationRecord(TypedDict):
    """Whether the criteria (policy, canary) were fixed before the evidence
    (:mod:`moeaudit.attest.preregistration`)."""

    status: Literal["matched", "mismatch", "absent"]
    ordering: Literal["before", "after", "unknown"]  # the preregistration vs the first audited checkpoint
    calibration: Literal[
        "not calibrated", "preregistered", "fitted after the evidence", "not shown to predate the evidence"
    ]
    summary: str
    first_checkpoint: FirstCheckpoint
    file: NotRequired[InputFile]
    keyid: NotRequired[str]
    created_at: NotRequired[str]
    run: NotRequired[str]
    mismatches: NotRequired[list[Literal["policy", "canary", "run"]]]
    preregistered: NotRequired[PreregisteredDigests]


class AblationExpert(TypedDict):
    """One routed expert removed from routing (``certify --ablate``; docs/decisions.md, "Ablation receipt")."""

    layer: int
    expert: int
    flagged: bool  # by the occupancy floors (flag_rule)
    flags: list[str]  # why: "no token", "no gradient", "π below floor"
    pi: float | None  # its share of canary tokens routed to it
    nll: float  # canary mean NLL without it
    nll_delta: float  # nll − the NLL as trained
    ci95: Interval | None  # window bootstrap of nll_delta
    reading: str  # "rarely used but needed", "unused and not needed", "used and needed", "used but not needed"


class AblationRefusal(TypedDict):
    layer: int
    reason: str


class AblationCost(TypedDict):
    layer_forwards: int  # decoder layers computed (the baseline forward's included)
    replay_layer_forwards: int  # those of one forward of the canary


class AblationReceipt(TypedDict):
    """The canary NLL change when each flagged (or every) routed expert is removed, at the last checkpoint."""

    mode: Literal["low-occupancy", "all"]
    checkpoint: str
    step: int
    flag_rule: str
    floor_pi_share: float
    removal: str  # how the family routes without the expert
    nll: float | None
    experts: list[AblationExpert]
    refused: list[AblationRefusal]
    cost: AblationCost
    sentences: list[str]


class Predicate(TypedDict):
    """``https://moeaudit.dev/training-health/v2``, with moeaudit's own field names."""

    verdict: Status
    verdict_reason: str
    run: RunRecord
    inputs: Inputs
    canary: CanaryRecord
    policy: PolicyRecord
    tool: ToolRecord
    environment: EnvironmentRecord
    precision: NotRequired[str]  # what the replays computed in when not fp32 (absent: fp32, the reference)
    precision_agreement: NotRequired[list[CheckpointAgreement]]  # per checkpoint, when not fp32
    protected_layers: list[int]
    gates: list[GateEntry]
    checks: list[Check]
    envelope: EnvelopeReport | None
    margins: Margins
    heatmaps: Heatmaps
    claims: list[ClaimRow]
    issued_at: NotRequired[str]  # set when signed
    router: NotRequired[RouterSection]
    ablation: NotRequired[AblationReceipt]  # certify --ablate
    from_cache: NotRequired[list[CacheUse]]
    monitors: NotRequired[MonitorsSection]  # absent from certificates before it
    checkpoint_files: NotRequired[list[CheckpointFiles]]  # absent from certificates before it
    parameters: NotRequired[ParameterCount]  # absent from certificates before it
    compute: NotRequired[ComputeRecord]  # absent from certificates before it
    preregistration: NotRequired[PreregistrationRecord]  # absent from certificates before it


class Subject(TypedDict):
    name: str
    digest: dict[str, str]


class Statement(TypedDict):
    _type: str
    subject: list[Subject]
    predicateType: str
    predicate: Predicate


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


# --- moeaudit preregister: the criteria signed before training (moeaudit.attest.preregistration) ---


class PreregisteredPolicy(TypedDict):
    file: str
    sha256: str  # of the file's bytes
    settingsDigest: str  # what certificates sign as predicate.policy.digest
    calibrated: bool


class PreregisteredCanary(TypedDict):
    file: str
    digest: Sha256  # the canary's content digest (SPEC §2.2)


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


# Records whose schema allows fields beyond the ones named (see the module docstring).
OPEN: frozenset[type] = frozenset(
    {EnvironmentRecord, ReceiptsLayer, PairLayer, CompareDocument, Abandoned, RouterSection, ReceiptsCheckpoint}
)

# The documents with a published schema: file name → (record, wire names?).
PUBLISHED: dict[str, tuple[type, bool]] = {
    "training-health-v2.predicate.schema.json": (Predicate, True),
    "receipts-v1.schema.json": (Receipts, False),
    "gate-v1.schema.json": (GateDocument, False),
    "test-result-v0.1.statement.schema.json": (TestResultStatement, False),
    "svr-v0.1.statement.schema.json": (SvrStatement, False),
    "svr-v0.2.statement.schema.json": (SvrStatementV02, False),
    "preregistration-v1.statement.schema.json": (PreregistrationStatement, False),
}

# ----- introspection: what the schema generator and the wire naming read -------------------

import types  # noqa: E402
import typing  # noqa: E402
from collections.abc import Iterator  # noqa: E402

if sys.version_info >= (3, 11):
    _NOT_REQUIRED: tuple[Any, ...] = (typing.NotRequired, typing.Required)
else:  # pragma: no cover - Python 3.10
    import typing_extensions

    _NOT_REQUIRED = (typing_extensions.NotRequired, typing_extensions.Required)


def is_record(tp: Any) -> bool:
    return isinstance(tp, type) and typing.is_typeddict(tp)


def fields(record: type) -> dict[str, Any]:
    """Field name → type of a record (``NotRequired`` unwrapped; ``Annotated`` kept)."""
    hints = typing.get_type_hints(record, include_extras=True)
    return {name: _unwrap(tp) for name, tp in hints.items()}


def required(record: type) -> frozenset[str]:
    return frozenset(getattr(record, "__required_keys__", frozenset()))


def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) in _NOT_REQUIRED:
        (tp,) = typing.get_args(tp)
    return tp


def is_data_map(tp: Any) -> bool:
    """``Annotated[dict[str, X], DATA_KEYS]``: a map whose keys are data, not field names."""
    return typing.get_origin(tp) is typing.Annotated and any(a is DATA_KEYS for a in tp.__metadata__)


def data_map_paths(record: type) -> frozenset[str]:
    """Paths (``a.b``, ``[]`` for a list's items, ``*`` for a map's keys) of every data map under
    ``record``: what :mod:`moeaudit.attest.naming` keeps unrenamed."""
    return frozenset(p for p, tp in _walk(record, "") if is_data_map(tp))


def _walk(tp: Any, path: str, seen: tuple[type, ...] = ()) -> Iterator[tuple[str, Any]]:
    yield path, tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        inner = args[0]
        for p, t in _walk(inner, path, seen):
            if p != path:
                yield p, t
    elif is_record(tp):
        if tp in seen:
            return
        for name, ftp in fields(tp).items():
            yield from _walk(ftp, f"{path}.{name}".lstrip("."), (*seen, tp))
    elif origin is list:
        yield from _walk(args[0], f"{path}[]", seen)
    elif origin is dict:
        yield from _walk(args[1], f"{path}.*", seen)
    elif origin in (typing.Union, types.UnionType):
        for arm in args:
            for p, t in _walk(arm, path, seen):
                if p != path:
                    yield p, t


__all__ = [
    "data_map_paths",
    "fields",
    "is_data_map",
    "is_record",
    "required",
    "DATA_KEYS",
    "OPEN",
    "PUBLISHED",
    "Check",
    "Decision",
    "EnvelopeReport",
    "GateEntry",
    "GateResult",
    "Margin",
    "Margins",
    "PairDocument",
    "Predicate",
    "Receipts",
    "ResourceDescriptor",
    "Statement",
    "SvrStatement",
    "SvrStatementV02",
    "PreregistrationStatement",
    "TestResultStatement",
]
