"""DeepSeek-V3: MLA attention, sigmoid scores with a selection bias
(``e_score_correction_bias``), group-limited top-k (top-2 sum per group), renormalised and
scaled combine weights, shared experts, ``first_k_dense_replace`` dense layers; MTP layers
stored after the decoder are left out."""

from __future__ import annotations

from typing import Any

from moeaudit.families.base import (
    TORCHTITAN_MLA,
    Ctx,
    Family,
    Refuse,
    first_k_dense,
    mtp_count,
    parse_mla,
    sliding_window,
    v3_gate,
    windowed_all,
)
from moeaudit.spec.layouts import DEEPSEEK_LAYER, hf_layout


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": first_k_dense(c, 3),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "dense_dim": c.get("intermediate_size", int, 0),
        "shared_dim": c.get("n_shared_experts", int, 1) * c.get("moe_intermediate_size", int),
        **windowed_all(c, sliding_window(c)),
        "gate": v3_gate(c, n_group=8, topk_group=4, scaling=2.5),
        "shared_gated": False,
        "mtp_layers": mtp_count(c, 1),  # transformers' default
    }


LAYOUT = hf_layout(
    "deepseek_v3",
    DEEPSEEK_LAYER,
    notes="MLA attention; sigmoid scores, selection bias, group-limited top-k, scaled combine "
    "weights; shared experts; first_k_dense_replace dense layers; MTP layers left out",
)

# settings DeepSeek's reference code reads and transformers' class ignores: replayed only at the
# values the replay implements (every released V3-style checkpoint's)
REFUSE = (
    Refuse("scoring_func", ("sigmoid",), "the router's scoring function"),
    Refuse("topk_method", ("noaux_tc",), "the expert selection rule"),
    Refuse("moe_layer_freq", (1,), "MoE layers only every moe_layer_freq-th layer"),
)

FAMILY = Family(
    name="deepseek_v3",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts", "num_experts"),
    mla=parse_mla,
    torchtitan=TORCHTITAN_MLA,
    refuse=REFUSE,
)
