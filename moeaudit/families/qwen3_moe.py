"""Qwen3-MoE: per-head q_norm/k_norm, ``norm_topk_prob``, Qwen's sparse-step rule, a sliding
window on every layer when ``use_sliding_window``."""

from __future__ import annotations

from typing import Any

from moeaudit.families.base import Ctx, Family, sliding_window, sparse_step_layers, windowed_all
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, hf_layout


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": sparse_step_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, False)),
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 0),
        **windowed_all(c, sliding_window(c, "use_sliding_window")),
    }


LAYOUT = hf_layout(
    "qwen3_moe",
    {
        **ATTN,
        **MLP_MOE,
        **DENSE_MLP,
    },
    notes="per-head q_norm/k_norm; norm_topk_prob",
)

FAMILY = Family(name="qwen3_moe", layout=LAYOUT, fields=_fields, expert_count_keys=("num_experts", "num_local_experts"))
