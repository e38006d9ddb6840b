"""Nemotron 3.5 Transcribe (``nemo_speechlm``, transformers'
``Nemotron3_5TranscribeForConditionalGeneration``): a speech-language checkpoint whose text
decoder is Nemotron-H's (:mod:`moeaudit.families.nemotron_h`), replayed from ``text_config``.
transformers 5.24's ``save_pretrained`` writes NVIDIA's NeMo export names, as released:
``llm.model.embed_tokens``, ``llm.model.layers.*`` (the Mamba-2 mixer's ``A_log``, ``D`` and
``dt_bias`` under ``mixer._fp32_params.``), ``llm.model.norm`` and ``llm.lm_head``; its module
names (``model.language_model.embeddings`` / ``layers.*`` / ``norm_f``, ``lm_head``) are read as
well. The speech recognition and diarization encoders (``perception.*``), their projector and the
word-timestamp decoder (``ctc_timestamp.*``) are left out (the canary is text)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from moeaudit.families import nemotron_h
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import text_config

NEMO = "llm.model."


def _decoder_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """``text_config`` read as Nemotron-H reads its config (legacy keys, the block pattern)."""
    read = nemotron_h.FAMILY.decoder_config
    assert read is not None
    return read(text_config(cfg, path), path)


_WRAPPED = wrapped(
    nemotron_h.FAMILY,
    "nemo_speechlm",
    bases=(NEMO, "model.language_model."),
    roots=("backbone.", "model."),
    heads=("llm.lm_head.weight", "lm_head.weight"),
    audits="the text decoder (nemotron_h: Mamba-2, attention and ReLU² MoE layers) of the Nemotron 3.5 "
    "Transcribe speech-language model",
    left_out={
        "llm.mtp.": "the multi-token-prediction layers (not part of the decoder's loss)",
        "perception.": "speech encoders (recognition, diarization) and their projector",
        "model.audio_tower.": "speech encoders (recognition, diarization)",
        "model.multi_modal_projector.": "speech projector",
        "ctc_timestamp.": "word-timestamp decoder",
        "model.word_timestamp_encoder.": "word-timestamp decoder",
        "word_timestamp_head.": "word-timestamp decoder",
    },
    decoder_config=_decoder_config,
)
_LAY = _WRAPPED.layout
# NeMo's names for the embedding, the final norm and the Mamba-2 float32 parameters
_GLOBALS = {"embed": ("embed_tokens.weight", "embeddings.weight"), "final_norm": ("norm.weight", "norm_f.weight")}
_FP32 = {"ssm_A_log": "A_log", "ssm_D": "D", "ssm_dt_bias": "dt_bias"}

FAMILY = dataclasses.replace(
    _WRAPPED,
    layout=dataclasses.replace(
        _LAY,
        globals={**_LAY.globals, **{n: (NEMO + k, f"model.language_model.{m}") for n, (k, m) in _GLOBALS.items()}},
        layer={
            **_LAY.layer,
            **{n: (f"{NEMO}layers.{{layer}}.mixer._fp32_params.{k}", *_LAY.layer[n]) for n, k in _FP32.items()},
        },
    ),
)
