"""Granite 4.0 hybrids (``granitemoehybrid``): Mamba-2 and attention layers, each followed by
a routed MoE block plus an always-on shared MLP. ``layer_types`` names each layer's mixer
("mamba" / "linear_attention": Mamba-2, :mod:`moeaudit.replay.mamba`; "attention" /
"full_attention": GQA attention, RoPE only when ``position_embedding_type`` is "rope" — Granite
4.0 ships without); every layer is routed (Granite MoE's router: top-k of the logits, softmax
over those k) and adds ``shared_mlp`` (SwiGLU, gate and up rows fused in ``input_linear``,
ungated). Granite's µP multipliers as in ``granitemoe``: embeddings × e, the attention softmax
scale, every mixer and MLP branch × the residual multiplier, logits ÷ ``logits_scaling``."""

from __future__ import annotations

import math
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, all_layers, mixing
from moeaudit.families.granitemoe import _multiplier
from moeaudit.spec.blocks import Layer, MambaMixer, uniform
from moeaudit.spec.config import Mamba, ModelSpec
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant

MAMBA2 = {
    "ssm_in": "mamba.in_proj.weight",
    "ssm_in_bias": "mamba.in_proj.bias",
    "ssm_conv": "mamba.conv1d.weight",
    "ssm_conv_bias": "mamba.conv1d.bias",
    "ssm_dt_bias": "mamba.dt_bias",
    "ssm_A_log": "mamba.A_log",
    "ssm_D": "mamba.D",
    "ssm_norm": "mamba.norm.weight",
    "ssm_out": "mamba.out_proj.weight",
    "ssm_out_bias": "mamba.out_proj.bias",
}
MAMBA_TYPES, ATTENTION_TYPES = ("mamba", "linear_attention"), ("attention", "full_attention")


def _number(value: object) -> float | None:
    """A time-step limit as config.json holds it: a number, or ±Infinity (transformers writes
    ``{"__float__": "Infinity"}``); None when it is not one."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _dt_limit(c: Ctx) -> tuple[float, float | None]:
    raw = c.cfg.get("time_step_limit")
    if raw is None:
        return 0.0, None
    pair = [_number(v) for v in raw] if isinstance(raw, list) else []
    lo, hi = (pair + [None, None])[:2] if len(pair) == 2 else (None, None)
    if lo is None or hi is None or not math.isfinite(lo) or math.isnan(hi) or hi < lo:
        raise CheckpointError(
            f"config.json: time_step_limit must be [min, max] with a finite min ≤ max, got {raw!r}", path=c.path
        )
    return lo, (None if math.isinf(hi) else hi)


def mamba2(
    c: Ctx,
    *,
    heads: str,
    head_dim: str,
    groups: str,
    state: str,
    conv: str,
    chunk: str,
    conv_bias: str,
    proj_bias: str,
    eps: float,
    dt_limit: tuple[float, float | None],
    defaults: dict[str, Any],
) -> Mamba:
    """A Mamba-2 mixer's sizes from the config keys a family names, validated as transformers'
    reshapes need them."""
    hidden = c.get("hidden_size", int)
    n_heads = c.get(heads, int, defaults[heads])
    inner = c.get("mamba_expand", int, 2) * hidden if "mamba_expand" in defaults else 0
    d_head = c.cfg.get(head_dim, defaults[head_dim])
    if d_head in ("auto", None):
        d_head = inner // n_heads if n_heads else 0
    else:
        d_head = c.get(head_dim, int)
    inner = inner or n_heads * d_head
    m = Mamba(
        version=2,
        inner=inner,
        state=c.get(state, int, defaults[state]),
        conv_kernel=c.get(conv, int, defaults[conv]),
        conv_bias=bool(c.get(conv_bias, bool, True)),
        proj_bias=bool(c.get(proj_bias, bool, False)),
        heads=n_heads,
        head_dim=d_head,
        groups=c.get(groups, int, defaults[groups]),
        chunk=c.get(chunk, int, defaults[chunk]),
        dt_min=dt_limit[0],
        dt_max=dt_limit[1],
        eps=eps,
    )
    if min(m.heads, m.head_dim, m.groups, m.state, m.conv_kernel, m.chunk) < 1:
        raise CheckpointError(
            "config.json: the Mamba heads, head size, groups, state size, conv kernel and chunk size must be ≥ 1",
            path=c.path,
        )
    if m.heads * m.head_dim != m.inner or m.heads % m.groups:
        raise CheckpointError(
            f"config.json: {m.heads} Mamba heads of {m.head_dim} do not make the "
            f"{m.inner} scan channels, or do not split into {m.groups} groups",
            path=c.path,
        )
    return m


def _layer_types(c: Ctx) -> list[str]:
    """``layer_types`` (or ``layers_block_type``): "mamba" or "attention" per layer (absent:
    every layer Mamba, transformers' default)."""
    key = "layer_types" if "layer_types" in c.cfg or "layers_block_type" not in c.cfg else "layers_block_type"
    types = c.cfg.get(key)
    if types is None:
        return ["mamba"] * c.num_layers  # transformers' default: every layer Mamba
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= {*MAMBA_TYPES, *ATTENTION_TYPES}:
        raise CheckpointError(
            f"config.json: {key} must list {c.num_layers} layers, each 'mamba' or 'attention'", path=c.path
        )
    return ["mamba" if t in MAMBA_TYPES else "attention" for t in types]


def _layers(c: Ctx, s: ModelSpec) -> tuple[Layer, ...]:
    """A Mamba-2 mixer on the "mamba" layers, the spec's attention on the others."""
    assert s.settings.mamba is not None
    return mixing(s, _layer_types(c), "mamba", MambaMixer(s.settings.mamba))


def _fields(c: Ctx) -> dict[str, Any]:
    eps = c.get("rms_norm_eps", float, 1e-6)
    m = mamba2(
        c,
        heads="mamba_n_heads",
        head_dim="mamba_d_head",
        groups="mamba_n_groups",
        state="mamba_d_state",
        conv="mamba_d_conv",
        chunk="mamba_chunk_size",
        conv_bias="mamba_conv_bias",
        proj_bias="mamba_proj_bias",
        eps=eps,
        dt_limit=_dt_limit(c),
        defaults={
            "mamba_n_heads": 128,
            "mamba_d_head": "auto",
            "mamba_n_groups": 1,
            "mamba_d_state": 256,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 256,
            "mamba_expand": 2,
        },
    )
    rope = c.cfg.get("position_embedding_type") == "rope"
    return {
        "routed_layers": all_layers(c) if c.num_experts > 0 else (),
        "norm_topk_prob": True,
        "shared_dim": c.get("shared_intermediate_size", int, 1024),
        "shared_gated": False,
        "attention_scale": _multiplier(c, "attention_multiplier"),
        "embedding_multiplier": _multiplier(c, "embedding_multiplier"),
        "residual_multiplier": _multiplier(c, "residual_multiplier"),
        "logits_scaling": _multiplier(c, "logits_scaling"),
        "mamba": m,
        **({} if rope else {"attention": uniform(c.num_layers, AttentionVariant(rope=False))}),
    }


LAYOUT = Layout(
    family="granitemoehybrid",
    globals=GLOBALS,
    layer=prefixed(
        L,
        {
            **ATTN,
            "router": ("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"),
            "shared_gate_up": "shared_mlp.input_linear.weight",
            "shared_w2": "shared_mlp.output_linear.weight",
            **MAMBA2,
        },
    ),
    expert={},
    fused=prefixed(
        L,
        {
            "gate_up": ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"),
            "down": ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj"),
        },
    ),
    notes="hybrid: Mamba-2 (SSD) and attention (RoPE only with position_embedding_type 'rope'); "
    "Mixtral routing plus an ungated shared MLP on every layer; Granite's multipliers",
)

FAMILY = Family(
    name="granitemoehybrid",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts", "num_experts"),
    expert_dim_key="intermediate_size",
    layers=_layers,
)
