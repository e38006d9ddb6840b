"""Granite MoE (``granitemoe``): Mixtral's routing (top-k of the router logits, softmax over
those k — the renormalised top-k of the full softmax) with µP-style multipliers: embeddings ×
``embedding_multiplier``, the attention softmax scale ``attention_multiplier`` (instead of
1/√D), each attention and MoE output × ``residual_multiplier`` before its residual add, logits ÷
``logits_scaling``. Experts are stored fused (``input_linear`` [E, 2I, H], gate rows first;
``output_linear`` [E, H, I]); the router is ``router.layer``. No shared expert
(``granitemoeshared`` is another model type), every layer routed."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, all_layers
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed


def _multiplier(c: Ctx, key: str) -> float:
    value = c.get(key, float, 1.0)
    if not value > 0:
        raise CheckpointError(f"config.json: {key} must be positive, got {value!r}", path=c.path)
    return float(value)


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": True,
        "attention_scale": _multiplier(c, "attention_multiplier"),
        "embedding_multiplier": _multiplier(c, "embedding_multiplier"),
        "residual_multiplier": _multiplier(c, "residual_multiplier"),
        "logits_scaling": _multiplier(c, "logits_scaling"),
    }


LAYOUT = Layout(
    family="granitemoe",
    globals=GLOBALS,
    layer=prefixed(L, {**ATTN, "router": ("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight")}),
    expert={},
    fused=prefixed(
        L,
        {
            "gate_up": ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"),
            "down": ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj"),
        },
    ),
    notes="Mixtral routing; embedding, attention, residual and logits multipliers; fused experts",
)

FAMILY = Family(
    name="granitemoe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts", "num_experts"),
    expert_dim_key="intermediate_size",
)
