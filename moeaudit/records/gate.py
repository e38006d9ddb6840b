"""A gate entry: one checkpoint of a run, judged (:mod:`moeaudit.judge.gates`; :mod:`moeaudit.records`)."""

import sys
from typing import Annotated, Literal

from moeaudit.records.common import DATA_KEYS, GateStatus, Interval, Sha256

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


# --- gate entries --------------------------------------------------------------------------------------


class LayerSummary(TypedDict):
    layer: int
    c2: float | None
    c2_ci95: Interval | None
    dead: int  # no token routed to it, or no canary gradient reaching it (judge.health.dead_experts)
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
    # dead-expert, π_min and H_norm readings below a floor that the canary is too small to resolve
    unresolved: NotRequired[list[str]]
    resolution: NotRequired[str]  # what the canary resolves, and the tokens that would resolve it


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
    # co-active pairs (top-1 routing; the reason per layer); "not computed": a C2 that
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
    # the stage whose rules judged this gate: the one in force at the base of its pair (a
    # declared stage applies from its step on, docs/policy.md)
    stage: str
    baseline: int
    consecutive_bad: int
    claims: GateClaims
    duplicate_of: NotRequired[int]
    reason: NotRequired[str]
    new_baseline: NotRequired[bool]
    structural: NotRequired[Structural]
    continuity: NotRequired[Structural]
    drift: NotRequired[DriftSummary]
