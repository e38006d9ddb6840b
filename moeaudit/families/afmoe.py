"""AFMoE (``afmoe``, Arcee Trinity): sandwich norms — each block's output passes its own RMSNorm
before the residual add (``post_attention_layernorm`` on the attention output,
``LayerSettings.attn_out_norm``; ``post_mlp_layernorm`` on the MoE output, ``moe_out_norm``, and on a
dense layer's MLP output, ``dense_out_norm``), the MLP / MoE block reading ``pre_mlp_layernorm``.
Attention: per-head q/k RMSNorm, an output gate σ(W_g x) per channel (``self_attn.gate_proj``),
sliding-window layers with RoPE and full-attention layers without it (``layer_types``, else every
``global_attn_every_n_layers``-th layer full). The router: float32 σ(W_r y), top-k chosen on σ + the
block's ``expert_bias`` (no groups), the chosen σ renormalised (+1e-20) and × ``route_scale``; an
ungated shared MLP of ``num_shared_experts`` × ``moe_intermediate_size``; the first
``num_dense_layers`` layers dense. ``mup_enabled`` scales the embeddings by √hidden_size. The
backward takes dL/d(MoE output) through its norm as for A.X-K1 (:mod:`moeaudit.families.axk1`)."""

from __future__ import annotations

import math
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, attention_by_type, sliding_window
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, SHARED_EXPERTS, hf_layout
from moeaudit.spec.settings import AttentionVariant

KINDS = ("sliding_attention", "full_attention")


def _layer_types(c: Ctx) -> list[str]:
    """``layer_types``, else AfmoeConfig's rule: layer i full when (i + 1) is a multiple of
    ``global_attn_every_n_layers`` (default 4), sliding otherwise."""
    types = c.cfg.get("layer_types")
    if types is None:
        every = c.get("global_attn_every_n_layers", int, 4)
        if every < 1:
            raise CheckpointError(f"config.json: global_attn_every_n_layers must be ≥ 1, got {every}", path=c.path)
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(c.num_layers)]
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= set(KINDS):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} layers, each 'sliding_attention' or 'full_attention'",
            path=c.path,
        )
    return types


def _fields(c: Ctx) -> dict[str, Any]:
    types = _layer_types(c)
    window = sliding_window(c) if "sliding_window" in c.cfg else 1024
    dense = c.get("num_dense_layers", int, 1)
    shared = c.get("num_shared_experts", int, 2)
    head = c.get("head_dim", int, 128)
    if head < 1:
        raise CheckpointError(f"config.json: head_dim must be ≥ 1, got {head}", path=c.path)
    return {
        "head_dim": head,
        "routed_layers": tuple(range(min(dense, c.num_layers), c.num_layers)),
        "norm_topk_prob": True,
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 6144),
        "shared_dim": shared * c.get("moe_intermediate_size", int),
        "shared_gated": False,
        # RoPE on sliding layers only; a null window: transformers' sliding mask then masks nothing beyond causal
        **attention_by_type(
            types,
            {"sliding_attention": AttentionVariant(window=window), "full_attention": AttentionVariant(rope=False)},
        ),
        "gate": Gate(scoring="sigmoid", selection_bias=True, scaling=c.get("route_scale", float, 1.0)),
        "output_gate": "sigmoid",
        "attn_out_norm": True,
        "moe_out_norm": True,
        "dense_out_norm": True,
        "embedding_multiplier": math.sqrt(c.get("hidden_size", int)) if c.get("mup_enabled", bool, False) else 1.0,
    }


LAYOUT = hf_layout(
    "afmoe",
    {
        **ATTN,
        "attn_out_norm": "post_attention_layernorm.weight",
        "post_norm": "pre_mlp_layernorm.weight",
        "moe_out_norm": "post_mlp_layernorm.weight",
        "g_proj": "self_attn.gate_proj.weight",
        "router": "mlp.router.gate.weight",
        "router_bias": "mlp.expert_bias",
        **SHARED_EXPERTS,
        **DENSE_MLP,
    },
    notes="sandwich norms (attention, MLP and MoE outputs normed before the residual add); per-head q/k norm, "
    "sigmoid output gate, RoPE on sliding layers only; sigmoid router with a selection bias, renormalised and "
    "scaled; ungated shared experts; the first num_dense_layers dense",
)

FAMILY = Family(
    name="afmoe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts", "num_local_experts"),
    default_rms_eps=1e-5,
)
