"""GLM-4.5V / GLM-4.6V (``glm4v_moe``): a vision-language checkpoint whose text decoder is
GLM-4.5's architecture (:mod:`moeaudit.families.glm4_moe`), replayed from ``text_config`` and
``model.language_model.*``. The text config has no ``use_qk_norm`` (never a q/k norm) and no MTP
count (none by default); its multimodal RoPE (``mrope_section`` over the rotary half of each
head) is ordinary partial RoPE on text, where the three position streams are equal. The vision
tower ``model.visual.*`` is left out (the canary is text)."""

from __future__ import annotations

from typing import Any

from moeaudit.families import glm4_moe
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import Ctx, text_config


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        **glm4_moe.FAMILY.fields(c),
        "qk_norm": "none",
        "mtp_layers": int(c.get("num_nextn_predict_layers", int, 0)),
    }


FAMILY = wrapped(
    glm4_moe.FAMILY,
    "glm4v_moe",
    bases=("model.language_model.",),
    heads=("lm_head.weight",),
    audits="the text decoder (GLM-4.5 MoE architecture) of the GLM-4.5V vision-language model",
    left_out={"model.visual.": "vision encoder model.visual.*"},
    fields=_fields,
    decoder_config=text_config,
)
