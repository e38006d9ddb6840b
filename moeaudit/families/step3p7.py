"""Step-3.7 (``step3p7``, ``Step3p7ForConditionalGeneration``): a vision-language checkpoint whose
text decoder is Step 3.5's (:mod:`moeaudit.families.step3p5`), replayed from ``text_config``
(model_type ``step3p5``) and ``model.*`` (what transformers 5.24's ``save_pretrained`` writes: the
released names, which transformers moves under ``model.language_model.`` on load) or
``model.language_model.*``; the LM head is ``lm_head``. The vision tower and projector
(``vision_model.*``, ``vit_large_projector.*`` as saved; ``model.vision_model.*``,
``model.multi_modal_projector.*`` as named in memory) are left out (the canary is text)."""

from __future__ import annotations

from moeaudit.families import step3p5
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import text_config

FAMILY = wrapped(
    step3p5.FAMILY,
    "step3p7",
    bases=("model.", "model.language_model."),
    heads=("lm_head.weight",),
    audits="the text decoder (step3p5) of the Step-3.7 vision-language model",
    left_out={
        "vision_model.": "vision tower",
        "vit_large_projector.": "vision projector",
        "model.vision_model.": "vision tower",
        "model.multi_modal_projector.": "vision projector",
    },
    decoder_config=text_config,
)
