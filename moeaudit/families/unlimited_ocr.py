"""Unlimited-OCR (``unlimited_ocr``): an OCR vision-language checkpoint whose text decoder is
DeepSeek-OCR-2's (:mod:`moeaudit.families.deepseek_ocr2`: DeepSeek-V2's MoE on Llama attention,
the same transformers classes) with two configuration differences: ``mlp_layer_types`` defaults
to dense below ``first_k_dense_replace`` (default 1) and sparse above, and its layers are
"reference_sliding_attention": a window of ``sliding_window`` tokens widened by every token of
the prefill, i.e. during a whole-sequence forward (what the canary replays, and what training
computes) plain causal attention; "full_attention" layers are causal too. Replayed from
``text_config`` and ``model.layers.*`` (released and saved) or ``model.language_model.*``; the SAM
and CLIP-style vision encoders, the projector, ``image_newline`` and the view separator are left
out."""

from __future__ import annotations

import dataclasses
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import deepseek_ocr2
from moeaudit.families.base import Ctx

LAYER_TYPES = ("reference_sliding_attention", "full_attention")


def _fields(c: Ctx) -> dict[str, Any]:
    types = c.cfg.get("layer_types")
    if types is not None and (
        not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= set(LAYER_TYPES)
    ):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} of {' / '.join(LAYER_TYPES)}", path=c.path
        )
    first = c.get("first_k_dense_replace", int, 1)
    return deepseek_ocr2.fields(c, ["sparse" if i >= first else "dense" for i in range(c.num_layers)])


AUDITS = "the text decoder (DeepSeek-V2 MoE on Llama attention) of the Unlimited-OCR vision-language model"
FAMILY = dataclasses.replace(
    deepseek_ocr2.FAMILY,
    name="unlimited_ocr",
    fields=_fields,
    audits=AUDITS,
    layout=dataclasses.replace(
        deepseek_ocr2.LAYOUT,
        family="unlimited_ocr",
        notes=AUDITS + "; softmax greedy / group-limited top-k, not renormalised, scaled; shared experts; "
        "reference-sliding layers causal over the whole sequence",
        left_out={
            "model.sam_model.": "SAM vision encoder",
            "model.vision_model.": "CLIP vision encoder",
            "model.vision_tower.": "vision tower",
            "model.projector.": "multi-modal projector",
            "model.multi_modal_projector.": "multi-modal projector",
            "model.image_newline": "image newline",
            "model.view_seperator": "view separator",
            "model.view_separator": "view separator",
        },
    ),
)
