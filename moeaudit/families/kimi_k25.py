"""Kimi-K2.5 (``kimi_k25``): a vision-language checkpoint whose text decoder is DeepSeek-V3's
architecture (``text_config`` of model_type ``deepseek_v3``, or ``kimi_k2`` in the released
configs), replayed as :mod:`moeaudit.families.deepseek_v3` from ``language_model.model.*`` (the
released names), ``model.language_model.*`` (transformers' module names) or
``language_model.model.blocks.*`` (what transformers 5.24's ``save_pretrained`` writes); the
vision tower and the projector are left out (the canary is text)."""

from __future__ import annotations

from moeaudit.families import deepseek_v3
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import text_config

FAMILY = wrapped(
    deepseek_v3.FAMILY,
    "kimi_k25",
    bases=("language_model.model.", "model.language_model."),
    layers=("language_model.model.blocks.",),
    heads=("language_model.lm_head.weight", "lm_head.weight"),
    audits="the text decoder (DeepSeek-V3 architecture) of the Kimi-K2.5 vision-language model",
    left_out={
        "vision_tower.": "vision tower",
        "model.vision_tower.": "vision tower",
        "mm_projector.": "multi-modal projector",
        "model.mm_projector.": "multi-modal projector",
    },
    decoder_config=text_config,
)
