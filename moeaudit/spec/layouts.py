"""Checkpoint layouts as data (torchtitan state-dict adapters, OLMo-core key templates).

Each family is a table from our canonical tensor names to the key templates that real
trainers write, with ``{layer}`` and ``{expert}`` placeholders. Where one canonical tensor
has been written under several names (transformers v4 per-expert keys vs. v5 fused keys,
Mixtral's ``block_sparse_moe`` vs. ``mlp``), the alternatives are listed in order and the
checkpoint picks the one its files contain. A new family is a new table plus its real
differences in ``replay/``. The tables live in the family files, ``moeaudit/families/``;
this module holds the :class:`Layout` record and the templates several families share.

Canonical per-layer names::

    input_norm post_norm            RMSNorm gains before attention / before the MLP
    q k v o  q_bias k_bias v_bias o_bias  q_norm k_norm
    router                          [E, H] gate weight
    w1 w3 w2                        per expert: gate [I, H], up [I, H], down [H, I]
    gate_up down                    fused: [E, 2I, H] (gate rows first), [E, H, I]; gpt-oss
                                    (``fused_format`` "interleaved"): [E, H, 2I] with gate and
                                    up alternating columns, [E, I, H]
    gate_up_bias down_bias          gpt-oss fused expert biases [E, 2I] (interleaved), [E, H]
    b1 b3 b2                        per expert biases of gate, up, down (gpt-oss)
    sinks                           gpt-oss attention sink logits [heads]
    router_logit_bias               a router bias added to the logits (gpt-oss) [E]
    shared_w1 shared_w3 shared_w2 shared_gate    Qwen2-MoE shared expert and its sigmoid gate
    mlp_w1 mlp_w3 mlp_w2            dense MLP of a non-routed layer
    router_bias                     DeepSeek-V3 selection bias ``e_score_correction_bias`` [E]
    q_a q_a_bias q_a_norm q_b       MLA low-rank query (or ``q`` when q_lora_rank is null)
    kv_a kv_a_bias kv_a_norm kv_b   MLA shared kv latent + rope key, its norm, its expansion
    moa_router moa_q moa_o moa_bias kv   JetMoE's mixture of attention heads: its router [E, H],
                                    expert q [E, X, H] and o [E, H, X], output bias, shared kv [2X, H]
    moe_bias                        a bias on the MoE block's output (JetMoE) [H]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Templates = tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    family: str
    globals: Mapping[str, Templates]
    layer: Mapping[str, Templates]
    expert: Mapping[str, Templates]  # contains {expert}
    fused: Mapping[str, Templates] = field(default_factory=dict)
    # "stacked": gate_up [E, 2I, H] gate rows first, down [E, H, I] (transformers v5, Granite);
    # "interleaved": gate_up [E, H, 2I] with gate/up alternating columns, down [E, I, H] (gpt-oss);
    # "transposed": gate_up [E, H, 2I] with the gate columns first, down [E, I, H] (Llama 4);
    # "interleaved_rows": gate_up [E, 2I, H] with gate/up alternating rows, down [E, H, I]
    # (torchtitan's gpt-oss); "split" (Step 3.5): ``gate_up`` the gates [E, I, H], ``up`` the ups
    # [E, I, H], down [E, H, I]
    fused_format: str = "stacked"
    # a fused template stored in another format than ``fused_format`` (Llama 4's experts as the
    # torchtitan DCP reader fuses them: "stacked" under ``mlp.experts``)
    fused_formats: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""
    # key prefix → what it holds, for tensors recognised and deliberately not replayed (noted,
    # not warned about): an MTP module, a vision encoder
    left_out: Mapping[str, str] = field(default_factory=dict)
    # a per-layer template whose tensor is stored otherwise than canonical, read back as canonical:
    # "transposed" (ERNIE 4.5 VL's router, [H, E]) or "first_row" (the first of its rows: ERNIE
    # 4.5 VL's [2, E] selection bias, text group then vision group)
    stored: Mapping[str, str] = field(default_factory=dict)


def hf_layout(family: str, layer: Mapping[str, str | Templates], **rest: Any) -> Layout:
    """A layout with transformers' usual names: ``GLOBALS``, ``layer`` under ``L``, the experts as
    ``mlp.experts.{e}.*_proj`` (``MLP_EXPERTS``) or fused (``MLP_FUSED``); ``rest`` as ``Layout``'s."""
    return Layout(
        family=family,
        globals=GLOBALS,
        layer=prefixed(L, layer),
        expert=prefixed(L, MLP_EXPERTS),
        fused=prefixed(L, MLP_FUSED),
        **rest,
    )


def prefixed(prefix: str, table: Mapping[str, str | Templates]) -> dict[str, Templates]:
    out: dict[str, Templates] = {}
    for name, keys in table.items():
        keys = (keys,) if isinstance(keys, str) else keys
        out[name] = tuple(prefix + k for k in keys)
    return out


L = "model.layers.{layer}."

GLOBALS = {
    "embed": ("model.embed_tokens.weight",),
    "final_norm": ("model.norm.weight",),
    "lm_head": ("lm_head.weight",),
}

ATTN = {
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
MLP_MOE = {"router": "mlp.gate.weight"}
MLP_EXPERTS = {
    "w1": "mlp.experts.{expert}.gate_proj.weight",
    "w3": "mlp.experts.{expert}.up_proj.weight",
    "w2": "mlp.experts.{expert}.down_proj.weight",
}
MLP_FUSED = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
# DeepSeek naming: the always-on experts as one MLP (``mlp.shared_experts``), a dense layer's MLP
SHARED_EXPERTS = {
    "shared_w1": "mlp.shared_experts.gate_proj.weight",
    "shared_w3": "mlp.shared_experts.up_proj.weight",
    "shared_w2": "mlp.shared_experts.down_proj.weight",
}
DENSE_MLP = {"mlp_w1": "mlp.gate_proj.weight", "mlp_w3": "mlp.up_proj.weight", "mlp_w2": "mlp.down_proj.weight"}
# DeepSeek-V3's MoE block: the router, its selection bias, the shared experts
V3_MOE = {**MLP_MOE, "router_bias": "mlp.gate.e_score_correction_bias", **SHARED_EXPERTS}

DEEPSEEK_LAYER = {
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
    **MLP_MOE,
    "router_bias": "mlp.gate.e_score_correction_bias",
    **SHARED_EXPERTS,
    **DENSE_MLP,
}
