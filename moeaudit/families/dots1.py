"""dots.llm1 (``dots1``): Qwen3-style attention (per-head q/k RMSNorm, optional bias on all four
projections), DeepSeek-V3's router (sigmoid scores, ``e_score_correction_bias`` for selection
only, group-limited top-k on top-2 sums, optional renormalisation, × ``routed_scaling_factor``),
shared experts, ``first_k_dense_replace`` dense layers, a sliding window on its ``layer_types``
layers (without them, transformers' rule: the layers from ``max_window_layers`` on)."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import (
    TORCHTITAN_SHARED_EXPERTS,
    Ctx,
    Family,
    attention_by_layer,
    first_k_dense,
    sliding_window,
    v3_gate,
)
from moeaudit.spec.layouts import ATTN, DENSE_MLP, V3_MOE, hf_layout
from moeaudit.spec.settings import AttentionVariant


def _sliding_layers(c: Ctx, window: int | None) -> tuple[int, ...]:
    if window is None:
        return ()
    types = c.cfg.get("layer_types")
    if types is None:  # Dots1Config.__post_init__
        from_layer = c.get("max_window_layers", int, 62)
        return tuple(i for i in range(c.num_layers) if i >= from_layer)
    if not isinstance(types, list) or len(types) != c.num_layers:
        raise CheckpointError(f"config.json: layer_types must list {c.num_layers} layers", path=c.path)
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _fields(c: Ctx) -> dict[str, Any]:
    window = sliding_window(c)
    layers = _sliding_layers(c, window)
    return {
        "routed_layers": first_k_dense(c, 0),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, False)),
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 0),
        "shared_dim": (c.get("n_shared_experts", int, None) or 0) * c.get("moe_intermediate_size", int),
        "shared_gated": False,
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=1.0),
        **attention_by_layer([AttentionVariant(window=window if i in layers else None) for i in range(c.num_layers)]),
    }


LAYOUT = hf_layout(
    "dots1",
    {
        **ATTN,
        **V3_MOE,
        **DENSE_MLP,
    },
    notes="per-head qk norm; sigmoid router with selection bias and group-limited top-k; shared "
    "experts; first_k_dense_replace dense layers; layer_types sliding window",
)

FAMILY = Family(
    name="dots1",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    default_rms_eps=1e-6,
    torchtitan=TORCHTITAN_SHARED_EXPERTS,
)
