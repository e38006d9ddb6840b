"""Mixtral: softmax over all experts, top-k always renormalised; ``block_sparse_moe`` (v4) or
``mlp`` (v5) names; a sliding window on every layer when set."""

from __future__ import annotations

from typing import Any

from moeaudit.families.base import Ctx, Family, all_layers, sliding_window, windowed_all
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed


def _fields(c: Ctx) -> dict[str, Any]:
    return {"routed_layers": all_layers(c), "norm_topk_prob": True, **windowed_all(c, sliding_window(c))}


LAYOUT = Layout(
    family="mixtral",
    globals=GLOBALS,
    layer=prefixed(L, {**ATTN, "router": ("block_sparse_moe.gate.weight", "mlp.gate.weight")}),
    expert=prefixed(
        L,
        {
            "w1": ("block_sparse_moe.experts.{expert}.w1.weight", "mlp.experts.{expert}.w1.weight"),
            "w3": ("block_sparse_moe.experts.{expert}.w3.weight", "mlp.experts.{expert}.w3.weight"),
            "w2": ("block_sparse_moe.experts.{expert}.w2.weight", "mlp.experts.{expert}.w2.weight"),
        },
    ),
    fused=prefixed(
        L,
        {
            "gate_up": ("mlp.experts.gate_up_proj", "block_sparse_moe.experts.gate_up_proj"),
            "down": ("mlp.experts.down_proj", "block_sparse_moe.experts.down_proj"),
        },
    ),
    notes="softmax over all experts, top-k renormalised",
)

FAMILY = Family(
    name="mixtral",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts", "num_experts"),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-5,
    default_rope_theta=1e6,
)
