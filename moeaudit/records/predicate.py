"""The signed v2 predicate (``https://moeaudit.dev/training-health/v2``) and its in-toto statement
(:mod:`moeaudit.records`)."""

import sys
from typing import Annotated, Literal

from moeaudit.records.checks import Check
from moeaudit.records.common import DATA_KEYS, CanaryRecord, EnvironmentRecord, Interval, Status, Subject, ToolRecord
from moeaudit.records.envelope import EnvelopeReport
from moeaudit.records.gate import GateEntry
from moeaudit.records.margins import Margins
from moeaudit.records.policy import PolicyRecord
from moeaudit.records.receipts import CheckpointAgreement, NonFinite

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


# --- the v2 predicate ---------------------------------------------------------------------------------


class RunEvent(TypedDict):
    step: int
    event: str
    note: str
    source: str


class Abandoned(TypedDict):
    """An abandoned branch of the run, still audited (open: :meth:`moeaudit.lineage` grows it)."""

    name: str
    step: int
    resume_step: int  # the latest resume below it
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
    # not metered: the count of the replay that produced this receipts file, which ran the same
    # products on the same shapes (moeaudit.receipts.flop_reuse)
    flops_from: NotRequired[str]
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


class AblationRemoval(TypedDict):
    """One expert removed from routing, as the replay measured it (before its flags and reading)."""

    layer: int
    expert: int
    nll: float
    nll_delta: float
    ci95: Interval | None


class AblationMeasurement(TypedDict):
    """What :func:`moeaudit.receipts.ablation.ablation_receipt` measures; the judge adds the flags,
    the readings and the sentences to make the :class:`AblationReceipt` (not itself written)."""

    removal: str
    nll: float | None
    experts: list[AblationRemoval]
    refused: list[AblationRefusal]
    cost: AblationCost


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


class Statement(TypedDict):
    _type: str
    subject: list[Subject]
    predicateType: str
    predicate: Predicate
    nonfinite: NotRequired[list[NonFinite]]  # a non-finite number in the predicate, written null


class VerifiedStatement(Statement):
    """A statement as :func:`moeaudit.attest.certificate.open_certificate` returns it: verified,
    in moeaudit's field names, with the key that signed it and the SHA-256 of the file."""

    _keyid: str
    _sha256: str
