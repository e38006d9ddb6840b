"""Command A MoE (``cohere2_moe``): Cohere's parallel block — one input norm (RMSNorm when
``rms_norm_eps`` is set, else a LayerNorm without bias), attention and the MLP/MoE both read it,
and both outputs join the residual: x + attn(n(x)) + moe(n(x)). RoPE on adjacent pairs
(``repeat_interleave`` tables) on the sliding layers and on the dense prefix layers when
``prefix_dense_sliding_window_pattern`` is 1; the other global layers have no RoPE. Router: the
top-k of the logits, combine weights a softmax over those k (or their sigmoids, renormalised with
``norm_topk_prob``). Shared experts (``num_shared_experts`` × ``intermediate_size``, ungated)
added ("sum") or averaged with the routed output ("average": both halved). Logits × ``logit_scale``;
embeddings tied by default."""

from __future__ import annotations

import math
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, attention_by_layer, sliding_window
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, SHARED_EXPERTS, hf_layout
from moeaudit.spec.settings import AttentionVariant


def _choice(c: Ctx, key: str, allowed: tuple[str, ...], default: str) -> str:
    value = c.cfg.get(key)
    if value is None:
        return default
    if value not in allowed:
        raise CheckpointError(
            f"config.json: {key} must be {' or '.join(map(repr, allowed))}, got {value!r}", path=c.path
        )
    return str(value)


def _typed(c: Ctx, key: str, kinds: tuple[str, ...], default: list[str]) -> list[str]:
    types = c.cfg.get(key)
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != c.num_layers or not all(t in kinds for t in types):
        raise CheckpointError(
            f"config.json: {key} must list {c.num_layers} layers, each {' or '.join(map(repr, kinds))}", path=c.path
        )
    return types


def _positive(c: Ctx, key: str, default: int) -> int:
    value = c.get(key, int, default)
    if value < 1:
        raise CheckpointError(f"config.json: {key} must be ≥ 1, got {value}", path=c.path)
    return int(value)


def _fields(c: Ctx) -> dict[str, Any]:
    # Cohere2MoeConfig.__post_init__: first_k_dense_replace (an init argument, not saved) makes
    # the prefix dense with its own window pattern; save_pretrained writes the resulting lists
    dense_k = min(c.get("first_k_dense_replace", int, 0), c.num_layers)
    prefix_pattern = _positive(c, "prefix_dense_sliding_window_pattern", 1)
    pattern = _positive(c, "sliding_window_pattern", 4)
    types = _typed(
        c,
        "layer_types",
        ("sliding_attention", "full_attention"),
        ["sliding_attention" if (i + 1) % prefix_pattern else "full_attention" for i in range(dense_k)]
        + ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(c.num_layers - dense_k)],
    )
    mlp = _typed(
        c, "mlp_layer_types", ("dense", "sparse"), ["dense" if i < dense_k else "sparse" for i in range(c.num_layers)]
    )
    window = sliding_window(c)
    # Cohere2MoeAttention: a layer is windowed — and rotated — when it is a sliding layer and the
    # config has a window; a dense layer is also rotated when the prefix pattern is 1
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window is not None else ()
    forced = {i for i, t in enumerate(mlp) if t == "dense" and prefix_pattern == 1}
    selection = _choice(c, "expert_selection_fn", ("softmax", "sigmoid"), "softmax")
    combination = _choice(c, "shared_expert_combination_strategy", ("sum", "average"), "average")
    shared = c.get("num_shared_experts", int, 0) * c.get("intermediate_size", int)
    average = bool(shared) and combination == "average"
    scale = c.get("logit_scale", float, 0.0625)
    if not (math.isfinite(scale) and scale > 0):
        raise CheckpointError(f"config.json: logit_scale must be a positive number, got {scale!r}", path=c.path)
    layer_norm = c.cfg.get("rms_norm_eps") is None  # Cohere2MoeLayerNorm (no bias) unless RMSNorm is asked for
    return {
        "routed_layers": tuple(i for i, t in enumerate(mlp) if t == "sparse"),
        "head_dim": c.get("head_dim", int, 128),
        # softmax over the chosen logits = the renormalised top-k of the full softmax
        "norm_topk_prob": selection == "softmax" or bool(c.get("norm_topk_prob", bool, True)),
        "gate": Gate(scoring=selection, scaling=0.5 if average else 1.0),
        "shared_dim": shared,
        "shared_gated": False,
        "shared_scale": 0.5 if average else 1.0,
        "dense_dim": c.get("prefix_dense_intermediate_size", int, None) or c.get("intermediate_size", int),
        **attention_by_layer(
            [
                AttentionVariant(window=window) if i in sliding else AttentionVariant(rope=i in forced)
                for i in range(c.num_layers)
            ]
        ),
        "rope_interleaved": True,
        "parallel_block": True,
        "layer_norm": layer_norm,
        "norm_bias": not layer_norm,
        "rms_eps": c.get("layer_norm_eps", float, 1e-5) if layer_norm else c.get("rms_norm_eps", float),
        "logits_scaling": 1.0 / scale,  # transformers multiplies by logit_scale
        "tie_embeddings": bool(c.get("tie_word_embeddings", bool, True)),
    }


LAYOUT = hf_layout(
    "cohere2_moe",
    {
        **ATTN,
        # one norm feeds attention and the MLP/MoE: the MoE block's gain is that norm's weight
        "post_norm": "input_layernorm.weight",
        **MLP_MOE,
        **SHARED_EXPERTS,
        **DENSE_MLP,
    },
    notes="parallel attention + MoE on one input norm; interleaved RoPE on sliding layers, NoPE global "
    "layers; top-k of the logits, softmax (or sigmoid) over them; shared experts summed or averaged; "
    "logit_scale",
)

FAMILY = Family(
    name="cohere2_moe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts",),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-5,
)
