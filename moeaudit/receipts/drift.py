"""Pair receipts of a base θ0 and a candidate θ1 on base-anchored states (`003` §5, Eq. 27–28,
Table 7; SPEC §5).

Base-anchored states: z^(0) from θ0's replay; y^(0→j) = γ_j ⊙ z^(0) pushes the same state
through each checkpoint's own gain, isolating routing and expert change from path change.
Both anchored states are built the same way, so identical checkpoints give exactly zero.

Shape suffixes: N tokens, E experts, K top-k, U = 2K (R^0 then R^1), C candidates, H hidden.
"""

from __future__ import annotations

from typing import Any

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.checkpoint.config import ModelSpec
from moeaudit.judge.policy import ReceiptSettings
from moeaudit.receipts.bootstrap import WindowBootstrap
from moeaudit.receipts.gate import bias_drift
from moeaudit.receipts.observer import AnchorStates
from moeaudit.receipts.occupancy import js_divergence
from moeaudit.receipts.overlap import visible_field
from moeaudit.replay.engine import deterministic
from moeaudit.replay.model import Routing, experts_forward, input_scales, route_layer

EPS_U = 1e-8


def one_minus_cos(a_NH: torch.Tensor, b_NH: torch.Tensor) -> torch.Tensor:
    """1 − cos(a, b) as ‖â − b̂‖²/2: the same number, but exactly 0 when a == b."""
    a, b = a_NH.double(), b_NH.double()
    a_hat = a / a.norm(dim=-1, keepdim=True)
    b_hat = b / b.norm(dim=-1, keepdim=True)
    return 0.5 * (a_hat - b_hat).pow(2).sum(-1)


def relative_change(u0: torch.Tensor, u1: torch.Tensor, z_NH: torch.Tensor, centred: bool = False) -> torch.Tensor:
    """‖v1 − v0‖ / (‖v1‖ + ‖v0‖ + ε) of the visible fields, per token and expert."""
    v0, v1 = visible_field(u0, z_NH, centred).double(), visible_field(u1, z_NH, centred).double()
    return (v1 - v0).norm(dim=-1) / (v1.norm(dim=-1) + v0.norm(dim=-1) + EPS_U)


@deterministic()
def pair_layer(spec: ModelSpec, lw0: LayerWeights, lw1: LayerWeights, base: AnchorStates,
               cand: AnchorStates, boot: WindowBootstrap) -> dict[str, Any]:
    K = spec.top_k
    z = base.z_NH
    y00, y01 = (lw.params["post_norm"] * z + lw.params.get("post_norm_bias", 0.0) for lw in (lw0, lw1))
    r0, r1 = route_layer(spec, lw0.params, y00), route_layer(spec, lw1.params, y01)

    coordinate_N = one_minus_cos(base.y_NH, cand.y_NH)
    shared_N = (r0.topk_NK[:, :, None] == r1.topk_NK[:, None, :]).any(-1).sum(-1)
    boundary_N = 1.0 - shared_N.double() / K
    transition_N = js_divergence(r0.probs_NE, r1.probs_NE)

    union_NU = torch.cat([r0.topk_NK, r1.topk_NK], dim=1)
    def outputs(lw: LayerWeights, y: torch.Tensor, r: Routing, idx: torch.Tensor) -> torch.Tensor:
        scales = input_scales(spec, r, [idx])
        return experts_forward(lw.experts, y, idx, spec.clamped_glu, None if scales is None else scales[0])

    ratio_NU = relative_change(outputs(lw0, y00, r0, union_NU), outputs(lw1, y01, r1, union_NU), z, spec.layer_norm)
    dup_NK = (r1.topk_NK[:, :, None] == r0.topk_NK[:, None, :]).any(-1)  # counted once
    ratio_NU[:, K:][dup_NK] = float("nan")
    content_N = torch.nanquantile(ratio_NU, 0.9, dim=1)

    boundary_smooth_N = 1.0 - (r0.probs_NE.double() * r1.probs_NE.double()).sum(-1)
    rho_bar_NE = 0.5 * (r0.probs_NE.double() + r1.probs_NE.double())
    n_cand = min(spec.num_experts, 2 * K)
    cand_NC = rho_bar_NE.topk(n_cand, dim=-1).indices
    ratio_NC = relative_change(outputs(lw0, y00, r0, cand_NC), outputs(lw1, y01, r1, cand_NC), z, spec.layer_norm)
    rho_NC = rho_bar_NE.gather(1, cand_NC)
    content_smooth_N = (rho_NC * ratio_NC).sum(-1)

    drift = {
        "coordinate": float(coordinate_N.mean()),
        "boundary": float(boundary_N.mean()),
        "transition": float(transition_N.mean()),
        "content": float(content_N.mean()),
        "boundary_smooth": float(boundary_smooth_N.mean()),
        "content_smooth": float(content_smooth_N.mean()),
        "content_smooth_truncation_mass": float((1.0 - rho_NC.sum(-1)).mean()),
        "ci95": {name: boot.mean(v) for name, v in (
            ("coordinate", coordinate_N), ("boundary", boundary_N), ("transition", transition_N),
            ("content", content_N), ("boundary_smooth", boundary_smooth_N),
            ("content_smooth", content_smooth_N))},
        "replicates": {"boundary": boot.mean_replicates(boundary_N),
                       "content": boot.mean_replicates(content_N)},
    }
    out = {"drift": drift, "weights": weight_change(lw0, lw1)}
    b0, b1 = lw0.params.get("router_bias"), lw1.params.get("router_bias")
    if b0 is not None and b1 is not None:  # the balancer's control input, next to its result
        E = spec.num_experts
        pi0 = torch.bincount(r0.topk_NK.flatten(), minlength=E).double() / r0.topk_NK.shape[0]
        pi1 = torch.bincount(r1.topk_NK.flatten(), minlength=E).double() / r1.topk_NK.shape[0]
        out["selection_bias"] = bias_drift(b0, b1, pi0, pi1)
    return out


def weight_change(lw0: LayerWeights, lw1: LayerWeights) -> dict[str, Any]:
    """Secondary surface (`003` Table 7): ‖ΔW‖_F / ‖W^θ0‖_F per expert, and router drift."""

    def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        num = sum(float((y.double() - x.double()).pow(2).sum()) for x, y in zip(a, b))
        den = sum(float(x.double().pow(2).sum()) for x in a)
        return (num / den) ** 0.5 if den > 0 else float("nan")

    experts = [rel(list(e0.values()), [e1[n] for n in e0]) for e0, e1 in zip(lw0.experts, lw1.experts)]
    return {
        "expert_relative_change": experts,
        "router_drift": rel(*([lw.params[n] for n in ("router", "router_logit_bias") if n in lw0.params]
                              for lw in (lw0, lw1))),
        "gain_drift": rel([lw0.params["post_norm"]], [lw1.params["post_norm"]]),
    }


def bootstrap_for(settings: ReceiptSettings, num_windows: int, layer: int) -> WindowBootstrap:
    # the same windows as the layer's state receipts (receipts/observer.py), so that pair and state
    # replicates are paired draws (judge/margins.py)
    return WindowBootstrap(num_windows, settings.bootstrap, settings.seed * 1_000_003 + layer)
