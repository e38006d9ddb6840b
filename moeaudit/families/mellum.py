"""Mellum (``mellum``, JetBrains Mellum 2): Qwen3-MoE's decoder — per-head q/k RMSNorm, a
softmax router (top-k of the float32 probabilities, renormalised when ``norm_topk_prob``), no
shared expert — with dense or routed layers by ``mlp_layer_types`` ("sparse" routed, default
all) and sliding-window or full-attention layers by ``layer_types`` (default all full). RoPE
parameters are given per layer type, as Laguna's (``rope_parameters.full_attention`` θ 500000,
``.sliding_attention`` θ 10000 by default). When the layer types used share one RoPE (the
default: every layer full attention) the spec has one table, as before; when they differ, one
attention kind per layer type (``ModelSpec.attention_kinds``: same heads, that type's θ).
``mtp.*`` (multi-token prediction) is left out, as transformers does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families._kinds import by_layer_type, type_rope, types_and_ropes
from moeaudit.families.base import Ctx, Family, attention_by_layer, head_dim, mlp_layer_types, sliding_window
from moeaudit.families.qwen3_next import MTP
from moeaudit.spec.config import AttentionKind
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, hf_layout
from moeaudit.spec.settings import AttentionVariant

# MellumConfig's RoPE per layer type when config.json gives none
DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
KINDS = tuple(DEFAULT_ROPE)
PER_TYPE = "_moeaudit_rope_per_type"  # rope_parameters of layer types whose RoPE differs (``_kinds``)


def _one_rope(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The config with ``rope_parameters`` the one entry every used layer type shares."""
    types, params, used = types_and_ropes(cfg, path, "mellum", DEFAULT_ROPE)
    for one in used:
        factor = one.get("partial_rotary_factor", 1.0) if isinstance(one, dict) else 1.0
        if factor != 1.0:  # transformers' Mellum rotates whole heads: a partial table does not broadcast
            raise CheckpointError(
                f"config.json: mellum rotates whole heads; partial_rotary_factor {factor!r} cannot be applied",
                path=path,
            )
    if any(p != used[0] for p in used[1:]):  # a RoPE table per layer type (``_fields``)
        return {**cfg, "rope_parameters": used[0], "layer_types": types, PER_TYPE: params}
    one = used[0] if used else DEFAULT_ROPE["full_attention"]
    return {**cfg, "rope_parameters": one, "layer_types": types}


def _kinds(c: Ctx) -> dict[str, Any]:
    """Layer types whose RoPE differs: one attention kind per type used (same heads, own θ)."""
    params = c.cfg.get(PER_TYPE)
    if params is None:
        return {}
    heads = c.get("num_attention_heads", int)
    kv, D = c.get("num_key_value_heads", int, heads), head_dim(c)
    kinds = {}
    for name in (n for n in KINDS if n in params):  # _one_rope: every type used is there
        kinds[name] = AttentionKind(name, heads, kv, D, type_rope(c, name, params[name], D)[0])
    attention_kinds, layer_kinds = by_layer_type(c.cfg["layer_types"], kinds)
    return {"attention_kinds": attention_kinds, "layer_kinds": layer_kinds}  # into ``_fields``'s variants


def _fields(c: Ctx) -> dict[str, Any]:
    sliding = tuple(i for i, t in enumerate(c.cfg["layer_types"]) if t == "sliding_attention")
    window = sliding_window(c) if "sliding_window" in c.cfg else 1024
    kinds = _kinds(c)
    layer_kinds = kinds.pop("layer_kinds", None)
    return {
        "routed_layers": mlp_layer_types(c),  # default: every layer routed
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 7168),
        # a null window: transformers' sliding mask then masks nothing beyond causal
        **attention_by_layer(
            [
                AttentionVariant(window=window if i in sliding else None, kind=layer_kinds[i] if layer_kinds else None)
                for i in range(c.num_layers)
            ]
        ),
        **kinds,
    }


LAYOUT = hf_layout(
    "mellum",
    {
        **ATTN,
        **MLP_MOE,
        **DENSE_MLP,
    },
    notes="per-head q/k norm; softmax router, renormalised; mlp_layer_types; RoPE per layer type; mtp.* left out",
    left_out=MTP,
)

FAMILY = Family(
    name="mellum",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts", "num_experts"),
    default_rms_eps=1e-6,
    default_rope_theta=500000.0,
    decoder_config=_one_rope,
)
