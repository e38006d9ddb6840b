"""Hunyuan-MoE v1 (``hunyuan_v1_moe``): per-head q/k RMSNorm applied AFTER RoPE
(``query_layernorm``/``key_layernorm``), optional bias on all four projections, softmax top-k
renormalised (``moe_topk``), a float32 router ``gate.wg``, an ungated shared MLP of
``intermediate_size`` beside the routed experts (which have the same size), every layer routed.
Per-layer lists for ``num_experts``/``moe_topk`` (some hub configs) are refused by the common
integer check; transformers' own class takes one value for all layers."""

from __future__ import annotations

from typing import Any

from moeaudit.families.base import Ctx, Family, Refuse, all_layers
from moeaudit.spec.layouts import ATTN, hf_layout


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": True,
        "qk_norm": "head_after_rope",
        "shared_dim": c.get("intermediate_size", int),
        "shared_gated": False,
    }


LAYOUT = hf_layout(
    "hunyuan_v1_moe",
    {
        **ATTN,
        "q_norm": "self_attn.query_layernorm.weight",
        "k_norm": "self_attn.key_layernorm.weight",
        "router": "mlp.gate.wg.weight",
        "shared_w1": "mlp.shared_mlp.gate_proj.weight",
        "shared_w3": "mlp.shared_mlp.up_proj.weight",
        "shared_w2": "mlp.shared_mlp.down_proj.weight",
    },
    notes="per-head q/k norm after RoPE; softmax top-k renormalised; ungated shared MLP",
)

FAMILY = Family(
    name="hunyuan_v1_moe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts", "num_local_experts"),
    expert_dim_key="intermediate_size",
    top_k_key="moe_topk",
    default_rms_eps=1e-5,
    # keys of the released configs (Tencent's code reads them; transformers' class builds the
    # released values): cross-layer attention, the shared MLP, the q/k norms, RoPE
    refuse=(
        Refuse("use_cla", (False,), "cross-layer attention"),
        Refuse("use_mixed_mlp_moe", (True,), "the shared MLP beside the experts"),
        Refuse("use_qk_norm", (True,), "the q/k RMSNorm after RoPE"),
        Refuse("use_rotary_pos_emb", (True,), "RoPE"),
    ),
)
