"""Granite MoE with sliding-window layers (``granitemoe_swa``): :mod:`moeaudit.families.granitemoeshared`
(Granite MoE routing, µP multipliers, the optional ungated shared MLP) with per-layer attention:
``layer_types`` names each layer "sliding_attention" (a causal window of ``sliding_window``
tokens) or "full_attention" (default: full on every 4th layer from 0, sliding elsewhere); a
learned sink logit per head in every attention softmax (transformers scales the output by
σ(logsumexp(scores) − sink), the same as one more softmax logit carrying no value); and
``layer_rope_theta``, a RoPE base per layer where 0 means no RoPE (NoPE). The replay holds one
RoPE base: layers with different non-zero bases are refused."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import granitemoe, granitemoeshared
from moeaudit.families.base import Ctx, Family, attention_by_layer
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant

LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(c: Ctx) -> list[str]:
    types = c.cfg.get("layer_types")
    if types is None:  # GraniteMoeSWAConfig's default
        return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(c.num_layers)]
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= set(LAYER_TYPES):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} of {' / '.join(LAYER_TYPES)}", path=c.path
        )
    return types


def _thetas(c: Ctx, theta: float) -> list[float]:
    raw = c.cfg.get("layer_rope_theta")
    if raw is None:
        return [theta] * c.num_layers
    ok = (
        isinstance(raw, list)
        and len(raw) == c.num_layers
        and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 for t in raw)
    )
    if not ok:
        raise CheckpointError(
            f"config.json: layer_rope_theta must list {c.num_layers} RoPE bases ≥ 0 (0: no RoPE)", path=c.path
        )
    return [float(t) for t in raw]


def _fields(c: Ctx, theta: float) -> dict[str, Any]:
    types = _layer_types(c)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = c.cfg.get("sliding_window", 128)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(
            f"config.json: sliding_window must be a positive integer or null, got {window!r}", path=c.path
        )
    thetas = _thetas(c, theta)
    bases = sorted({t for t in thetas if t})
    if len(bases) > 1:
        raise CheckpointError(
            f"model family 'granitemoe_swa' with layer_rope_theta of several RoPE bases "
            f"({', '.join(f'{t:g}' for t in bases)}) cannot be replayed: the replay "
            "holds one RoPE base",
            path=c.path,
        )
    return {
        **granitemoe._fields(c),
        **granitemoeshared.shared_mlp(c),
        # transformers' sliding mask with sliding_window null is plain causal attention
        **attention_by_layer(
            [
                AttentionVariant(window=window if i in sliding else None, rope=bool(thetas[i]))
                for i in range(c.num_layers)
            ]
        ),
        "attention_sinks": True,
        **({"rope_theta": bases[0]} if bases else {}),
    }


LAYOUT = Layout(
    family="granitemoe_swa",
    globals=GLOBALS,
    layer=prefixed(L, {**ATTN, "sinks": "self_attn.sinks", **granitemoeshared.ROUTER, **granitemoeshared.SHARED}),
    expert={},
    fused=granitemoe.LAYOUT.fused,
    notes="Granite MoE (+ shared MLP) with attention sinks, sliding/full layer_types and per-layer "
    "RoPE bases (0: NoPE); Granite's multipliers; fused experts",
)


def _fields_of(c: Ctx) -> dict[str, Any]:
    params = c.cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta if isinstance(theta, (int, float)) and not isinstance(theta, bool) else c.cfg.get("rope_theta", 1e4)
    return _fields(c, float(theta))


FAMILY = Family(
    name="granitemoe_swa",
    layout=LAYOUT,
    fields=_fields_of,
    expert_count_keys=("num_local_experts", "num_experts"),
    expert_dim_key="intermediate_size",
)
