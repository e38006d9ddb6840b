"""DeepSeek-V2: MLA attention (RoPE on complex pairs: interleaved, always), softmax scores,
greedy or group-limited top-k (group max), never renormalised in transformers' router, shared
experts, ``first_k_dense_replace`` dense layers."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import (
    TORCHTITAN_MLA,
    Ctx,
    Family,
    Refuse,
    first_k_dense,
    grouped_gate,
    mtp_count,
    parse_mla,
    sliding_window,
    windowed_all,
)
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import DEEPSEEK_LAYER, hf_layout


def v2_gate(c: Ctx, method: str) -> Gate:
    """DeepSeek-V2's gate: softmax scores, greedy top-k or (``topk_method``
    "group_limited_greedy") the best ``topk_group`` of ``n_group`` groups by their best expert."""
    return grouped_gate(
        c,
        scoring="softmax",
        selection_bias=False,
        grouped=method == "group_limited_greedy",
        n_group=1,
        topk_group=1,
        group_score="max",
        scaling=1.0,
    )


def _fields(c: Ctx) -> dict[str, Any]:
    method = c.get("topk_method", str, "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):  # noaux_tc: greedy here
        raise CheckpointError(
            f"config.json: topk_method {method!r} is not supported",
            path=c.path,
            hint="supported: greedy, group_limited_greedy (V2), noaux_tc (V3)",
        )
    return {
        "routed_layers": first_k_dense(c, 0),
        "norm_topk_prob": False,  # transformers' V2 router has no such step, whatever the config says
        "dense_dim": c.get("intermediate_size", int, 0),
        "shared_dim": c.get("n_shared_experts", int, 2) * c.get("moe_intermediate_size", int),
        **windowed_all(c, sliding_window(c)),
        "gate": v2_gate(c, method),
        "shared_gated": False,
        "mtp_layers": mtp_count(c, 0),
    }


LAYOUT = hf_layout(
    "deepseek_v2",
    {k: v for k, v in DEEPSEEK_LAYER.items() if k != "router_bias"},
    notes="MLA attention; softmax scores, greedy or group-limited top-k (group max); "
    "shared experts; first_k_dense_replace dense layers",
)

# ``mlp_bias`` is refused for every family (base.REFUSED_EVERYWHERE); DeepSeek's reference code
# renormalises the top-k when norm_topk_prob is true, transformers' DeepseekV2 never does: the
# replay follows transformers, so a true value, whose meaning the two disagree on, is refused
REFUSE = (
    Refuse("norm_topk_prob", (False,), "renormalised top-k weights, which transformers' DeepseekV2 does not apply"),
    Refuse("scoring_func", ("softmax",), "the router's scoring function"),
    Refuse("moe_layer_freq", (1,), "MoE layers only every moe_layer_freq-th layer"),
)

FAMILY = Family(
    name="deepseek_v2",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_experts", "num_local_experts"),
    mla=lambda c: parse_mla(c, always_interleave=True),
    torchtitan=TORCHTITAN_MLA,
    refuse=REFUSE,
)
