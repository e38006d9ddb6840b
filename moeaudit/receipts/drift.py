"""Pair receipts of a base θ0 and a candidate θ1 on base-anchored states (`003` §5, Eq. 27–28,
Table 7).

Base-anchored states: z^(0) from θ0's replay; y^(0→j) = γ_j ⊙ z^(0) pushes the same state
through each checkpoint's own gain, isolating routing and expert change from path change.
Both anchored states are built the same way, so identical checkpoints give exactly zero.
Without a pre-norm (``Residual.pre_norm`` false: OLMo-2 post-norm layers) the router reads the
residual stream itself, so y^(0→j) = h^(0), the base's stream, for every checkpoint, and the
gain drift is null (docs/decisions.md).

Shape suffixes: N tokens, E experts, K top-k, U = 2K (R^0 then R^1), C candidates, H hidden.
"""

from __future__ import annotations

from typing import Any

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.policy import ReceiptSettings
from moeaudit.receipts.bootstrap import WindowBootstrap
from moeaudit.receipts.gate import bias_drift
from moeaudit.receipts.observer import AnchorStates
from moeaudit.receipts.occupancy import js_divergence
from moeaudit.receipts.overlap import visible_field
from moeaudit.records import PairSections
from moeaudit.replay.device import Device, moved, on_device, prepare_device, replay_scope, to_host
from moeaudit.replay.model import Routing, experts_forward_sets, input_scales, route_layer
from moeaudit.spec.config import ModelSpec

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


def pair_layer(
    spec: ModelSpec,
    lw0: LayerWeights,
    lw1: LayerWeights,
    base: AnchorStates,
    cand: AnchorStates,
    boot: WindowBootstrap,
    device: Device = None,
) -> PairSections:
    """One layer's pair receipts, computed on ``device`` as the replays are (None: the host,
    no copies): the two layers' weights are copied there (experts one at a time, converted
    there) with both checkpoints' anchor states; per-token values and per-expert sums come back
    in one transfer each, and the means and intervals are taken on the host."""
    dev = prepare_device(device)
    if dev is not None:
        base, cand = moved(base, dev, non_blocking=True), moved(cand, dev, non_blocking=True)
        lw0, lw1 = on_device(lw0, dev), on_device(lw1, dev)
    out: PairSections
    with replay_scope(dev):
        per_token, bias = _pair_tensors(spec, lw0, lw1, base, cand)
        per_token, bias = to_host((per_token, bias), dev)
        out = {
            "drift": _drift(per_token, boot),
            "weights": weight_change(lw0, lw1, dev, gain=spec.layers[lw0.layer].residual.pre_norm),
        }
    if bias is not None:  # the balancer's control input, next to its result
        out["selection_bias"] = bias_drift(*bias)
    return out


def _pair_tensors(
    spec: ModelSpec, lw0: LayerWeights, lw1: LayerWeights, base: AnchorStates, cand: AnchorStates
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...] | None]:
    """(per-token drift values [N], the selection biases and top-k shares (b0, b1, π0, π1) or
    None), where the inputs live."""
    K = spec.top_k
    z = base.z_NH
    if spec.layers[lw0.layer].residual.pre_norm:
        y00, y01 = (lw.params["post_norm"] * z + lw.params.get("post_norm_bias", 0.0) for lw in (lw0, lw1))
    else:  # no gain: each checkpoint's router reads the base's stream h^(0) (the base tap's y)
        y00 = y01 = base.y_NH
    r0, r1 = route_layer(spec, lw0.params, y00), route_layer(spec, lw1.params, y01)

    shared_N = (r0.topk_NK[:, :, None] == r1.topk_NK[:, None, :]).any(-1).sum(-1)
    rho_bar_NE = 0.5 * (r0.probs_NE.double() + r1.probs_NE.double())
    union_NU = torch.cat([r0.topk_NK, r1.topk_NK], dim=1)
    cand_NC = rho_bar_NE.topk(min(spec.num_experts, 2 * K), dim=-1).indices

    def outputs(lw: LayerWeights, y: torch.Tensor, r: Routing) -> list[torch.Tensor]:
        """u of both index sets in one sweep over the experts (each converted once)."""
        sets = [union_NU, cand_NC]
        return experts_forward_sets(lw.experts, y, sets, spec.expert_glu(lw.layer), input_scales(spec, r, sets))

    (u0_NU, u0_NC), (u1_NU, u1_NC) = outputs(lw0, y00, r0), outputs(lw1, y01, r1)
    ratio_NU = relative_change(u0_NU, u1_NU, z, spec.layer_norm)
    dup_NK = (r1.topk_NK[:, :, None] == r0.topk_NK[:, None, :]).any(-1)  # counted once
    ratio_NU[:, K:] = ratio_NU[:, K:].masked_fill(dup_NK, float("nan"))  # a boolean index would sync
    ratio_NC = relative_change(u0_NC, u1_NC, z, spec.layer_norm)
    rho_NC = rho_bar_NE.gather(1, cand_NC)
    per_token = {
        "coordinate": one_minus_cos(base.y_NH, cand.y_NH),
        "boundary": 1.0 - shared_N.double() / K,
        "transition": js_divergence(r0.probs_NE, r1.probs_NE),
        "content": torch.nanquantile(ratio_NU, 0.9, dim=1),
        "boundary_smooth": 1.0 - (r0.probs_NE.double() * r1.probs_NE.double()).sum(-1),
        "content_smooth": (rho_NC * ratio_NC).sum(-1),
        "content_smooth_truncation_mass": 1.0 - rho_NC.sum(-1),
    }
    b0, b1 = lw0.params.get("router_bias"), lw1.params.get("router_bias")
    if b0 is None or b1 is None:
        return per_token, None
    E = spec.num_experts
    pi0, pi1 = (torch.bincount(r.topk_NK.flatten(), minlength=E).double() / r.topk_NK.shape[0] for r in (r0, r1))
    return per_token, (b0, b1, pi0, pi1)


def _drift(per_token: dict[str, torch.Tensor], boot: WindowBootstrap) -> dict[str, Any]:
    """Means over the canary tokens, their window-bootstrap intervals and replicates."""
    drift: dict[str, Any] = {name: float(v.mean()) for name, v in per_token.items()}
    drift["ci95"] = {
        name: boot.mean(per_token[name])
        for name in ("coordinate", "boundary", "transition", "content", "boundary_smooth", "content_smooth")
    }
    drift["replicates"] = {name: boot.mean_replicates(per_token[name]) for name in ("boundary", "content")}
    return drift


def weight_change(lw0: LayerWeights, lw1: LayerWeights, device: Device = None, gain: bool = True) -> dict[str, Any]:
    """Secondary surface (`003` Table 7): ‖ΔW‖_F / ‖W^θ0‖_F per expert, and router drift. The
    sums are taken where the weights are, and come to the host in one transfer. ``gain`` false (a
    post-norm family, no norm before the router): the gain drift is null, with the reason."""

    def sums(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
        """[Σ ‖b − a‖², Σ ‖a‖²] in float64, summed in order from 0."""
        num, den = a[0].new_zeros((), dtype=torch.float64), a[0].new_zeros((), dtype=torch.float64)
        for x, y in zip(a, b, strict=True):
            num = num + (y.double() - x.double()).pow(2).sum()
        for x in a:
            den = den + x.double().pow(2).sum()
        return torch.stack([num, den])

    def rel(num: float, den: float) -> float:
        return (num / den) ** 0.5 if den > 0 else float("nan")

    # a zero-computation expert (LongCat, no weights) has no relative change: the parametric experts only
    rows = [sums(list(e0.values()), [e1[n] for n in e0]) for e0, e1 in zip(lw0.experts, lw1.experts, strict=True) if e0]
    names = [n for n in ("router", "router_logit_bias") if n in lw0.params]
    rows.append(sums([lw0.params[n] for n in names], [lw1.params[n] for n in names]))
    if gain:
        rows.append(sums([lw0.params["post_norm"]], [lw1.params["post_norm"]]))
    host = to_host(torch.stack(rows), device).tolist()
    changes = [rel(num, den) for num, den in host]
    if not gain:
        *experts, router = changes
        no_gain = {"gain_drift": None, "reason": "no pre-norm gain (post-norm family)"}
        return {"expert_relative_change": experts, "router_drift": router, **no_gain}
    *experts, router, gain_drift = changes
    return {"expert_relative_change": experts, "router_drift": router, "gain_drift": gain_drift}


def bootstrap_for(settings: ReceiptSettings, num_windows: int, layer: int) -> WindowBootstrap:
    # the same windows as the layer's state receipts (receipts/observer.py), so that pair and state
    # replicates are paired draws (judge/margins.py)
    return WindowBootstrap(num_windows, settings.bootstrap, settings.seed * 1_000_003 + layer)
