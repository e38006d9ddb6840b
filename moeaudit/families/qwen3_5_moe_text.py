"""Qwen3.5-MoE's text decoder: Qwen3-Next's hybrid with the DeltaNet input in four flat
projections (q|k|v, z, b, a), every layer routed and the top-k always renormalised (the config
has no ``norm_topk_prob``, ``mlp_only_layers`` or ``decoder_sparse_step``). Its multimodal RoPE
is plain RoPE for text (the three position streams are equal)."""

from __future__ import annotations

from typing import Any

from moeaudit.families.base import Ctx, Family, all_layers
from moeaudit.families.qwen3_next import DELTANET, MTP, QWEN_MOE_LAYER, hybrid_fields, hybrid_layers
from moeaudit.spec.layouts import hf_layout

LAYER = {
    **QWEN_MOE_LAYER,
    **DELTANET,
    "lin_qkv": "linear_attn.in_proj_qkv.weight",
    "lin_z": "linear_attn.in_proj_z.weight",
    "lin_b": "linear_attn.in_proj_b.weight",
    "lin_a": "linear_attn.in_proj_a.weight",
}


def fields(c: Ctx) -> dict[str, Any]:
    return {**hybrid_fields(c), "routed_layers": all_layers(c), "norm_topk_prob": True}


LAYOUT = hf_layout(
    "qwen3_5_moe_text",
    LAYER,
    notes="Qwen3-Next's hybrid with flat DeltaNet projections; every layer routed, top-k renormalised; mtp.* left out",
    left_out=MTP,
)

FAMILY = Family(
    name="qwen3_5_moe_text", layout=LAYOUT, fields=fields, expert_count_keys=("num_experts",), layers=hybrid_layers
)
