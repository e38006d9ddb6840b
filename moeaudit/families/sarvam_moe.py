"""Sarvam-30B (``sarvam_moe``): transformers builds it as GLM-4.5 (``Glm4MoeForCausalLM``) from its
own configuration class, so the replay is :mod:`glm4_moe`'s with Sarvam's defaults: RoPE on the
whole head (``partial_rotary_factor`` 1, not GLM's 0.5), θ 8e6, per-head q/k RMSNorm on
(``use_qk_norm``), ``routed_scaling_factor`` 2.5, one dense first layer, no MTP module. The
original config's names (``num_experts``, ``num_shared_experts``, ``use_qkv_bias``) are read as
transformers' attribute map reads them, and the checkpoints' original tensor names (which
transformers' save_pretrained writes back) as its conversion mapping reads them: one fused
``attention.query_key_value`` projection [q | k | v] (canonical ``qkv``), ``attention.dense``,
``query_layernorm`` / ``key_layernorm``, ``word_embeddings``, ``mlp.gate.expert_bias``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.families import glm4_moe
from moeaudit.families.base import (
    Ctx,
    Family,
    first_k_dense,
    head_dim,
    mtp_count,
    partial_rotary_dim,
    renamed,
    v3_gate,
)
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_EXPERTS, MLP_FUSED, MLP_MOE, SHARED_EXPERTS, L, Layout, prefixed

# SarvamMoEConfig.attribute_map: the original sarvamai/sarvam-30b names → GLM-4.5's
ALIASES = {
    "num_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts",
    "use_qkv_bias": "attention_bias",
    "num_mtp_layers": "num_nextn_predict_layers",
}


def _canonical(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The config with the original names under GLM-4.5's; both spelt with different values is refused."""
    out = renamed(cfg, path, ALIASES)
    return out


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": first_k_dense(c, 1),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "o_bias": False,
        "qk_norm": "head" if c.get("use_qk_norm", bool, True) else "none",
        "rotary_dim": partial_rotary_dim(
            c, head_dim(c), glm4_moe._partial_rotary_factor(c, 1.0)
        ),  # SarvamMoEConfig: 1.0
        "dense_dim": c.get("intermediate_size", int, 8192),
        "shared_dim": c.get("n_shared_experts", int, 1) * c.get("moe_intermediate_size", int),
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=2.5),
        "mtp_layers": mtp_count(c, 0),
    }


_ORIGINAL: dict[str, str | tuple[str, ...]] = {  # transformers' conversion mapping for sarvam_moe, read backwards
    "input_norm": ATTN["input_norm"],
    "post_norm": ATTN["post_norm"],
    "qkv": "attention.query_key_value.weight",
    "qkv_bias": "attention.query_key_value.bias",
    "o": ("attention.dense.weight", "self_attn.o_proj.weight"),
    "q_norm": ("attention.query_layernorm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attention.key_layernorm.weight", "self_attn.k_norm.weight"),
    **MLP_MOE,
    "router_bias": ("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias"),
    **SHARED_EXPERTS,
    **DENSE_MLP,
}

LAYOUT = Layout(
    family="sarvam_moe",
    globals={**glm4_moe.LAYOUT.globals, "embed": ("model.word_embeddings.weight", "model.embed_tokens.weight")},
    layer=prefixed(L, _ORIGINAL),
    expert=prefixed(L, MLP_EXPERTS),
    fused=prefixed(L, MLP_FUSED),
    notes="GLM-4.5 with a fused query_key_value projection, full rotary, q/k norms; sigmoid router "
    "with selection bias and group-limited top-k; shared experts; first_k_dense_replace dense layers",
)

FAMILY = Family(
    name="sarvam_moe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    default_rms_eps=1e-6,
    default_rope_theta=8e6,
    torchtitan=glm4_moe.FAMILY.torchtitan,
    decoder_config=_canonical,
)
