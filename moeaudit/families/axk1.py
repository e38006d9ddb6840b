"""A.X-K1 (``axk1``): DeepSeek-V3's decoder (:mod:`moeaudit.families.deepseek_v3`: MLA with
interleaved RoPE, YaRN with the softmax-scale mscale, the sigmoid router with a selection bias and
top-2-sum groups, renormalised, × ``routed_scaling_factor``, shared experts) with one delta: the
MoE block's output, routed plus shared, passes an RMSNorm (``post_mlp_layernorm``) before the
residual add (``LayerSettings.moe_out_norm``; the backward takes dL/d(MoE output) through it). Dense
and sparse layers from ``mlp_layer_types``, or as transformers converts the legacy keys: sparse
from ``first_k_dense_replace`` (default 1) on every ``moe_layer_freq``-th layer (default 1). The
released files store the norm at the layer (``post_mlp_layernorm``), transformers' module under
the MoE block (``mlp.post_mlp_layernorm``); they also hold it on dense layers, which do not use it
(left out, as transformers ignores it). No MTP layers."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import deepseek_v3
from moeaudit.families.base import Ctx, Family, mlp_layer_types, parse_mla
from moeaudit.spec.layouts import DEEPSEEK_LAYER, L, hf_layout


def _every_freq(c: Ctx) -> tuple[int, ...]:
    """Every ``moe_layer_freq``-th layer from ``first_k_dense_replace`` routed."""
    first, freq = c.get("first_k_dense_replace", int, 1), c.get("moe_layer_freq", int, 1)
    if freq < 1:
        raise CheckpointError(f"config.json: moe_layer_freq must be ≥ 1, got {freq}", path=c.path)
    return tuple(i for i in range(c.num_layers) if i >= first and i % freq == 0)


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        **deepseek_v3.FAMILY.fields(c),
        "routed_layers": mlp_layer_types(c, default=lambda: _every_freq(c)),
        "mtp_layers": 0,
        "moe_out_norm": True,
    }


LAYOUT = hf_layout(
    "axk1",
    {**DEEPSEEK_LAYER, "moe_out_norm": ("post_mlp_layernorm.weight", "mlp.post_mlp_layernorm.weight")},
    notes="MLA attention; sigmoid scores, selection bias, group-limited top-k, scaled combine weights; shared "
    "experts; an RMSNorm on the MoE output; mlp_layer_types dense/sparse layers",
    left_out={
        L + "post_mlp_layernorm.": "the MoE-output norm stored on dense layers (transformers ignores it)",
        L + "mlp.post_mlp_layernorm.": "the MoE-output norm stored on dense layers (transformers ignores it)",
    },
)

# the settings DeepSeek-V3's family refuses; moe_layer_freq is read here (transformers converts it)
FAMILY = Family(
    name="axk1",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts", "num_experts"),
    mla=parse_mla,
    refuse=tuple(r for r in deepseek_v3.REFUSE if r.key != "moe_layer_freq"),
)
