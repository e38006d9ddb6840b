"""Kimi Linear (Moonshot): a hybrid decoder. ``layer_types`` marks each layer's token mixer:
``full_attention`` is DeepSeek MLA without positional encoding (the shared "rope" key dims
are used unrotated, scale (qk_nope + qk_rope)^−½), ``linear_attention`` is Kimi Delta
Attention, a delta rule with a decay per key channel (:mod:`moeaudit.replay.kda`).
``mlp_layer_types`` marks dense or sparse MLPs; the MoE is DeepSeek-V3's (sigmoid scores, a
selection bias, group-limited top-k, renormalised and scaled combine weights, ungated shared
experts). transformers writes the config under its attribute_map names (``num_experts``,
``num_experts_per_token``, ``num_shared_experts``, ``num_expert_group``, ``moe_renormalize``);
the DeepSeek names are read too. Tensors are read as ``save_pretrained`` writes them (the hub's
layout: ``block_sparse_moe.``, per-expert w1/w3/w2, q/k/v convolutions stored apart) or under
the loaded modules' names, but for the convolution, read apart only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import (
    Ctx,
    Family,
    first_k_dense,
    mlp_layer_types,
    parse_mla,
    v3_gate,
    with_mixers,
)
from moeaudit.spec import blocks
from moeaudit.spec.blocks import uniform
from moeaudit.spec.config import LinearAttention, ModelSpec
from moeaudit.spec.layouts import DEEPSEEK_LAYER, GLOBALS, MLP_FUSED, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant

# KimiLinearConfig.attribute_map: the DeepSeek name → the name transformers stores
ALIASES = {
    "num_local_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
}

# the names ``save_pretrained`` writes (transformers' conversion mapping reversed: the hub's
# remote-code layout) first, then the loaded modules' names
KDA: dict[str, str | tuple[str, ...]] = {
    "kda_q": "self_attn.q_proj.weight",
    "kda_k": "self_attn.k_proj.weight",
    "kda_v": "self_attn.v_proj.weight",
    "kda_q_conv": "self_attn.q_conv1d.weight",
    "kda_k_conv": "self_attn.k_conv1d.weight",
    "kda_v_conv": "self_attn.v_conv1d.weight",
    "kda_f_a": ("self_attn.f_a_proj.weight", "self_attn.forget_gate.f_a_proj.weight"),
    "kda_f_b": ("self_attn.f_b_proj.weight", "self_attn.forget_gate.f_b_proj.weight"),
    "kda_dt_bias": ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
    "kda_A_log": ("self_attn.A_log", "self_attn.forget_gate.A_log"),
    "kda_b": "self_attn.b_proj.weight",
    "kda_g_a": "self_attn.g_a_proj.weight",
    "kda_g_b": "self_attn.g_b_proj.weight",
    "kda_norm": "self_attn.o_norm.weight",
    "kda_o": "self_attn.o_proj.weight",
}
MOE_KEYS = ("router", "router_bias", "shared_w1", "shared_w3", "shared_w2", "mlp_w1", "mlp_w3", "mlp_w2")


def _block_sparse_moe(table: dict[str, str]) -> dict[str, str | tuple[str, ...]]:
    """The MLP / MoE tensors under ``block_sparse_moe.`` (as saved) or ``mlp.``."""
    out: dict[str, str | tuple[str, ...]] = dict(table)
    for name in MOE_KEYS:
        out[name] = (table[name].replace("mlp.", "block_sparse_moe.", 1), table[name])
    return out


EXPERTS = {
    "w1": ("block_sparse_moe.experts.{expert}.w1.weight", "mlp.experts.{expert}.gate_proj.weight"),
    "w3": ("block_sparse_moe.experts.{expert}.w3.weight", "mlp.experts.{expert}.up_proj.weight"),
    "w2": ("block_sparse_moe.experts.{expert}.w2.weight", "mlp.experts.{expert}.down_proj.weight"),
}


def canonical_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The config under both names of each alias (one fills the other where it is unset): the
    family reads the stored names, the shared gate reader the DeepSeek ones (``n_group``)."""
    out = dict(cfg)
    for alias, name in ALIASES.items():
        if out.get(name) is None and out.get(alias) is not None:
            out[name] = out[alias]
        if out.get(alias) is None and out.get(name) is not None:
            out[alias] = out[name]
    return out


def _linear_config(c: Ctx) -> dict[str, Any]:
    sub = c.cfg.get("linear_attn_config") or {}
    if not isinstance(sub, dict):
        raise CheckpointError("config.json: linear_attn_config must be an object", path=c.path)
    return sub


def _sub_int(c: Ctx, sub: dict[str, Any], key: str, top: str, default: int) -> int:
    """transformers' precedence: ``linear_attn_config[key]`` over the top-level ``top``."""
    value = sub.get(key)
    if value is None:
        return int(c.get(top, int, default))
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"config.json: linear_attn_config.{key} must be an integer, got {value!r}", path=c.path)
    return value


def _kda_sizes(c: Ctx) -> LinearAttention:
    sub = _linear_config(c)
    heads = _sub_int(c, sub, "num_heads", "linear_num_heads", 32)
    dim = _sub_int(c, sub, "head_dim", "linear_head_dim", 128)
    kernel = _sub_int(c, sub, "short_conv_kernel_size", "linear_conv_kernel_dim", 4)
    if min(heads, dim, kernel) < 1:
        raise CheckpointError("config.json: Kimi Delta Attention needs positive head count, head dim and conv kernel")
    return LinearAttention(num_k_heads=heads, num_v_heads=heads, k_dim=dim, v_dim=dim, conv_kernel=kernel)


def _default_types(c: Ctx) -> list[Any]:
    """The checkpoint's 1-indexed ``linear_attn_config`` ``full_attn_layers`` / ``kda_layers``;
    else every 4th layer but the first full (transformers' precedence and default)."""
    sub = _linear_config(c)
    if "full_attn_layers" in sub and "kda_layers" in sub:
        types: list[Any] = [None] * c.num_layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            listed = sub[key]
            if not isinstance(listed, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= c.num_layers for i in listed
            ):
                raise CheckpointError(
                    f"config.json: linear_attn_config.{key} must list layers in 1..{c.num_layers}", path=c.path
                )
            for i in listed:
                types[i - 1] = kind
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(c.num_layers)]


def mla_kda_types(c: Ctx, default: list[Any]) -> list[str]:
    """``layer_types`` (``default`` where it is unset): KDA ("linear_attention") or MLA ("full_attention")."""
    types = c.cfg.get("layer_types")
    types = default if types is None else types
    if (
        not isinstance(types, list)
        or len(types) != c.num_layers
        or not set(types) <= {"linear_attention", "full_attention"}
    ):
        raise CheckpointError(
            f"config.json: layer_types must give each of the {c.num_layers} layers as "
            "'linear_attention' or 'full_attention'",
            path=c.path,
        )
    return types


def mla_kda_layers(s: ModelSpec, types: list[str]) -> tuple[blocks.Layer, ...]:
    """Kimi Delta Attention on the ``linear_attention`` layers (Kimi Linear's low-rank forget and
    output gates, or Ling 3's full-rank ones, as the layout stores them), the spec's MLA on the
    ``full_attention`` ones."""
    assert s.settings.linear_attention is not None
    kda = blocks.KDA(
        s.settings.linear_attention, full_rank="kda_f" in s.layout.layer, gate_bound=s.settings.kda_gate_bound
    )
    return with_mixers(s, blocks.per_layer_type(types, {"linear_attention": kda, "full_attention": None}))


def _layers(c: Ctx, s: ModelSpec) -> tuple[blocks.Layer, ...]:
    return mla_kda_layers(s, mla_kda_types(c, _default_types(c)))


def routed_layers(c: Ctx, first_dense: int) -> tuple[int, ...]:
    """``mlp_layer_types`` ("dense" / "sparse"), else the first ``first_k_dense_replace``
    (default ``first_dense``) layers dense."""
    return mlp_layer_types(c, default=lambda: first_k_dense(c, first_dense))


def _fields(c: Ctx) -> dict[str, Any]:
    assert c.mla is not None
    return {
        "routed_layers": routed_layers(c, 1),
        "norm_topk_prob": bool(c.get("moe_renormalize", bool, True)),
        "dense_dim": c.get("intermediate_size", int, 9216),
        "shared_dim": c.get("num_shared_experts", int, 1) * c.get("moe_intermediate_size", int, 1024),
        "shared_gated": False,
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=2.446),
        # no RoPE anywhere: transformers' KimiLinearAttention never rotates (no rope_parameters)
        "attention": uniform(c.num_layers, AttentionVariant(rope=False)),
        "attention_scale": c.mla.qk_head_dim**-0.5,
        "yarn": None,
        "linear_attention": _kda_sizes(c),
    }


LAYOUT = Layout(
    family="kimi_linear",
    globals=GLOBALS,
    layer=prefixed(L, {**_block_sparse_moe(DEEPSEEK_LAYER), **KDA}),
    expert=prefixed(L, EXPERTS),
    fused=prefixed(L, MLP_FUSED),
    notes="hybrid: Kimi Delta Attention (per-channel decay) and MLA without RoPE; DeepSeek-V3 "
    "routing (sigmoid, selection bias, group-limited top-k, scaled weights); ungated shared experts; "
    "mlp_layer_types dense layers",
)

FAMILY = Family(
    name="kimi_linear",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts",),
    top_k_key="num_experts_per_token",
    default_rms_eps=1e-5,
    mla=parse_mla,
    decoder_config=canonical_config,
    layers=_layers,
)
