"""The policy as signed: :meth:`moeaudit.policy.Policy.to_json` (:mod:`moeaudit.records`)."""

import sys

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


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
