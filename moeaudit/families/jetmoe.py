"""JetMoE (``jetmoe``): every layer routes twice. Its token mixer is a mixture of attention heads
(``LayerSettings.moa``, :mod:`moeaudit.replay.moa`): one shared kv projection of
``num_key_value_heads`` heads of ``kv_channels`` dims, and per token the top-k of
``num_local_experts`` attention experts, each with its own q and o projections, picked by the
mixer's own router, plus a bias on the mixer's output. Its MLP block is the routed MoE the
receipts audit: ``num_local_experts`` SwiGLU experts of ``intermediate_size`` stored fused
(``input_linear`` [E, 2I, H] with the activated half first, ``output_linear`` [E, H, I]), the
top-k of the router logits with a softmax over those k (the renormalised top-k of the full
softmax), and a bias on the block's output (``moe_bias``). No shared expert, every layer routed.

transformers' forward has ``num_key_value_heads`` × ``num_experts_per_tok`` query heads of
``kv_channels`` dims (its ``num_attention_heads``, derived so by JetMoeConfig, is not read by the
forward; a file's value, which can differ, is ignored here too); it builds the two layer norms with
eps 1e-6 and only the final norm with ``rms_norm_eps`` (``ModelSpec.final_norm_eps``); the
embeddings are tied unless ``tie_word_embeddings`` is false."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, Refuse, all_layers
from moeaudit.spec.layouts import GLOBALS, L, Layout, prefixed

LAYER_NORM_EPS = 1e-6  # JetMoeRMSNorm(hidden_size) for input_layernorm and post_attention_layernorm


def _heads(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The config with the attention sizes of transformers' forward: num_attention_heads = kv
    heads × top-k (each of a token's k attention experts brings kv-heads query heads; JetMoeConfig
    derives it so), head_dim = kv_channels (its ``attribute_map``)."""
    for key in ("num_key_value_heads", "num_experts_per_tok", "kv_channels"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"config.json: {key!r} must be a positive integer, got {value!r}", path=path)
    kv, k = cfg.get("num_key_value_heads") or 16, cfg.get("num_experts_per_tok") or 2
    return {**cfg, "num_key_value_heads": kv, "num_attention_heads": kv * k, "head_dim": cfg.get("kv_channels") or 128}


def _fields(c: Ctx) -> dict[str, Any]:
    final_eps = c.get("rms_norm_eps", float, 1e-6)
    if final_eps < 0:
        raise CheckpointError(f"config.json: rms_norm_eps must be ≥ 0, got {final_eps}", path=c.path)
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": True,
        "moa": True,
        "moe_bias": True,
        "rms_eps": LAYER_NORM_EPS,
        "final_norm_eps": final_eps,
        "tie_embeddings": bool(c.get("tie_word_embeddings", bool, True)),
    }


LAYOUT = Layout(
    family="jetmoe",
    globals=GLOBALS,
    layer=prefixed(
        L,
        {
            "input_norm": "input_layernorm.weight",
            "post_norm": "post_attention_layernorm.weight",
            "moa_router": "self_attention.experts.router.layer.weight",
            "moa_q": "self_attention.experts.input_linear.weight",
            "moa_o": "self_attention.experts.output_linear.weight",
            "moa_bias": "self_attention.experts.bias",
            "kv": "self_attention.kv_proj.weight",
            "router": "mlp.router.layer.weight",
            "moe_bias": "mlp.bias",
        },
    ),
    expert={},
    fused=prefixed(L, {"gate_up": "mlp.input_linear.weight", "down": "mlp.output_linear.weight"}),
    notes="mixture of attention heads (routed q/o projections over a shared kv projection, its own router and "
    "output bias) replayed as the layer's attention; routed SwiGLU experts stored fused, Mixtral routing, a bias "
    "on the MoE output; layer norms at eps 1e-6, the final norm at rms_norm_eps",
)

FAMILY = Family(
    name="jetmoe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts",),
    expert_dim_key="intermediate_size",
    decoder_config=_heads,
    refuse=(Refuse("activation_function", ("silu",), "the experts' activation: the replay's experts are SwiGLU"),),
)
