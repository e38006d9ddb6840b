"""Ling 3 (inclusionAI, ``bailing_hybrid``): Kimi Linear's hybrid (:mod:`moeaudit.families.kimi_linear`)
with other mixers. Kimi Delta Attention layers (:mod:`moeaudit.replay.kda`) whose forget and output
gates are full-rank projections, the forget gate bounded by default (``kda_safe_gate``: log α =
``kda_lower_bound`` · σ(exp(A_log) · f), rounded to the activations' dtype; else Kimi's
−exp(A_log) · softplus(f)); KDA heads and head size are ``num_attention_heads`` and the
configured ``head_dim`` (``linear_head_dim`` once saved). Every ``layer_group_size``-th layer is
DeepSeek MLA with interleaved RoPE (θ 6e6 by default) and a per-head sigmoid output gate
(``g_proj``). DeepSeek-V3 routing (group-limited, selection bias, renormalised, × 2.5), ungated
shared experts, ``mlp_layer_types`` / ``first_k_dense_replace`` dense layers, MTP layers stored
after the decoder left out. Tensors are read as ``save_pretrained`` writes them (the released
layout: ``word_embeddings``, ``attention.``, ``attention.dense``, ``gate.expert_bias``, per-expert
MLPs, q/k/v convolutions apart) or under the loaded modules' names, but for the convolution."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, mtp_count, parse_mla, v3_gate
from moeaudit.families.kimi_linear import ALIASES, canonical_config, mla_kda_layers, mla_kda_types, routed_layers
from moeaudit.spec.blocks import Layer
from moeaudit.spec.config import LinearAttention, ModelSpec
from moeaudit.spec.layouts import DEEPSEEK_LAYER, MLP_FUSED, L, Layout, prefixed

# one canonical tensor → its saved (released) name, then the loaded module's name
_KDA = {
    "kda_q": "q_proj.weight",
    "kda_k": "k_proj.weight",
    "kda_v": "v_proj.weight",
    "kda_f": "f_proj.weight",
    "kda_dt_bias": "dt_bias",
    "kda_A_log": "A_log",
    "kda_b": "b_proj.weight",
    "kda_g": "g_proj.weight",
    "kda_norm": "o_norm.weight",
}
_FORGET = ("kda_f", "kda_dt_bias", "kda_A_log")


def _layer() -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name, key in DEEPSEEK_LAYER.items():
        saved = key.replace("self_attn.o_proj.", "attention.dense.").replace("self_attn.", "attention.")
        saved = saved.replace("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")
        out[name] = (saved, key) if saved != key else (key,)
    out["g_proj"] = ("attention.g_proj.weight", "self_attn.g_proj.weight")
    for name, key in _KDA.items():
        loaded = f"self_attn.forget_gate.{key}" if name in _FORGET else f"self_attn.{key}"
        out[name] = (f"attention.{key}", loaded)
    out["kda_o"] = ("attention.dense.weight", "self_attn.o_proj.weight")
    for part in ("q", "k", "v"):
        out[f"kda_{part}_conv"] = (f"attention.{part}_conv1d.weight",)
    return out


def _kda_sizes(c: Ctx) -> LinearAttention:
    heads = c.get("linear_num_heads", int, c.get("num_attention_heads", int))
    dim = c.get("linear_head_dim", int) if c.cfg.get("linear_head_dim") is not None else c.get("head_dim", int, 128)
    kernel = c.get("linear_conv_kernel_dim", int, c.get("short_conv_kernel_size", int, 4))
    if min(heads, dim, kernel) < 1:
        raise CheckpointError(
            "config.json: Kimi Delta Attention needs positive head count, head dim and conv kernel", path=c.path
        )
    return LinearAttention(num_k_heads=heads, num_v_heads=heads, k_dim=dim, v_dim=dim, conv_kernel=kernel)


def _default_types(c: Ctx) -> list[Any]:
    """Every ``layer_group_size``-th layer (default 6) MLA, the others KDA."""
    group = c.get("layer_group_size", int, 6)
    if group < 1:
        raise CheckpointError("config.json: layer_group_size must be ≥ 1", path=c.path)
    return ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(c.num_layers)]


def _layers(c: Ctx, s: ModelSpec) -> tuple[Layer, ...]:
    return mla_kda_layers(s, mla_kda_types(c, _default_types(c)))


def _fields(c: Ctx) -> dict[str, Any]:
    safe = c.get("kda_safe_gate", bool, True)
    return {
        "routed_layers": routed_layers(c, 2),
        "norm_topk_prob": bool(c.get("moe_renormalize", bool, True)),
        "dense_dim": c.get("intermediate_size", int, 6144),
        "shared_dim": c.get("num_shared_experts", int, 1) * c.get("moe_intermediate_size", int, 768),
        "shared_gated": False,
        "gate": v3_gate(c, n_group=8, topk_group=4, scaling=2.5),
        "mtp_layers": mtp_count(c, 1),
        "output_gate": "head_sigmoid",
        "linear_attention": _kda_sizes(c),
        "kda_gate_bound": float(c.get("kda_lower_bound", float, -5.0)) if safe else None,
    }


LAYOUT = Layout(
    family="bailing_hybrid",
    globals={
        "embed": ("model.word_embeddings.weight", "model.embed_tokens.weight"),
        "final_norm": ("model.norm.weight",),
        "lm_head": ("lm_head.weight",),
    },
    layer=prefixed(L, _layer()),
    expert=prefixed(
        L,
        {
            "w1": "mlp.experts.{expert}.gate_proj.weight",
            "w3": "mlp.experts.{expert}.up_proj.weight",
            "w2": "mlp.experts.{expert}.down_proj.weight",
        },
    ),
    fused=prefixed(L, MLP_FUSED),
    notes="hybrid: Kimi Delta Attention (per-channel decay, full-rank gates, bounded forget gate) and MLA "
    "with interleaved RoPE and a per-head sigmoid output gate; DeepSeek-V3 routing; ungated shared experts; "
    "MTP layers left out",
)

FAMILY = Family(
    name="bailing_hybrid",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts",),
    top_k_key="num_experts_per_token",
    default_rms_eps=1e-6,
    default_rope_theta=6e6,
    mla=lambda c: parse_mla(c, always_interleave=True),
    decoder_config=canonical_config,
    layers=_layers,
)

__all__ = ["ALIASES", "FAMILY"]
