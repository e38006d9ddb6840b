"""Qwen3-VL-MoE (``qwen3_vl_moe``): a vision-language checkpoint whose text decoder is Qwen3-MoE's
architecture, replayed from ``text_config`` and ``model.language_model.*``. The differences from
``qwen3_moe`` are in the config class: the top-k is always renormalised (the config has no
``norm_topk_prob``), no sliding window, θ default 5e5, and the experts are stored fused: the
released files transposed (``gate_up_proj`` [E, H, 2I], gate columns first; ``down_proj``
[E, I, H]), transformers 5.24's ``save_pretrained`` stacked ([E, 2I, H], [E, H, I]); the stored
shape says which. Its
multimodal RoPE (``mrope_section``, interleaved) gives every frequency the same position on text,
where the three position streams are equal: ordinary RoPE. DeepStack visual features join only
at image tokens. The vision tower ``model.visual.*`` is left out (the canary is text)."""

from __future__ import annotations

from typing import Any

from moeaudit.families import qwen3_moe
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import Ctx, sparse_step_layers, text_config


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": sparse_step_layers(c),
        "norm_topk_prob": True,
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 0),
    }


FAMILY = wrapped(
    qwen3_moe.FAMILY,
    "qwen3_vl_moe",
    bases=("model.language_model.",),
    heads=("lm_head.weight",),
    audits="the text decoder (Qwen3-MoE architecture) of the Qwen3-VL-MoE vision-language model",
    left_out={"model.visual.": "vision encoder model.visual.*"},
    fused_format="stacked_or_transposed",
    fields=_fields,
    decoder_config=text_config,
    default_rope_theta=500000.0,
)
