"""FlexOlmo (``flex_olmo``): OLMo-2 post-norm layers around OLMoE's MoE. No RMSNorm precedes
attention or the MoE block (``LayerSettings.pre_norm`` false): each reads the residual stream itself,
so the router's input is y = h (docs/decisions.md); the attention output passes an RMSNorm
(``post_attention_layernorm``, ``attn_out_norm``) and so does the MoE output
(``post_feedforward_layernorm``, ``moe_out_norm``, through A.X-K1's backward) before the residual
add. q_norm / k_norm over all heads (before the head split, as OLMoE's); softmax router, top-k,
``norm_topk_prob`` (default false); every layer routed, no shared expert."""

from __future__ import annotations

from typing import Any

from moeaudit.families.base import Ctx, Family, all_layers
from moeaudit.spec.layouts import ATTN, MLP_MOE, hf_layout


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, False)),
        "qk_norm": "full",
        "pre_norm": False,
        "attn_out_norm": True,
        "moe_out_norm": True,
    }


_ATTN = {k: v for k, v in ATTN.items() if k not in ("input_norm", "post_norm")}

LAYOUT = hf_layout(
    "flex_olmo",
    {
        **_ATTN,
        "attn_out_norm": "post_attention_layernorm.weight",
        "moe_out_norm": "post_feedforward_layernorm.weight",
        **MLP_MOE,
    },
    notes="OLMo-2 post-norms (no norm before attention or the MoE block; the attention and MoE outputs normed "
    "before the residual add; the router reads the residual stream); q_norm/k_norm over all heads; "
    "norm_topk_prob (default false)",
)

FAMILY = Family(
    name="flex_olmo",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts", "num_local_experts"),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-6,
    default_rope_theta=500000.0,
)
