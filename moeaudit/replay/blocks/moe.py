"""The MoE block (``spec.blocks.MoE``): its norm, router, experts and shared expert, and the taps the
receipts read (docs/glossary.md, "Taps")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.replay.blocks.experts import (
    experts_forward_sets,
    input_scales,
)
from moeaudit.replay.blocks.mlp import mlp
from moeaudit.replay.blocks.norms import block_norm
from moeaudit.replay.blocks.router import (
    Routing,
    route,
)
from moeaudit.spec.blocks import MoE, Residual
from moeaudit.spec.config import ModelSpec

ExtraExperts = Callable[[int, Routing], dict[str, torch.Tensor]]  # (layer, routing) → sets


@dataclass
class MoETap:
    """Per-layer taps (docs/glossary.md, "Taps") for the N canary tokens."""

    layer: int
    h_NH: torch.Tensor  # residual stream entering the MoE block
    y_NH: torch.Tensor  # post-gain gate input γ ⊙ z (h itself without a pre-norm: ``Residual.pre_norm``)
    routing: Routing
    u_NKH: torch.Tensor  # raw expert outputs for the active set
    extra_u: dict[str, torch.Tensor] = field(default_factory=dict)  # outputs observers asked for

    @property
    def r_N(self) -> torch.Tensor:
        return self._h_centred().pow(2).mean(-1).add(self._eps).sqrt()

    _eps: float = 0.0
    _centred: bool = False  # LayerNorm (Phi-3.5-MoE): the norm subtracts the mean first

    def _h_centred(self) -> torch.Tensor:
        return self.h_NH - self.h_NH.mean(-1, keepdim=True) if self._centred else self.h_NH

    @property
    def z_NH(self) -> torch.Tensor:
        """Pre-gain normalised state, ‖z‖² ≈ H (LayerNorm: also mean 0)."""
        return self._h_centred() / self.r_N[:, None]


def moe_router(spec: ModelSpec, lw: LayerWeights, h_NH: torch.Tensor) -> tuple[torch.Tensor, Routing]:
    """(y = γ ⊙ z, routing) of the MoE block for the residual h entering it; without a pre-norm
    (``Residual.pre_norm`` false, OLMo-2 post-norm layers) the router and experts read h itself: y = h."""
    residual = spec.layers[lw.layer].residual
    if not residual.pre_norm:
        return h_NH, route_layer(spec, lw.params, h_NH)
    w, b = mlp_norm(residual)
    y_NH = block_norm(spec, h_NH, lw.params[w], lw.params.get(b))
    return y_NH, route_layer(spec, lw.params, y_NH)


def mlp_norm(residual: Residual) -> tuple[str, str]:
    """The norm (gain, bias) in front of the MLP / MoE block: ``post_norm``, or with a parallel
    block (Cohere) the one norm both branches read, ``input_norm`` (so that its gradient
    gathers both branches', as transformers' single norm parameter does), or a single-block
    layer's only norm (Nemotron-H)."""
    single = residual.parallel or residual.single_block
    return ("input_norm", "input_norm_bias") if single else ("post_norm", "post_norm_bias")


def route_layer(spec: ModelSpec, p: dict[str, torch.Tensor], y_NH: torch.Tensor) -> Routing:
    """:func:`route` with a layer's router tensors (weight, selection bias, logit bias)."""
    return route(spec, p["router"], y_NH, p.get("router_bias"), p.get("router_logit_bias"))


def shared_expert(spec: ModelSpec, p: dict[str, torch.Tensor], y_NH: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """The always-on expert: behind a sigmoid gate (Qwen2-MoE) or not (DeepSeek, whose
    ``n_shared_experts`` are stored as one MLP of their summed width); ``layer``: for a clamp
    per layer (Step 3.5, :func:`mlp`; -1: the first routed layer's shared expert)."""
    ffn = spec.layers[layer if layer >= 0 else spec.routed_layers[0]].ffn
    assert isinstance(ffn, MoE) and ffn.shared is not None
    shared = ffn.shared
    if shared.clamp:  # DeepSeek-V4: silu(min(gate, limit)) ⊙ clamp(up, ±limit), as DeepseekV4MLP
        limit = shared.clamp
        gate = F.linear(y_NH, p["shared_w1"]).clamp(max=limit)
        out = F.linear(F.silu(gate) * F.linear(y_NH, p["shared_w3"]).clamp(-limit, limit), p["shared_w2"])
    else:
        out = mlp(spec, p, "shared_", y_NH, layer)
    if shared.gated:
        out = torch.sigmoid(F.linear(y_NH, p["shared_gate"])) * out
    return out if shared.scale == 1.0 else out * shared.scale


def moe_block(
    spec: ModelSpec,
    lw: LayerWeights,
    h_BTH: torch.Tensor,
    extra: ExtraExperts | None = None,
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, MoETap]:
    """The MoE block; ``extra(layer, routing)`` names more expert-index sets [N, X] whose
    outputs observers need (overlap receipts): they are computed in the same sweep over the
    experts, so each expert is converted once, and handed over in ``tap.extra_u``."""
    B, T, H = h_BTH.shape
    h_NH = h_BTH.reshape(-1, H)
    y_NH, routing = moe_router(spec, lw, h_NH)
    wanted = extra(lw.layer, routing) if extra is not None else {}
    sets = [routing.topk_NK, *wanted.values()]
    u_NKH, *more = experts_forward_sets(
        lw.experts, y_NH, sets, spec.expert_glu(lw.layer), input_scales(spec, routing, sets), keep=keep
    )
    out_NH = (u_NKH * routing.combine_NK.to(u_NKH.dtype)[..., None]).sum(1)
    if spec.shared_dim:
        out_NH = out_NH + shared_expert(spec, lw.params, y_NH, lw.layer)
    if cast(MoE, spec.layers[lw.layer].ffn).out_bias:  # JetMoE: a bias on the block's output
        out_NH = out_NH + lw.params["moe_bias"]
    tap = MoETap(
        lw.layer,
        h_NH,
        y_NH,
        routing,
        u_NKH,
        dict(zip(wanted, more, strict=True)),
        _eps=spec.rms_eps,
        _centred=spec.layer_norm,
    )
    return out_NH.view(B, T, H), tap
