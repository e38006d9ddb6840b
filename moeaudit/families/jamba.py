"""Jamba (``jamba``): a hybrid of Mamba-1 and attention layers. Every ``attn_layer_period``-th
layer from ``attn_layer_offset`` is attention (GQA, no positional encoding at all: Jamba's
attention has no RoPE), the others are Jamba's Mamba-1 mixer (:mod:`moeaudit.replay.mamba`:
in_proj → x | z, causal conv + SiLU, x_proj → dt | B | C each RMS-normalised, dt_proj,
the selective scan, D skip, SiLU(z) gate, out_proj). Every ``expert_layer_period``-th layer
from ``expert_layer_offset`` is routed (softmax top-k, not renormalised; experts as wide as the
dense MLPs, ``intermediate_size``), the others are dense SwiGLU MLPs. Norms: ``input_layernorm``
before the mixer, ``pre_ff_layernorm`` before the MLP, ``final_layernorm`` at the end."""

from __future__ import annotations

import math
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, mixing
from moeaudit.spec.blocks import Layer, MambaMixer, uniform
from moeaudit.spec.config import Mamba, ModelSpec
from moeaudit.spec.layouts import ATTN, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant

MAMBA1 = {
    "ssm_in": "mamba.in_proj.weight",
    "ssm_in_bias": "mamba.in_proj.bias",
    "ssm_conv": "mamba.conv1d.weight",
    "ssm_conv_bias": "mamba.conv1d.bias",
    "ssm_x": "mamba.x_proj.weight",
    "ssm_dt": "mamba.dt_proj.weight",
    "ssm_dt_bias": "mamba.dt_proj.bias",
    "ssm_A_log": "mamba.A_log",
    "ssm_D": "mamba.D",
    "ssm_dt_norm": "mamba.dt_layernorm.weight",
    "ssm_b_norm": "mamba.b_layernorm.weight",
    "ssm_c_norm": "mamba.c_layernorm.weight",
    "ssm_out": "mamba.out_proj.weight",
    "ssm_out_bias": "mamba.out_proj.bias",
}


def _period(c: Ctx, period_key: str, period: int, offset_key: str, offset: int) -> tuple[int, int]:
    p, o = c.get(period_key, int, period), c.get(offset_key, int, offset)
    if p < 1 or o >= p:
        raise CheckpointError(f"config.json: {offset_key}={o} must be below {period_key}={p} (≥ 1)", path=c.path)
    return p, o


def _mamba(c: Ctx) -> Mamba:
    hidden = c.get("hidden_size", int)
    rank = c.cfg.get("mamba_dt_rank", "auto")
    rank = math.ceil(hidden / 16) if rank in ("auto", None) else c.get("mamba_dt_rank", int)
    m = Mamba(
        version=1,
        inner=c.get("mamba_expand", int, 2) * hidden,
        state=c.get("mamba_d_state", int, 16),
        conv_kernel=c.get("mamba_d_conv", int, 4),
        conv_bias=bool(c.get("mamba_conv_bias", bool, True)),
        proj_bias=bool(c.get("mamba_proj_bias", bool, False)),
        dt_rank=rank,
        eps=c.get("rms_norm_eps", float, 1e-6),
    )
    if min(m.inner, m.state, m.conv_kernel, m.dt_rank) < 1:
        raise CheckpointError(
            "config.json: mamba_expand, mamba_d_state, mamba_d_conv and mamba_dt_rank must be ≥ 1", path=c.path
        )
    return m


def _layers(c: Ctx, s: ModelSpec) -> tuple[Layer, ...]:
    """A Mamba mixer on every layer but each ``attn_layer_period``-th (from ``attn_layer_offset``),
    attention without positions there."""
    assert s.settings.mamba is not None
    attn_p, attn_o = _period(c, "attn_layer_period", 8, "attn_layer_offset", 4)
    types = ["attention" if i % attn_p == attn_o else "mamba" for i in range(c.num_layers)]
    return mixing(s, types, "mamba", MambaMixer(s.settings.mamba))


def _fields(c: Ctx) -> dict[str, Any]:
    exp_p, exp_o = _period(c, "expert_layer_period", 2, "expert_layer_offset", 1)
    routed = tuple(i for i in range(c.num_layers) if i % exp_p == exp_o) if c.num_experts > 1 else ()
    return {
        "routed_layers": routed,
        "norm_topk_prob": False,
        "dense_dim": c.get("intermediate_size", int),
        "mamba": _mamba(c),
        "attention": uniform(
            c.num_layers, AttentionVariant(rope=False)
        ),  # Jamba's attention has no positional encoding
    }


LAYOUT = Layout(
    family="jamba",
    globals={
        "embed": ("model.embed_tokens.weight",),
        "final_norm": ("model.final_layernorm.weight",),
        "lm_head": ("lm_head.weight",),
    },
    layer=prefixed(
        L,
        {
            **ATTN,
            "post_norm": "pre_ff_layernorm.weight",
            "router": "feed_forward.router.weight",
            "mlp_w1": "feed_forward.gate_proj.weight",
            "mlp_w3": "feed_forward.up_proj.weight",
            "mlp_w2": "feed_forward.down_proj.weight",
            **MAMBA1,
        },
    ),
    expert=prefixed(
        L,
        {
            "w1": "feed_forward.experts.{expert}.gate_proj.weight",
            "w3": "feed_forward.experts.{expert}.up_proj.weight",
            "w2": "feed_forward.experts.{expert}.down_proj.weight",
        },
    ),
    fused=prefixed(L, {"gate_up": "feed_forward.experts.gate_up_proj", "down": "feed_forward.experts.down_proj"}),
    notes="hybrid: Mamba-1 mixers and attention without positional encoding; softmax top-k not "
    "renormalised on every expert_layer_period-th layer, dense SwiGLU MLPs elsewhere",
)

FAMILY = Family(
    name="jamba",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts", "num_local_experts"),
    expert_dim_key="intermediate_size",
    layers=_layers,
)
