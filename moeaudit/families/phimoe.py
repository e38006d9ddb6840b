"""Phi-3.5-MoE (``phimoe``): LayerNorm (mean-centred, with a bias) for the block and final
norms, q/k/v/o biases and a bias on the LM head (``attention_bias``, ``lm_head_bias``),
longrope RoPE, a sliding window on every layer when ``sliding_window`` is set, and the
sparsemixer router in evaluation mode: the top-2 of the logits, each with the softmax over
the experts inside a relative band 2ε (``router_jitter_noise``) of its own logit. Experts are
SwiGLU, stored per expert (``block_sparse_moe.experts.{e}.w1/w3/w2``) as ``save_pretrained``
writes them, or fused as transformers v5 holds them. No shared expert, every layer routed.

The sparsemixer's training-time parts (Gumbel sampling of the experts, the Heun third-order
gradient estimate) and ``input_jitter_noise`` are not replayed: the replay is the model in
evaluation mode, as ``model.eval()`` computes it (docs/families.md).
"""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, all_layers, head_dim, sliding_window, windowed_all
from moeaudit.spec.config import Gate, LongRope
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed


def _number(c: Ctx, params: dict[str, Any], key: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"config.json: longrope needs a positive {key!r}, got {value!r}", path=c.path)
    return float(value)


def _longrope(c: Ctx, head_dim: int) -> LongRope | None:
    params = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "longrope":
        return None
    short = params.get("short_factor")
    if (
        not isinstance(short, list)
        or len(short) != head_dim // 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in short)
    ):
        raise CheckpointError(
            f"config.json: longrope short_factor must be {head_dim // 2} positive numbers (one per rotated pair)",
            path=c.path,
        )
    # the first of these present: an explicit 0 is refused below, not skipped
    original = next(
        (
            v
            for v in (
                c.cfg.get("original_max_position_embeddings"),
                params.get("original_max_position_embeddings"),
                c.cfg.get("max_position_embeddings"),
            )
            if v is not None
        ),
        None,
    )
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise CheckpointError(
            f"config.json: longrope needs original_max_position_embeddings, got {original!r}", path=c.path
        )
    return LongRope(
        short_factor=tuple(float(v) for v in short),
        short_mscale=_number(c, params, "short_mscale"),
        long_mscale=_number(c, params, "long_mscale"),
        original_max_positions=float(original),
    )


def _fields(c: Ctx) -> dict[str, Any]:
    if c.top_k != 2:
        raise CheckpointError(
            f"config.json: phimoe's sparsemixer routes exactly 2 experts per token, num_experts_per_tok is {c.top_k}",
            path=c.path,
        )
    eps = c.get("router_jitter_noise", float, 0.01)
    if eps < 0:
        raise CheckpointError(f"config.json: router_jitter_noise must be ≥ 0, got {eps}", path=c.path)
    return {
        "routed_layers": all_layers(c),
        "gate": Gate(scoring="sparsemixer"),
        "sparsemixer_eps": eps,
        "layer_norm": True,
        "lm_head_bias": bool(c.get("lm_head_bias", bool, False)),
        "longrope": _longrope(c, head_dim(c)),
        **windowed_all(c, sliding_window(c)),
    }


LAYOUT = Layout(
    family="phimoe",
    globals={**GLOBALS, "final_norm_bias": ("model.norm.bias",), "lm_head_bias": ("lm_head.bias",)},
    layer=prefixed(
        L,
        {
            **ATTN,
            "input_norm_bias": "input_layernorm.bias",
            "post_norm_bias": "post_attention_layernorm.bias",
            "router": ("block_sparse_moe.gate.weight", "mlp.router.weight"),
        },
    ),
    expert=prefixed(
        L,
        {
            "w1": "block_sparse_moe.experts.{expert}.w1.weight",
            "w3": "block_sparse_moe.experts.{expert}.w3.weight",
            "w2": "block_sparse_moe.experts.{expert}.w2.weight",
        },
    ),
    fused=prefixed(L, {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}),
    notes="LayerNorm with bias, attention and LM-head biases, longrope, sparsemixer top-2 routing",
)

FAMILY = Family(
    name="phimoe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts",),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-5,
    default_rope_theta=1e6,
)
