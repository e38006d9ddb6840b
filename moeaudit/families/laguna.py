"""Laguna (``laguna``): Qwen3 attention (per-head q/k RMSNorm before RoPE, partial rotary) with a
softplus output gate (``gating``: one gate per head, or per channel with "per-element"); a
sigmoid router on soft-capped logits (c·tanh(logit / c), ``moe_router_logit_softcapping``)
whose top-k is chosen on σ + ``e_score_correction_bias``, the chosen σ renormalised; the routed
sum × ``moe_routed_scaling_factor`` (the combine weights carry it) plus an ungated shared
expert; ``mlp_layer_types`` places dense and routed layers (default: the first dense).
RoPE parameters are given per layer type (``rope_parameters.full_attention`` /
``.sliding_attention``: θ, partial rotary) and query head counts per layer
(``num_attention_heads_per_layer``). When every layer has the same head count and the layer
types used share one RoPE (the default: every layer full attention) the spec has one table, as
before; otherwise one attention kind per (layer type, head count) used
(``ModelSpec.attention_kinds``). The checkpoints use
Qwen2-MoE's names (``mlp.shared_expert``, the bias as ``mlp.experts.e_score_correction_bias``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families._kinds import by_type_and_heads, types_and_ropes
from moeaudit.families.base import (
    Ctx,
    Family,
    Refuse,
    attention_by_layer,
    head_dim,
    mlp_layer_types,
    partial_rotary_dim,
    sliding_window,
)
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, hf_layout
from moeaudit.spec.settings import AttentionVariant

# LagunaConfig's RoPE per layer type when config.json gives none
DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}
KINDS = tuple(DEFAULT_ROPE)
PER_TYPE = "_moeaudit_rope_per_type"  # rope_parameters of layer types whose RoPE differs (``_kinds``)


def _one_rope(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The config with ``rope_parameters`` the one entry every used layer type shares."""
    layers = cfg.get("num_hidden_layers")
    types, params, used = types_and_ropes(cfg, path, "laguna", DEFAULT_ROPE)
    heads = cfg.get("num_attention_heads_per_layer")
    if heads is not None and (
        not isinstance(heads, list)
        or (isinstance(layers, int) and len(heads) != layers)
        or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in heads)
    ):
        raise CheckpointError(
            "config.json: num_attention_heads_per_layer must list a positive head count per layer", path=path
        )
    one = used[0] if used else DEFAULT_ROPE["full_attention"]
    out = {**cfg, "rope_parameters": one, "layer_types": types}
    if any(p != used[0] for p in used[1:]) or any(h != cfg.get("num_attention_heads") for h in heads or []):
        out[PER_TYPE] = params  # an attention kind per (layer type, head count) (``_kinds``)
    return out


def _kinds(c: Ctx) -> dict[str, Any]:
    """Layer types whose RoPE differs, or layers whose head counts do: one attention kind per
    (layer type, head count) used (that type's θ and partial rotary, that count of query heads)."""
    params = c.cfg.get(PER_TYPE)
    if params is None:
        return {}
    types: list[str] = c.cfg["layer_types"]
    heads = c.cfg.get("num_attention_heads_per_layer") or [c.get("num_attention_heads", int)] * len(types)
    if len(types) != c.num_layers or len(heads) != c.num_layers:
        raise CheckpointError(
            f"config.json: layer_types and num_attention_heads_per_layer must list {c.num_layers} layers", path=c.path
        )
    D, kv = head_dim(c), c.get("num_key_value_heads", int)
    attention_kinds, layer_kinds = by_type_and_heads(c, types, heads, kv, D, params)
    first = attention_kinds[layer_kinds[0]]
    return {
        "num_heads": first.num_heads,
        "rope_theta": first.rope_theta,
        "rotary_dim": first.rotary_dim,
        "attention_kinds": attention_kinds,
        "layer_kinds": layer_kinds,  # into ``_fields``'s attention variants
    }


def _rotary_factor(c: Ctx) -> float:
    value = c.cfg["rope_parameters"].get("partial_rotary_factor", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {value!r}", path=c.path)
    return float(value)


def _gate_kind(c: Ctx) -> str:
    gating = c.cfg.get("gating", True)
    if gating is True or gating == "per-head":
        return "head"
    if gating == "per-element":
        return "element"
    raise CheckpointError(
        f"moeaudit does not replay laguna gating={gating!r} (it replays true, 'per-head' and 'per-element')",
        path=c.path,
    )


def _fields(c: Ctx) -> dict[str, Any]:
    window = sliding_window(c)
    sliding = tuple(i for i, t in enumerate(c.cfg["layer_types"]) if t == "sliding_attention")
    kinds = _kinds(c)
    layer_kinds = kinds.pop("layer_kinds", None)
    cap = c.get("moe_router_logit_softcapping", float, 0.0)
    if cap < 0:
        raise CheckpointError(f"config.json: moe_router_logit_softcapping must be ≥ 0, got {cap}", path=c.path)
    return {
        "routed_layers": mlp_layer_types(c, 1),
        "norm_topk_prob": True,
        "qk_norm": "head",
        "rotary_dim": partial_rotary_dim(c, head_dim(c), _rotary_factor(c)),
        "dense_dim": c.get("intermediate_size", int, 8192),
        "shared_dim": c.get("shared_expert_intermediate_size", int, 512),
        "shared_gated": False,
        **attention_by_layer(
            [
                AttentionVariant(window=window if i in sliding else None, kind=layer_kinds[i] if layer_kinds else None)
                for i in range(c.num_layers)
            ]
        ),
        "gate": Gate(scoring="sigmoid", selection_bias=True, scaling=c.get("moe_routed_scaling_factor", float, 1.0)),
        "router_softcap": cap,
        "output_gate": _gate_kind(c),
        **kinds,
    }


LAYOUT = hf_layout(
    "laguna",
    {
        **ATTN,
        "g_proj": "self_attn.g_proj.weight",
        **MLP_MOE,
        "router_bias": ("mlp.experts.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
        "shared_w1": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.gate_proj.weight"),
        "shared_w3": ("mlp.shared_expert.up_proj.weight", "mlp.shared_experts.up_proj.weight"),
        "shared_w2": ("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.down_proj.weight"),
        **DENSE_MLP,
    },
    notes="per-head q/k norm, partial rotary, softplus output gate; soft-capped sigmoid router with a selection "
    "bias, renormalised, routed sum scaled; ungated shared expert; mlp_layer_types",
)

FAMILY = Family(
    name="laguna",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts", "num_local_experts"),
    default_rms_eps=1e-6,
    default_rope_theta=500000.0,
    decoder_config=_one_rope,
    refuse=(
        Refuse(
            "moe_apply_router_weight_on_input",
            (False,),
            "router weights applied to the experts' input (transformers raises on it too)",
        ),
    ),
)
