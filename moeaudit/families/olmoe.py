"""OLMoE: q_norm/k_norm over all heads (before the head split), optional ``clip_qkv``,
``norm_topk_prob`` (default false)."""

from __future__ import annotations

from typing import Any

from moeaudit.families.base import Ctx, Family, all_layers, sliding_window, windowed_all
from moeaudit.spec.layouts import ATTN, MLP_MOE, hf_layout


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, False)),
        "qk_norm": "full",
        "clip_qkv": c.get("clip_qkv", float, None),
        **windowed_all(c, sliding_window(c)),
    }


LAYOUT = hf_layout(
    "olmoe",
    {**ATTN, **MLP_MOE},
    notes="q_norm/k_norm over all heads; norm_topk_prob (default false)",
)

FAMILY = Family(
    name="olmoe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts", "num_local_experts"),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-5,
)
