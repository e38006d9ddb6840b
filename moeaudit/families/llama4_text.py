"""Llama 4's text decoder (``llama4_text``, transformers' ``Llama4ForCausalLM``).

What differs from the others: a sigmoid router without renormalisation (top-k of the logits,
combine weight σ(logit)) whose weight *scales each chosen expert's input*: the block computes
Σ_k u_k(c_k y) + shared(y), not Σ_k c_k u_k(y); an always-on, ungated shared expert; MoE and
dense layers interleaved (``moe_layers`` / ``interleave_moe_layer_step``; dense MLPs of
``intermediate_size_mlp``); RoPE on adjacent pairs (complex form) with Llama 3 frequency
scaling; NoPE layers (``no_rope_layers`` 0, by default every fourth) whose queries get a
position-dependent temperature (``attn_temperature_tuning``); chunked local attention
(``attention_chunk_size``) on the RoPE layers; a weightless RMS ("L2") norm of q and k after
RoPE on RoPE layers (``use_qk_norm``). Experts are stored fused, ``gate_up_proj`` [E, H, 2I]
(gate columns first) and ``down_proj`` [E, I, H].
"""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, attention_by_layer
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant
from moeaudit.spec.torchtitan import HF_LAYER, TT_LAYER, Rules

LAYER_TYPES = ("chunked_attention", "full_attention")


def _int_list(c: Ctx, key: str) -> list[int] | None:
    value = c.cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CheckpointError(f"config.json: {key} must be a list of integers", path=c.path)
    return value


def _moe_layers(c: Ctx) -> tuple[int, ...]:
    """``moe_layers``, else every ``interleave_moe_layer_step``-th layer (``Llama4TextConfig``)."""
    layers = _int_list(c, "moe_layers")
    if layers is None:
        step = c.get("interleave_moe_layer_step", int, 1)
        if step < 1:
            raise CheckpointError("config.json: interleave_moe_layer_step must be ≥ 1", path=c.path)
        layers = list(range(step - 1, c.num_layers, step))
    if any(not 0 <= i < c.num_layers for i in layers):
        raise CheckpointError(f"config.json: moe_layers must be layer indices in 0..{c.num_layers - 1}", path=c.path)
    return tuple(sorted(set(layers)))


def _rope_layers(c: Ctx) -> list[bool]:
    """Which layers use RoPE: ``no_rope_layers`` (1 = RoPE, 0 = NoPE; when absent or empty,
    NoPE every ``no_rope_layer_interval``-th layer)."""
    flags = _int_list(c, "no_rope_layers")
    if not flags:
        interval = c.get("no_rope_layer_interval", int, 4)
        if interval < 1:
            raise CheckpointError("config.json: no_rope_layer_interval must be ≥ 1", path=c.path)
        return [(i + 1) % interval != 0 for i in range(c.num_layers)]
    if len(flags) < c.num_layers or any(f not in (0, 1) for f in flags):
        raise CheckpointError(
            f"config.json: no_rope_layers must hold a 0 or 1 for each of the {c.num_layers} layers", path=c.path
        )
    return [bool(f) for f in flags[: c.num_layers]]


def fields(c: Ctx) -> dict[str, Any]:
    rope = _rope_layers(c)
    chunk = c.cfg.get("attention_chunk_size", 8192)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise CheckpointError(
            f"config.json: attention_chunk_size must be a positive integer or null, got {chunk!r}", path=c.path
        )
    types = c.cfg.get("layer_types")
    if types is None:
        chunked = tuple(i for i, r in enumerate(rope) if r and chunk is not None)
    elif not isinstance(types, list) or len(types) != c.num_layers or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} of {' / '.join(LAYER_TYPES)}", path=c.path
        )
    else:
        chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
        if chunked and chunk is None:
            raise CheckpointError(
                "config.json: layer_types name chunked layers but attention_chunk_size is null", path=c.path
            )
    temperature = None
    if c.get("attn_temperature_tuning", bool, True):
        floor_scale = c.get("floor_scale", float, 8192.0)
        if not floor_scale > 0:
            raise CheckpointError(f"config.json: floor_scale must be positive, got {floor_scale!r}", path=c.path)
        temperature = (c.get("attn_scale", float, 0.1), floor_scale)
    routed = _moe_layers(c)
    return {
        "routed_layers": routed,
        "dense_dim": c.get("intermediate_size_mlp", int, 16384) if len(routed) < c.num_layers else 0,
        "shared_dim": c.get("intermediate_size", int),
        "shared_gated": False,
        "norm_topk_prob": False,
        "gate": Gate(scoring="sigmoid"),
        "scaled_expert_inputs": True,
        "qk_norm": "l2" if c.get("use_qk_norm", bool, True) else "none",
        "rope_interleaved": True,
        **attention_by_layer(
            [AttentionVariant(rope=rope[i], chunk=chunk if i in chunked else None) for i in range(c.num_layers)]
        ),
        "attn_temperature": temperature,
    }


TEXT_LAYER = {
    **ATTN,
    "router": "feed_forward.router.weight",
    "shared_w1": "feed_forward.shared_expert.gate_proj.weight",
    "shared_w3": "feed_forward.shared_expert.up_proj.weight",
    "shared_w2": "feed_forward.shared_expert.down_proj.weight",
    "mlp_w1": "feed_forward.gate_proj.weight",
    "mlp_w3": "feed_forward.up_proj.weight",
    "mlp_w2": "feed_forward.down_proj.weight",
}
TEXT_FUSED = {"gate_up": "feed_forward.experts.gate_up_proj", "down": "feed_forward.experts.down_proj"}
# torchtitan's Llama 4 (its state_dict_adapter's from_hf_map): router, shared expert and dense FFN
# under other names; GroupedExperts w1/w3 [E, I, H] and w2 [E, H, I] are fused by the DCP reader
# into ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] ("stacked"). A load-
# balancing ``moe.expert_bias`` (torchtitan adds it to the scores when choosing experts) has no
# place in transformers' Llama 4: it stays unmapped, and is reported as an ignored tensor.
TORCHTITAN: Rules = (
    (TT_LAYER + r"moe\.router\.gate\.weight", HF_LAYER + "feed_forward.router.weight"),
    (TT_LAYER + r"moe\.shared_experts?\.w1\.weight", HF_LAYER + "feed_forward.shared_expert.gate_proj.weight"),
    (TT_LAYER + r"moe\.shared_experts?\.w3\.weight", HF_LAYER + "feed_forward.shared_expert.up_proj.weight"),
    (TT_LAYER + r"moe\.shared_experts?\.w2\.weight", HF_LAYER + "feed_forward.shared_expert.down_proj.weight"),
    (TT_LAYER + r"feed_forward\.w1\.weight", HF_LAYER + "feed_forward.gate_proj.weight"),
    (TT_LAYER + r"feed_forward\.w3\.weight", HF_LAYER + "feed_forward.up_proj.weight"),
    (TT_LAYER + r"feed_forward\.w2\.weight", HF_LAYER + "feed_forward.down_proj.weight"),
    (TT_LAYER + r"moe\.expert_bias(?:_E)?", HF_LAYER + "feed_forward.router.expert_bias"),
)
TT_FUSED = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
NOTES = (
    "sigmoid top-k router scaling each expert's input, ungated shared expert, interleaved dense layers, "
    "NoPE layers with temperature tuning, chunked attention, L2 qk norm, Llama 3 RoPE"
)

LAYOUT = Layout(
    family="llama4_text",
    globals=GLOBALS,
    layer=prefixed(L, TEXT_LAYER),
    expert={},
    fused={n: (L + TEXT_FUSED[n], L + TT_FUSED[n]) for n in TEXT_FUSED},
    fused_format="transposed",
    fused_formats={L + TT_FUSED["gate_up"]: "stacked"},
    notes=NOTES,
)

FAMILY = Family(
    name="llama4_text",
    layout=LAYOUT,
    fields=fields,
    expert_count_keys=("num_local_experts",),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-5,
    default_rope_theta=500000.0,
    torchtitan=TORCHTITAN,
)
