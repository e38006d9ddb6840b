"""Qwen3-Next: a hybrid decoder. ``layer_types`` (or every ``full_attention_interval``-th
layer) is gated full attention (q_proj emits [query | gate] per head, per-head q/k norms,
partial RoPE, output ⊙ σ(gate)); the others are gated DeltaNet linear attention
(:mod:`moeaudit.replay.deltanet`). Zero-centred RMSNorms (gain 1 + w). MoE as Qwen2-MoE:
softmax top-k (renormalised by default), a sigmoid-gated shared expert, the sparse-step rule.
The MTP module (``mtp.*``) is left out."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import (
    Ctx,
    Family,
    head_dim,
    layer_types,
    partial_rotary_dim,
    sparse_step_layers,
    with_mixers,
)
from moeaudit.spec.blocks import DeltaNet, Layer, per_layer_type
from moeaudit.spec.config import LinearAttention, ModelSpec
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, hf_layout

QWEN_MOE_LAYER = {
    **ATTN,
    **MLP_MOE,
    "shared_w1": "mlp.shared_expert.gate_proj.weight",
    "shared_w3": "mlp.shared_expert.up_proj.weight",
    "shared_w2": "mlp.shared_expert.down_proj.weight",
    "shared_gate": "mlp.shared_expert_gate.weight",
    **DENSE_MLP,
}
DELTANET = {
    "lin_conv": "linear_attn.conv1d.weight",
    "lin_dt_bias": "linear_attn.dt_bias",
    "lin_A_log": "linear_attn.A_log",
    "lin_norm": "linear_attn.norm.weight",
    "lin_out": "linear_attn.out_proj.weight",
}
MTP = {"mtp.": "multi-token-prediction module mtp.*"}


def _partial_rotary(c: Ctx) -> float:
    """A quarter of each head by default (transformers' BC default for these configs)."""
    params = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = factor if factor is not None else c.cfg.get("partial_rotary_factor", 0.25)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {factor!r}", path=c.path)
    return float(factor)


def linear_attention(c: Ctx, k_heads: int = 16, v_heads: int = 32) -> LinearAttention:
    """The gated DeltaNet sizes (``k_heads`` key and ``v_heads`` value heads by default)."""
    la = LinearAttention(
        num_k_heads=c.get("linear_num_key_heads", int, k_heads),
        num_v_heads=c.get("linear_num_value_heads", int, v_heads),
        k_dim=c.get("linear_key_head_dim", int, 128),
        v_dim=c.get("linear_value_head_dim", int, 128),
        conv_kernel=c.get("linear_conv_kernel_dim", int, 4),
    )
    if min(la.num_k_heads, la.k_dim, la.v_dim, la.conv_kernel) < 1 or la.num_v_heads % la.num_k_heads:
        raise CheckpointError(
            "config.json: linear attention needs positive sizes and "
            "linear_num_value_heads divisible by linear_num_key_heads",
            path=c.path,
        )
    return la


def _layer_types(c: Ctx) -> list[str]:
    """``layer_types``, else every ``full_attention_interval``-th layer (default 4) full."""
    every = 4
    if c.cfg.get("layer_types") is None:
        every = c.get("full_attention_interval", int, 4)
        if every < 1:
            raise CheckpointError("config.json: full_attention_interval must be ≥ 1", path=c.path)
    return layer_types(
        c, ("linear_attention", "full_attention"), lambda i: "linear_attention" if (i + 1) % every else "full_attention"
    )


def deltanet_layers(s: ModelSpec, types: list[str], attention: tuple[str, ...]) -> tuple[Layer, ...]:
    """Gated DeltaNet on the ``linear_attention`` layers (its input projections as the layout
    stores them), the spec's attention on the layers of the ``attention`` types."""
    assert s.settings.linear_attention is not None
    layout = s.layout.layer
    projections = "fused" if "lin_in" in layout else "grouped" if "lin_qkvz" in layout else "flat"
    mixers: dict[str, DeltaNet | None] = {"linear_attention": DeltaNet(s.settings.linear_attention, projections)}
    return with_mixers(s, per_layer_type(types, mixers | dict.fromkeys(attention)))


def hybrid_layers(c: Ctx, s: ModelSpec) -> tuple[Layer, ...]:
    """Gated DeltaNet on the ``linear_attention`` layers, gated attention on the ``full_attention`` ones."""
    return deltanet_layers(s, _layer_types(c), ("full_attention",))


def hybrid_fields(c: Ctx) -> dict[str, Any]:
    """What Qwen3-Next and Qwen3.5-MoE's text decoder share."""
    return {
        "qk_norm": "head",
        "shared_dim": c.get("shared_expert_intermediate_size", int, 0),
        "shared_gated": True,
        "norm_offset": 1.0,
        "gated_attention": True,
        "rotary_dim": partial_rotary_dim(c, head_dim(c), _partial_rotary(c)),
        "linear_attention": linear_attention(c),
    }


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        **hybrid_fields(c),
        "routed_layers": sparse_step_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "dense_dim": c.get("intermediate_size", int, 0),
    }


LAYOUT = hf_layout(
    "qwen3_next",
    {
        **QWEN_MOE_LAYER,
        **DELTANET,
        "lin_qkvz": "linear_attn.in_proj_qkvz.weight",
        "lin_ba": "linear_attn.in_proj_ba.weight",
    },
    notes="hybrid: gated DeltaNet and gated full attention (partial RoPE, per-head q/k norms); "
    "zero-centred norms (1 + w); shared expert with sigmoid gate; mtp.* left out",
    left_out=MTP,
)

FAMILY = Family(
    name="qwen3_next", layout=LAYOUT, fields=_fields, expert_count_keys=("num_experts",), layers=hybrid_layers
)
