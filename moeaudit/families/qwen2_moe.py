"""Qwen2-MoE: q/k/v bias (``qkv_bias``, no o_proj bias), a shared expert behind a sigmoid
gate, ``decoder_sparse_step``/``mlp_only_layers``, sliding window on ``layer_types`` layers."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, attention_by_layer, sliding_window, sparse_step_layers
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, hf_layout
from moeaudit.spec.settings import AttentionVariant


def _sliding_layers(c: Ctx, window: int | None) -> tuple[int, ...]:
    """Only the ``layer_types`` sliding layers; a config without them gets transformers v5's
    rule: every other layer, starting with the first, below ``max_window_layers``."""
    if window is None:
        return ()
    types = c.cfg.get("layer_types")
    if types is None:
        below = c.get("max_window_layers", int, 28)
        return tuple(i for i in range(c.num_layers) if i % 2 == 0 and i < below)
    if not isinstance(types, list) or len(types) != c.num_layers:
        raise CheckpointError(f"config.json: layer_types must list {c.num_layers} layers", path=c.path)
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _fields(c: Ctx) -> dict[str, Any]:
    window = sliding_window(c, "use_sliding_window")
    sliding = _sliding_layers(c, window)
    return {
        "routed_layers": sparse_step_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, False)),
        "attention_bias": bool(c.cfg.get("qkv_bias", True)),
        "o_bias": False,
        "dense_dim": c.get("intermediate_size", int, 0),
        "shared_dim": c.get("shared_expert_intermediate_size", int, 0),
        **attention_by_layer([AttentionVariant(window=window if i in sliding else None) for i in range(c.num_layers)]),
        "shared_gated": True,
    }


LAYOUT = hf_layout(
    "qwen2_moe",
    {
        **ATTN,
        **MLP_MOE,
        "shared_w1": "mlp.shared_expert.gate_proj.weight",
        "shared_w3": "mlp.shared_expert.up_proj.weight",
        "shared_w2": "mlp.shared_expert.down_proj.weight",
        "shared_gate": "mlp.shared_expert_gate.weight",
        **DENSE_MLP,
    },
    notes="qkv bias; shared expert with sigmoid gate; decoder_sparse_step, mlp_only_layers",
)

FAMILY = Family(name="qwen2_moe", layout=LAYOUT, fields=_fields, expert_count_keys=("num_experts",))
