"""LFM2-MoE (``lfm2_moe``): a hybrid decoder whose ``conv`` layers mix tokens by LFM2's short
convolution (``replay.shortconv``: in-projection to B | C | x, causal depthwise conv of B ⊙ x,
gated by C, out-projection) and whose ``full_attention`` layers are GQA with per-head q/k RMSNorm
and RoPE; pre-norm (``operator_norm``, ``ffn_norm``), the final norm stored as
``embedding_norm``. The first ``num_dense_layers`` feed-forwards are dense SwiGLU MLPs, the rest
routed: sigmoid scores, top-k on σ + ``expert_bias`` (``use_expert_bias``) or on σ, the chosen σ
divided by (Σ + 1e-6) when ``norm_topk_prob``, × ``routed_scaling_factor``; no shared expert."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, mixing
from moeaudit.spec.blocks import Layer, ShortConv
from moeaudit.spec.config import Gate, ModelSpec
from moeaudit.spec.layouts import Layout, prefixed


def _layer_types(c: Ctx) -> list[str]:
    types = c.cfg.get("layer_types")
    if (
        not isinstance(types, list)
        or len(types) != c.num_layers
        or not all(t in ("conv", "full_attention") for t in types)
    ):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} layers, each 'conv' or 'full_attention', got {types!r}",
            path=c.path,
        )
    return types


def _layers(c: Ctx, s: ModelSpec) -> tuple[Layer, ...]:
    """LFM2's short convolution on the ``conv`` layers, attention on the ``full_attention`` ones."""
    return mixing(s, _layer_types(c), "conv", ShortConv(s.settings.conv_kernel, s.settings.conv_bias))


def _fields(c: Ctx) -> dict[str, Any]:
    _layer_types(c)  # the types' own error before any size's
    kernel = c.get("conv_L_cache", int, 3)
    if kernel < 1:
        raise CheckpointError(f"config.json: conv_L_cache must be ≥ 1, got {kernel}", path=c.path)
    dense = min(c.get("num_dense_layers", int, 2), c.num_layers)
    tie = c.cfg.get("tie_word_embeddings", c.cfg.get("tie_embedding", True))  # the hub's legacy name
    return {
        "routed_layers": tuple(range(dense, c.num_layers)),
        "conv_kernel": kernel,
        "conv_bias": bool(c.get("conv_bias", bool, False)),
        "qk_norm": "head",
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "renorm_eps": 1e-6,  # Lfm2MoeTopKRouter: weights / (Σ weights + 1e-6)
        "gate": Gate(
            scoring="sigmoid",
            selection_bias=bool(c.get("use_expert_bias", bool, True)),
            scaling=c.get("routed_scaling_factor", float, 1.0),
        ),
        "dense_dim": c.get("intermediate_size", int, 0),
        "rms_eps": c.get("norm_eps", float, 1e-5),
        "tie_embeddings": bool(tie) if isinstance(tie, bool) else True,
    }


FF = "model.layers.{layer}.feed_forward."

LAYOUT = Layout(
    family="lfm2_moe",
    globals={
        "embed": ("model.embed_tokens.weight",),
        "final_norm": ("model.embedding_norm.weight",),
        "lm_head": ("lm_head.weight",),
    },
    layer=prefixed(
        "model.layers.{layer}.",
        {
            "input_norm": "operator_norm.weight",
            "post_norm": "ffn_norm.weight",
            "q": "self_attn.q_proj.weight",
            "k": "self_attn.k_proj.weight",
            "v": "self_attn.v_proj.weight",
            "o": "self_attn.out_proj.weight",
            "q_norm": "self_attn.q_layernorm.weight",
            "k_norm": "self_attn.k_layernorm.weight",
            "conv_in": "conv.in_proj.weight",
            "conv_in_bias": "conv.in_proj.bias",
            "conv_w": "conv.conv.weight",
            "conv_bias": "conv.conv.bias",
            "conv_out": "conv.out_proj.weight",
            "conv_out_bias": "conv.out_proj.bias",
            "router": "feed_forward.gate.weight",
            "router_bias": "feed_forward.expert_bias",
            "mlp_w1": "feed_forward.w1.weight",
            "mlp_w3": "feed_forward.w3.weight",
            "mlp_w2": "feed_forward.w2.weight",
        },
    ),
    expert=prefixed(
        FF, {"w1": "experts.{expert}.w1.weight", "w3": "experts.{expert}.w3.weight", "w2": "experts.{expert}.w2.weight"}
    ),
    fused=prefixed(FF, {"gate_up": "experts.gate_up_proj", "down": "experts.down_proj"}),
    notes="short-convolution and attention layers (layer_types); per-head qk norm; sigmoid router with an "
    "optional selection bias, renormalised with +1e-6; dense first layers",
)

FAMILY = Family(
    name="lfm2_moe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts",),
    default_rms_eps=1e-5,
    default_rope_theta=1e6,
    layers=_layers,
)
