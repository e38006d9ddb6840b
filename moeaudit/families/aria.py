"""Aria (``aria``): a vision-language checkpoint whose text decoder is
:mod:`moeaudit.families.aria_text`, replayed from ``text_config`` and ``model.language_model.*``
(what transformers 5.24 saves) or ``language_model.model.*`` (the released files, which
transformers renames on load as it does LLaVA's); the LM head is ``lm_head`` or
``language_model.lm_head``. The vision tower and the multi-modal projector are left out (the
canary is text)."""

from __future__ import annotations

from moeaudit.families import aria_text
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import text_config

FAMILY = wrapped(
    aria_text.FAMILY,
    "aria",
    bases=("model.language_model.", "language_model.model."),
    heads=("lm_head.weight", "language_model.lm_head.weight"),
    audits="the text decoder (aria_text: Mixtral routing with shared experts) of the Aria vision-language model",
    left_out={
        "model.vision_tower.": "vision tower",
        "vision_tower.": "vision tower",
        "model.multi_modal_projector.": "multi-modal projector",
        "multi_modal_projector.": "multi-modal projector",
    },
    decoder_config=text_config,
)
