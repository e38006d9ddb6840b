"""Step 3.5 (``step3p5``, transformers' ``Step3p7TextConfig``: the text decoder of Step-3.7's
vision-language model): full-attention and sliding-window layers by ``layer_types``, whose
head counts (``per_layer_config``: ``num_sliding_attention_heads`` on sliding layers) and RoPE
(``rope_parameters`` per type: θ, partial rotary) differ (``ModelSpec.attention_kinds``); per-head
q/k RMSNorm and every RMSNorm zero-centred (gain 1 + w); a per-head sigmoid output gate
(``g_proj``, ``gating`` true or "per-head"); softmax scale
``query_pre_attn_scalar``^-0.5 (default head_dim); o_proj biased with ``attention_bias``. A
sigmoid router whose top-k is chosen on σ + ``e_score_correction_bias`` (stored ``moe.router_bias``),
renormalised, × ``moe_router_scaling_factor``; an ungated shared expert (``share_expert_dim``);
dense layers (``intermediate_size``) by ``mlp_layer_types`` (default: the first three). Experts
as saved and released: ``moe.gate_proj`` / ``moe.up_proj`` [E, I, H], ``moe.down_proj`` [E, H, I].
SwiGLU limits per layer (``swiglu_limits`` for the routed experts, ``swiglu_limits_shared``
for the shared expert and dense MLP: min(silu(gate), L) ⊙ clamp(up, ±L), ``ModelSpec.expert_glu``).
Refused by name: a gate per channel (other ``gating``: transformers' attention fails on it),
``mlp_bias``, bidirectional attention, layer types beyond full and sliding, ``per_layer_config``
beyond head counts, RoPE other than the default per type. MTP layers stored after the decoder
(``num_nextn_predict_layers``) are left out."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families._kinds import by_type_and_heads
from moeaudit.families.base import (
    Ctx,
    Family,
    attention_by_layer,
    grouped_gate,
    head_dim,
    mlp_layer_types,
    sliding_window,
)
from moeaudit.spec.layouts import ATTN, DENSE_MLP, GLOBALS, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant, GLULimits

KINDS = ("full_attention", "sliding_attention")
LIMIT = "a limit of moeaudit, not a fault of the checkpoint"


def _refuse(c: Ctx, what: str) -> CheckpointError:
    return CheckpointError(f"moeaudit does not replay step3p5 with {what} yet", path=c.path, hint=LIMIT)


def _heads(c: Ctx, types: list[str]) -> list[int]:
    """Each layer's query head count: ``per_layer_config`` (keys are layer indices, as saved),
    else ``num_sliding_attention_heads`` on sliding layers, else ``num_attention_heads``."""
    heads = c.get("num_attention_heads", int)
    sliding = c.get("num_sliding_attention_heads", int, heads)
    per = c.cfg.get("per_layer_config")
    if per is None:
        return [sliding if t == "sliding_attention" else heads for t in types]
    if not isinstance(per, dict):
        raise CheckpointError("config.json: per_layer_config must be an object", path=c.path)
    out = [heads] * len(types)
    for key, value in per.items():
        if not str(key).isdigit() or int(key) >= len(types) or not isinstance(value, dict):
            raise CheckpointError(f"config.json: per_layer_config has an entry {key!r} for no layer", path=c.path)
        if set(value) - {"num_attention_heads"}:
            raise _refuse(c, f"per_layer_config setting {sorted(set(value) - {'num_attention_heads'})}")
        n = value.get("num_attention_heads", heads)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise CheckpointError(f"config.json: per_layer_config.{key}.num_attention_heads {n!r}", path=c.path)
        out[int(key)] = n
    return out


def _limits(c: Ctx) -> dict[str, Any]:
    """``swiglu_limits`` (routed experts) / ``swiglu_limits_shared`` (shared expert and dense MLP):
    per layer, the bound of SwiGLU clamped after the activation, min(silu(gate), L) ⊙
    clamp(up, ±L); null or 0 an unclamped layer (transformers' ``or None`` / ``or inf``). Lists
    one longer per MTP layer are cut to the decoder's, as Step3p7TextConfig does."""
    out: dict[str, tuple[float, ...]] = {}
    for key, name in (("swiglu_limits", "experts"), ("swiglu_limits_shared", "mlp")):
        limits = c.cfg.get(key)
        if limits is None or limits == []:
            continue
        mtp = c.get("num_nextn_predict_layers", int, 0)
        if isinstance(limits, list) and mtp and len(limits) == c.num_layers + mtp:
            limits = limits[: c.num_layers]
        if not isinstance(limits, list) or len(limits) != c.num_layers:
            raise CheckpointError(f"config.json: {key} must list {c.num_layers} layers", path=c.path)
        values = []
        for v in limits:
            if v is None:
                v = 0.0
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise CheckpointError(f"config.json: {key} entries must be null or ≥ 0, got {v!r}", path=c.path)
            values.append(float(v))
        if any(values):
            out[name] = tuple(values)
    if not out:
        return {}
    experts, mlp = out.get("experts", (0.0,) * c.num_layers), out.get("mlp", (0.0,) * c.num_layers)
    return {"glu_limits": tuple(GLULimits(e, m) for e, m in zip(experts, mlp, strict=True))}


def _fields(c: Ctx) -> dict[str, Any]:
    if c.cfg.get("mlp_bias"):
        raise _refuse(c, "mlp_bias")
    if c.cfg.get("use_bidirectional_attention"):
        raise _refuse(c, "bidirectional attention")
    types = c.cfg.get("layer_types") or ["full_attention"] * c.num_layers
    if not isinstance(types, list) or len(types) != c.num_layers:
        raise CheckpointError(f"config.json: layer_types must list {c.num_layers} layers", path=c.path)
    if not set(types) <= set(KINDS):
        raise _refuse(c, f"layer types {sorted(set(types) - set(KINDS))}")
    params = c.cfg.get("rope_parameters") or {}
    if not isinstance(params, dict) or not all(t in params for t in set(types)):
        raise CheckpointError(
            "config.json: step3p5's rope_parameters must be given per layer type, for every type layer_types uses",
            path=c.path,
        )
    D, kv = head_dim(c), c.get("num_key_value_heads", int)
    heads = _heads(c, types)
    attention_kinds, layer_kinds = by_type_and_heads(c, types, heads, kv, D, params)
    first = attention_kinds[layer_kinds[0]]
    gating = c.cfg.get("gating", True)
    if not (gating is True or gating == "per-head"):  # transformers 5.24's per-channel path fails to run
        raise _refuse(c, f"gating {gating!r} (a gate per channel; transformers' Step3p7Attention cannot run it)")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = sliding_window(c)
    scalar = c.get("query_pre_attn_scalar", float, D)
    if scalar <= 0:
        raise CheckpointError(f"config.json: query_pre_attn_scalar must be positive, got {scalar}", path=c.path)
    return {
        "routed_layers": mlp_layer_types(c, 3),
        "norm_topk_prob": True,
        "qk_norm": "head",
        "norm_offset": 1.0,
        "output_gate": "head_sigmoid",
        "attention_scale": scalar**-0.5,
        "num_heads": first.num_heads,
        "rope_theta": first.rope_theta,
        "rotary_dim": first.rotary_dim,
        "dense_dim": c.get("intermediate_size", int, 11264),
        "shared_dim": c.get("share_expert_dim", int, 1280),
        "shared_gated": False,
        "gate": grouped_gate(
            c,
            scoring="sigmoid",
            selection_bias=True,
            grouped=False,
            n_group=1,
            topk_group=1,
            group_score="top2sum",
            scaling=c.get("moe_router_scaling_factor", float, 1.0),
        ),
        **attention_by_layer(
            [
                AttentionVariant(window=window if i in sliding else None, kind=layer_kinds[i])
                for i in range(c.num_layers)
            ]
        ),
        "mtp_layers": c.get("num_nextn_predict_layers", int, 0),
        "attention_kinds": attention_kinds,
        **_limits(c),
    }


LAYOUT = Layout(
    family="step3p5",
    globals=GLOBALS,
    layer=prefixed(
        L,
        {
            **ATTN,
            "q_norm": "self_attn.q_norm.weight",
            "k_norm": "self_attn.k_norm.weight",
            "g_proj": "self_attn.g_proj.weight",
            "router": ("moe.gate.weight", "mlp.gate.weight"),
            "router_bias": ("moe.router_bias", "mlp.gate.e_score_correction_bias"),
            "shared_w1": ("share_expert.gate_proj.weight", "mlp.shared_experts.gate_proj.weight"),
            "shared_w3": ("share_expert.up_proj.weight", "mlp.shared_experts.up_proj.weight"),
            "shared_w2": ("share_expert.down_proj.weight", "mlp.shared_experts.down_proj.weight"),
            **DENSE_MLP,
        },
    ),
    expert={},
    fused=prefixed(L, {"gate_up": "moe.gate_proj.weight", "up": "moe.up_proj.weight", "down": "moe.down_proj.weight"}),
    fused_format="split",
    notes="attention per layer type (head counts, RoPE), zero-centred norms, per-head q/k norm and sigmoid output "
    "gate; sigmoid router with selection bias; ungated shared expert; mlp_layer_types; experts as separate "
    "stacked gate / up / down",
)

FAMILY = Family(
    name="step3p5",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts", "moe_num_experts"),
    default_rms_eps=1e-5,
)
