"""MiMo-V2-Flash (``mimo_v2_flash``): full-attention and sliding-window layers by ``layer_types``
(default: the first layer and every sixth full, the rest sliding) whose attention differs by
type (``ModelSpec.attention_kinds``): sliding layers have twice ``num_key_value_heads`` and a
learned sink logit per head (``self_attn.sinks``); every layer has query/key heads ``head_dim``
wide and value heads ``v_head_dim`` wide, the values × ``attention_value_scale``, the softmax
scale head_dim^-0.5, and RoPE per layer type (``rope_parameters.full_attention`` θ 5e6,
``.sliding_attention`` θ 1e4, each on the first int(head_dim × ``partial_rotary_factor``,
default 0.334) dims); no o_proj bias. DeepSeek-V3's router (sigmoid scores, the selection bias
``e_score_correction_bias``, group-limited top-k on top-2 sums, renormalised with 1e-20,
× ``routed_scaling_factor``, null read as 1), no shared expert; ``mlp_layer_types`` places
dense (``intermediate_size``) and routed layers (default: the first dense). A window of
``sliding_window`` keys, the query's included (``sliding_window_size`` + 1 when that is given,
as MiMoV2FlashConfig reads it). ``model.mtp.*`` is left out, as transformers does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families._kinds import by_layer_type, type_rope
from moeaudit.families.base import Ctx, Family, attention_by_layer, mlp_layer_types, v3_gate
from moeaudit.spec.config import AttentionKind
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, hf_layout
from moeaudit.spec.settings import AttentionVariant

KINDS = ("full_attention", "sliding_attention")
# MiMoV2FlashConfig's RoPE per layer type when config.json gives none
DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
}
PER_TYPE = "_moeaudit_rope_per_type"  # rope_parameters per layer type (``_fields``)


def default_layer_types(n: int) -> list[str]:
    return ["full_attention" if (i == 0 or not (i + 1) % 6) else "sliding_attention" for i in range(n)]


def _decoder(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """``layer_types`` and the per-type ``rope_parameters`` validated (MiMoV2FlashConfig's
    defaults where absent); ``rope_parameters`` the full-attention entry for the common reader."""
    layers = cfg.get("num_hidden_layers", 48)
    n = layers if isinstance(layers, int) and not isinstance(layers, bool) else 0
    types = cfg.get("layer_types") or default_layer_types(n)
    if not isinstance(types, list) or len(types) != n or not set(types) <= set(KINDS):
        raise CheckpointError(
            f"config.json: layer_types must list {n} layers, each 'full_attention' or 'sliding_attention'", path=path
        )
    params = cfg.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(params, dict) or not all(isinstance(params.get(t), dict) for t in set(types)):
        raise CheckpointError(
            "config.json: mimo_v2_flash's rope_parameters must be given per layer type "
            f"({' / '.join(KINDS)}), for every type layer_types uses",
            path=path,
        )
    return {**cfg, "layer_types": types, "rope_parameters": params[types[0]] if types else {}, PER_TYPE: params}


def _fields(c: Ctx) -> dict[str, Any]:
    types = c.cfg["layer_types"]
    heads = c.get("num_attention_heads", int)
    kv = c.get("num_key_value_heads", int, 4)
    D, Dv = c.get("head_dim", int, 192), c.get("v_head_dim", int, 128)
    if D < 2 or D % 2 or Dv < 1:
        raise CheckpointError(f"config.json: head_dim {D} / v_head_dim {Dv} cannot be replayed", path=c.path)
    value_scale = c.get("attention_value_scale", float, 1.0) if "attention_value_scale" in c.cfg else 0.707
    kinds = {}
    for name in KINDS:
        if name not in set(types):
            continue
        n_kv = kv * 2 if name == "sliding_attention" else kv
        if heads % n_kv:
            raise CheckpointError(f"config.json: {heads} heads not divisible by {n_kv} {name} kv heads", path=c.path)
        theta, rotary = type_rope(c, name, c.cfg[PER_TYPE][name], D, default_factor=0.334)
        kinds[name] = AttentionKind(
            name, heads, n_kv, D, theta, rotary, Dv, sinks=name == "sliding_attention", value_scale=value_scale
        )
    attention_kinds, layer_kinds = by_layer_type(types, kinds)
    window = c.get("sliding_window", int, 129)
    if c.cfg.get("sliding_window_size") is not None:  # MiMoV2FlashConfig: the reference's window + the query
        window = c.get("sliding_window_size", int) + 1
    if window < 1:
        raise CheckpointError(f"config.json: sliding_window must be ≥ 1, got {window}", path=c.path)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    first = attention_kinds[layer_kinds[0]]
    return {
        "routed_layers": mlp_layer_types(c, 1),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "o_bias": False,
        "head_dim": D,
        "num_kv_heads": first.num_kv_heads,
        "rope_theta": first.rope_theta,
        "rotary_dim": first.rotary_dim,
        "dense_dim": c.get("intermediate_size", int, 16384),
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=1.0),
        "shared_gated": False,
        "attention_kinds": attention_kinds,
        **attention_by_layer(
            [
                AttentionVariant(window=window if i in sliding else None, kind=layer_kinds[i])
                for i in range(c.num_layers)
            ]
        ),
    }


LAYOUT = hf_layout(
    "mimo_v2_flash",
    {
        **ATTN,
        **MLP_MOE,
        # as saved and released (transformers renames it to self_attn.sinks on load), or as named in memory
        "sinks": ("self_attn.attention_sink_bias", "self_attn.sinks"),
        "router_bias": "mlp.gate.e_score_correction_bias",
        **DENSE_MLP,
    },
    notes="attention per layer type (sliding: 2× kv heads, sinks; RoPE per type, partial), value heads "
    "unlike the keys' and scaled; sigmoid router with selection bias and group-limited top-k; "
    "mlp_layer_types; model.mtp.* left out",
    left_out={"model.mtp.": "multi-token-prediction module model.mtp.*"},
)

FAMILY = Family(
    name="mimo_v2_flash",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    default_rms_eps=1e-5,
    decoder_config=_decoder,
)
