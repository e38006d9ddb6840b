"""Lara-Mini (``lara_mini``, translated Lara 4 Mini): a hybrid of Qwen3.5's gated DeltaNet
(``linear_attention`` layers, :mod:`moeaudit.replay.deltanet`) and Qwen3 attention (per-head q/k
RMSNorm, no output gate) with RoPE only on the ``sliding_attention`` layers (the
``full_attention`` ones have none: ``nope_layers``); plain RMSNorms (gain w, not Qwen3-Next's
1 + w). Every layer routed: a float32 softmax router (top-k of the probabilities, renormalised
when ``norm_topk_prob``) plus an ungated shared expert added in full. The released checkpoints
store the DeltaNet's input projections as one ``in_proj`` (rows q|k|v|z|b|a, canonical
``lin_in``, split as transformers' conversion mapping splits it) and its gated norm as
``out_norm``."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, all_layers, attention_by_type, sliding_window
from moeaudit.families.qwen3_next import DELTANET, deltanet_layers, linear_attention
from moeaudit.spec.blocks import Layer
from moeaudit.spec.config import ModelSpec
from moeaudit.spec.layouts import ATTN, MLP_MOE, hf_layout
from moeaudit.spec.settings import AttentionVariant

KINDS = ("linear_attention", "sliding_attention", "full_attention")
PATTERN = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")


def _layer_types(c: Ctx) -> list[str]:
    """``layer_types``, else LaraMiniConfig's released pattern of period 5."""
    types = c.cfg.get("layer_types")
    if types is None:
        return [PATTERN[i % len(PATTERN)] for i in range(c.num_layers)]
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= set(KINDS):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} layers, each one of {' / '.join(KINDS)}", path=c.path
        )
    return types


def _fields(c: Ctx) -> dict[str, Any]:
    types = _layer_types(c)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = sliding_window(c) if "sliding_window" in c.cfg else 512
    if sliding and window is None:
        raise CheckpointError("config.json: layer_types name sliding layers but sliding_window is null", path=c.path)
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "qk_norm": "head",
        "shared_dim": c.get("shared_expert_intermediate_size", int, 512),
        "shared_gated": False,
        # RoPE on sliding layers only
        **attention_by_type(
            types,
            {"sliding_attention": AttentionVariant(window=window), "full_attention": AttentionVariant(rope=False)},
        ),
        "linear_attention": linear_attention(c, 8, 16),  # LaraMiniConfig's defaults
        "tie_embeddings": bool(c.get("tie_word_embeddings", bool, True)),
    }


def _layers(c: Ctx, s: ModelSpec) -> tuple[Layer, ...]:
    """Gated DeltaNet on the ``linear_attention`` layers; attention on the others, windowed with
    RoPE on the ``sliding_attention`` ones, full without RoPE on the ``full_attention`` ones
    (``sliding_layers``, ``nope_layers``)."""
    return deltanet_layers(s, _layer_types(c), ("sliding_attention", "full_attention"))


LAYOUT = hf_layout(
    "lara_mini",
    {
        **ATTN,
        **MLP_MOE,
        **DELTANET,
        "lin_in": "linear_attn.in_proj.weight",
        "lin_norm": ("linear_attn.out_norm.weight", "linear_attn.norm.weight"),
        "shared_w1": "mlp.shared_expert.gate_proj.weight",
        "shared_w3": "mlp.shared_expert.up_proj.weight",
        "shared_w2": "mlp.shared_expert.down_proj.weight",
    },
    notes="hybrid: Qwen3.5 gated DeltaNet (one fused in_proj, rows q|k|v|z|b|a) and Qwen3 attention with RoPE on "
    "sliding layers only; plain norms; softmax router, renormalised; ungated shared expert; every layer routed",
)

FAMILY = Family(
    name="lara_mini",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts",),
    default_rms_eps=1e-6,
    layers=_layers,
)
