"""Checkpoint layouts as data (torchtitan state-dict adapters, OLMo-core key templates).

Each family is a table from our canonical tensor names to the key templates that real
trainers write, with ``{layer}`` and ``{expert}`` placeholders. Where one canonical tensor
has been written under several names (transformers v4 per-expert keys vs. v5 fused keys,
Mixtral's ``block_sparse_moe`` vs. ``mlp``), the alternatives are listed in order and the
checkpoint picks the one its files contain. A new family is a new table plus its real
differences in ``replay/``.

Canonical per-layer names::

    input_norm post_norm            RMSNorm gains before attention / before the MLP
    q k v o  q_bias k_bias v_bias o_bias  q_norm k_norm
    router                          [E, H] gate weight
    w1 w3 w2                        per expert: gate [I, H], up [I, H], down [H, I]
    gate_up down                    fused: [E, 2I, H] (gate rows first), [E, H, I]
    shared_w1 shared_w3 shared_w2 shared_gate    Qwen2-MoE shared expert and its sigmoid gate
    mlp_w1 mlp_w3 mlp_w2            dense MLP of a non-routed layer
    router_bias                     DeepSeek-V3 selection bias ``e_score_correction_bias`` [E]
    q_a q_a_bias q_a_norm q_b       MLA low-rank query (or ``q`` when q_lora_rank is null)
    kv_a kv_a_bias kv_a_norm kv_b   MLA shared kv latent + rope key, its norm, its expansion
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Templates = tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    family: str
    globals: Mapping[str, Templates]
    layer: Mapping[str, Templates]
    expert: Mapping[str, Templates]  # contains {expert}
    fused: Mapping[str, Templates] = field(default_factory=dict)
    notes: str = ""


def _prefixed(prefix: str, table: Mapping[str, str | Templates]) -> dict[str, Templates]:
    out: dict[str, Templates] = {}
    for name, keys in table.items():
        keys = (keys,) if isinstance(keys, str) else keys
        out[name] = tuple(prefix + k for k in keys)
    return out


L = "model.layers.{layer}."

_GLOBALS = {
    "embed": ("model.embed_tokens.weight",),
    "final_norm": ("model.norm.weight",),
    "lm_head": ("lm_head.weight",),
}

_ATTN = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}

# OLMoE / Qwen-MoE naming: mlp.gate + mlp.experts.{e}.{gate,up,down}_proj
_MLP_MOE = {"router": "mlp.gate.weight"}
_MLP_EXPERTS = {
    "w1": "mlp.experts.{expert}.gate_proj.weight",
    "w3": "mlp.experts.{expert}.up_proj.weight",
    "w2": "mlp.experts.{expert}.down_proj.weight",
}
_MLP_FUSED = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}

MIXTRAL = Layout(
    family="mixtral",
    globals=_GLOBALS,
    layer=_prefixed(L, {**_ATTN, "router": ("block_sparse_moe.gate.weight", "mlp.gate.weight")}),
    expert=_prefixed(
        L,
        {
            "w1": ("block_sparse_moe.experts.{expert}.w1.weight", "mlp.experts.{expert}.w1.weight"),
            "w3": ("block_sparse_moe.experts.{expert}.w3.weight", "mlp.experts.{expert}.w3.weight"),
            "w2": ("block_sparse_moe.experts.{expert}.w2.weight", "mlp.experts.{expert}.w2.weight"),
        },
    ),
    fused=_prefixed(
        L,
        {
            "gate_up": ("mlp.experts.gate_up_proj", "block_sparse_moe.experts.gate_up_proj"),
            "down": ("mlp.experts.down_proj", "block_sparse_moe.experts.down_proj"),
        },
    ),
    notes="softmax over all experts, top-k renormalised",
)

OLMOE = Layout(
    family="olmoe",
    globals=_GLOBALS,
    layer=_prefixed(L, {**_ATTN, **_MLP_MOE}),
    expert=_prefixed(L, _MLP_EXPERTS),
    fused=_prefixed(L, _MLP_FUSED),
    notes="q_norm/k_norm over all heads; norm_topk_prob (default false)",
)

QWEN2_MOE = Layout(
    family="qwen2_moe",
    globals=_GLOBALS,
    layer=_prefixed(
        L,
        {
            **_ATTN,
            **_MLP_MOE,
            "shared_w1": "mlp.shared_expert.gate_proj.weight",
            "shared_w3": "mlp.shared_expert.up_proj.weight",
            "shared_w2": "mlp.shared_expert.down_proj.weight",
            "shared_gate": "mlp.shared_expert_gate.weight",
            "mlp_w1": "mlp.gate_proj.weight",
            "mlp_w3": "mlp.up_proj.weight",
            "mlp_w2": "mlp.down_proj.weight",
        },
    ),
    expert=_prefixed(L, _MLP_EXPERTS),
    fused=_prefixed(L, _MLP_FUSED),
    notes="qkv bias; shared expert with sigmoid gate; decoder_sparse_step, mlp_only_layers",
)

QWEN3_MOE = Layout(
    family="qwen3_moe",
    globals=_GLOBALS,
    layer=_prefixed(
        L,
        {
            **_ATTN,
            **_MLP_MOE,
            "mlp_w1": "mlp.gate_proj.weight",
            "mlp_w3": "mlp.up_proj.weight",
            "mlp_w2": "mlp.down_proj.weight",
        },
    ),
    expert=_prefixed(L, _MLP_EXPERTS),
    fused=_prefixed(L, _MLP_FUSED),
    notes="per-head q_norm/k_norm; norm_topk_prob",
)

_DEEPSEEK_LAYER = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "q_a": "self_attn.q_a_proj.weight",
    "q_a_bias": "self_attn.q_a_proj.bias",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b": "self_attn.q_b_proj.weight",
    "kv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_bias": "self_attn.kv_a_proj_with_mqa.bias",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "kv_b": "self_attn.kv_b_proj.weight",
    "o": "self_attn.o_proj.weight",
    "o_bias": "self_attn.o_proj.bias",
    **_MLP_MOE,
    "router_bias": "mlp.gate.e_score_correction_bias",
    "shared_w1": "mlp.shared_experts.gate_proj.weight",
    "shared_w3": "mlp.shared_experts.up_proj.weight",
    "shared_w2": "mlp.shared_experts.down_proj.weight",
    "mlp_w1": "mlp.gate_proj.weight",
    "mlp_w3": "mlp.up_proj.weight",
    "mlp_w2": "mlp.down_proj.weight",
}

DEEPSEEK_V3 = Layout(
    family="deepseek_v3",
    globals=_GLOBALS,
    layer=_prefixed(L, _DEEPSEEK_LAYER),
    expert=_prefixed(L, _MLP_EXPERTS),
    fused=_prefixed(L, _MLP_FUSED),
    notes="MLA attention; sigmoid scores, selection bias, group-limited top-k, scaled combine "
          "weights; shared experts; first_k_dense_replace dense layers; MTP layers left out",
)

DEEPSEEK_V2 = Layout(
    family="deepseek_v2",
    globals=_GLOBALS,
    layer=_prefixed(L, {k: v for k, v in _DEEPSEEK_LAYER.items() if k != "router_bias"}),
    expert=_prefixed(L, _MLP_EXPERTS),
    fused=_prefixed(L, _MLP_FUSED),
    notes="MLA attention; softmax scores, greedy or group-limited top-k (group max); "
          "shared experts; first_k_dense_replace dense layers",
)

FAMILIES: dict[str, Layout] = {
    layout.family: layout
    for layout in (MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V3, DEEPSEEK_V2)
}
