"""Hy3 (``hy_v3``, Tencent Hy3-preview): per-head q/k RMSNorm before RoPE (Qwen3's), optional bias on
all four projections; ``mlp_layer_types`` places dense and routed layers (default: the first
dense); a float32 sigmoid router whose top-k is chosen on σ(W_r y) + the block's
``e_score_correction_bias`` (no groups), the chosen σ renormalised and scaled by
``router_scaling_factor``; ``num_shared_experts`` ungated shared experts. The checkpoints (and
transformers' save_pretrained) use the original names ``mlp.router.gate``, ``mlp.expert_bias``,
``mlp.shared_mlp``; transformers' module names are accepted too."""

from __future__ import annotations

from typing import Any

from moeaudit.families.base import Ctx, Family, mlp_layer_types
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, hf_layout


def _fields(c: Ctx) -> dict[str, Any]:
    shared = c.get("num_shared_experts", int, 1) * c.get("moe_intermediate_size", int)
    return {
        "routed_layers": mlp_layer_types(c, 1),
        "norm_topk_prob": True,
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 13312),
        # HYV3MLP(intermediate_size=0) falls back to intermediate_size (``or``), as here
        "shared_dim": shared or c.get("intermediate_size", int, 13312),
        "shared_gated": False,
        "gate": Gate(scoring="sigmoid", selection_bias=True, scaling=c.get("router_scaling_factor", float, 2.826)),
    }


LAYOUT = hf_layout(
    "hy_v3",
    {
        **ATTN,
        "router": ("mlp.router.gate.weight", "mlp.gate.weight"),
        "router_bias": ("mlp.expert_bias", "mlp.e_score_correction_bias"),
        "shared_w1": ("mlp.shared_mlp.gate_proj.weight", "mlp.shared_experts.gate_proj.weight"),
        "shared_w3": ("mlp.shared_mlp.up_proj.weight", "mlp.shared_experts.up_proj.weight"),
        "shared_w2": ("mlp.shared_mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight"),
        **DENSE_MLP,
    },
    notes="per-head q/k norm before RoPE; sigmoid router with a selection bias, renormalised and "
    "scaled; shared experts; mlp_layer_types dense/sparse placement",
)

FAMILY = Family(
    name="hy_v3",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts", "num_local_experts"),
    default_rms_eps=1e-5,
    default_rope_theta=11_158_840.0,
)
