"""Nemotron 3 Nano Omni (``nemotron_h_omni``, transformers' ``NemotronH_Omni_Reasoning_V3``): a
multimodal checkpoint whose text decoder is Nemotron-H's (:mod:`moeaudit.families.nemotron_h`),
replayed from ``text_config`` (``llm_config`` in the released configs, which transformers reads
as ``text_config``) and ``language_model.backbone.*`` (what transformers 5.24's
``save_pretrained`` writes, as released) or ``language_model.model.*`` (its module names); the
LM head is ``language_model.lm_head``. The RADIO vision tower, its final norm and projector
(``mlp1``), and the Parakeet sound encoder and its projection are left out (the canary is
text)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.families import nemotron_h
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import text_config


def _decoder_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """``text_config``, else the legacy ``llm_config`` (transformers' ``_legacy_field_names``:
    used where ``text_config`` is unset), read as Nemotron-H reads its config."""
    if cfg.get("text_config") is None and isinstance(cfg.get("llm_config"), dict):
        cfg = {**cfg, "text_config": cfg["llm_config"]}
    read = nemotron_h.FAMILY.decoder_config
    assert read is not None
    return read(text_config(cfg, path), path)


FAMILY = wrapped(
    nemotron_h.FAMILY,
    "nemotron_h_omni",
    bases=("language_model.backbone.", "language_model.model."),
    roots=("backbone.", "model."),
    heads=("language_model.lm_head.weight",),
    audits="the text decoder (nemotron_h: Mamba-2, attention and ReLU² MoE layers) of the Nemotron-H Omni "
    "multimodal model",
    left_out={
        "language_model.mtp.": "the multi-token-prediction layers (not part of the decoder's loss)",
        "vision_model.": "vision tower (RADIO)",
        "vision_final_layernorm.": "vision tower's final norm",
        "mlp1.": "vision projector",
        "multi_modal_projector.": "vision projector",
        "sound_encoder.": "sound encoder (Parakeet)",
        "audio_tower.": "sound encoder (Parakeet)",
        "sound_projection.": "sound projector",
        "embed_audio.": "sound projector",
    },
    decoder_config=_decoder_config,
)
