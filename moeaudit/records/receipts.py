"""The receipts document, ``moeaudit.receipts/v1`` (:mod:`moeaudit.records`)."""

import sys
from typing import Annotated, Any, Literal

from moeaudit.records.common import DATA_KEYS, CanaryRecord, EnvironmentRecord, Sha256, ToolRecord
from moeaudit.records.policy import ReceiptsPolicy

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


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
    """A reduced-precision replay against fp32 on the same canary windows (docs/policy.md, "Reduced precision")."""

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
