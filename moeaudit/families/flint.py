"""Flint (``flint``, Recursive): Qwen3-MoE attention (per-head q/k RMSNorm) with a learned sink
logit per head in every softmax (gpt-oss's ``sinks``, stored as ``self_attn.softmax_offset``),
RoPE on the sliding-window layers only (``layer_types``; full-attention layers have no positional
encoding: ``nope_layers``, as AFMoE);
a float32 sigmoid router without a bias whose top-k is chosen on σ(W_r y) itself
(``sigmoid_select``), the chosen σ renormalised when ``norm_topk_prob``; an ungated shared
expert (``shared_expert_intermediate_size``) added in full; dense layers from Qwen's
``mlp_only_layers`` (default the first two) and ``decoder_sparse_step``."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, attention_by_type, sliding_window
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, hf_layout
from moeaudit.spec.settings import AttentionVariant

KINDS = ("sliding_attention", "full_attention")


def _layer_types(c: Ctx) -> list[str]:
    """``layer_types``, else FlintConfig's rule: full attention on the first two layers, every
    layer i with i % 4 == 1 and the last layer; sliding elsewhere."""
    types = c.cfg.get("layer_types")
    if types is None:
        n = c.num_layers
        return ["full_attention" if i < 2 or i % 4 == 1 or i == n - 1 else "sliding_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= set(KINDS):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} layers, each 'sliding_attention' or 'full_attention'",
            path=c.path,
        )
    return types


def _routed_layers(c: Ctx) -> tuple[int, ...]:
    """Qwen's rule with FlintConfig's default ``mlp_only_layers`` [0, 1] (absent or null)."""
    only = c.cfg.get("mlp_only_layers")
    only = [0, 1] if only is None else only
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError("config.json: mlp_only_layers must be a list of ints", path=c.path)
    step = c.get("decoder_sparse_step", int, 1)
    return tuple(i for i in range(c.num_layers) if i not in only and step > 0 and (i + 1) % step == 0)


def _fields(c: Ctx) -> dict[str, Any]:
    types = _layer_types(c)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = sliding_window(c) if "sliding_window" in c.cfg else 513
    if sliding and window is None:  # transformers' sliding mask would mask nothing beyond causal
        raise CheckpointError("config.json: layer_types name sliding layers but sliding_window is null", path=c.path)
    return {
        "routed_layers": _routed_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 6144),
        "shared_dim": c.get("shared_expert_intermediate_size", int, 1024),
        "shared_gated": False,
        # RoPE on sliding layers only
        **attention_by_type(
            types,
            {"sliding_attention": AttentionVariant(window=window), "full_attention": AttentionVariant(rope=False)},
        ),
        "attention_sinks": True,
        "gate": Gate(scoring="sigmoid"),
        "sigmoid_select": True,
    }


LAYOUT = hf_layout(
    "flint",
    {
        **ATTN,
        **MLP_MOE,
        "sinks": ("self_attn.softmax_offset", "self_attn.sinks"),  # released name first
        "shared_w1": "mlp.shared_expert.gate_proj.weight",
        "shared_w3": "mlp.shared_expert.up_proj.weight",
        "shared_w2": "mlp.shared_expert.down_proj.weight",
        **DENSE_MLP,
    },
    notes="per-head q/k norm, attention sinks, RoPE on sliding layers only; sigmoid router (top-k on σ, no bias), "
    "renormalised; ungated shared expert; mlp_only_layers",
)

FAMILY = Family(
    name="flint",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts",),
    default_rms_eps=1e-6,
)
