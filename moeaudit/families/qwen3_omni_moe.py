"""Qwen3-Omni-MoE (``qwen3_omni_moe``): an omni (text, audio, vision in; text and speech out)
checkpoint whose thinker's text decoder is Qwen3-MoE's architecture, replayed from
``thinker_config.text_config`` and ``thinker.model.*`` (the released names, which transformers 5.24
also saves; ``thinker.model.language_model.*``, its module names, read too) / ``thinker.lm_head``. The differences from
``qwen3_moe`` are in the config class: ``norm_topk_prob`` defaults to true, θ to 1e6, and the
attention never uses a window (the thinker's attention sets none whatever ``sliding_window``
says). Its multimodal RoPE (``mrope_section``) gives every frequency the same position on text,
where the position streams are equal: ordinary RoPE. The audio and vision towers, the talker
(speech-code generator, a MoE of its own) and code2wav are left out: the canary is text and the
receipts audit the thinker's next-token prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import qwen3_moe
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import Ctx, sparse_step_layers


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": sparse_step_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 0),
    }


def _thinker_text(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    thinker = cfg.get("thinker_config")
    text = thinker.get("text_config") if isinstance(thinker, dict) else None
    if not isinstance(text, dict):
        raise CheckpointError(
            "config.json: model_type 'qwen3_omni_moe' needs a thinker_config object with a text_config object",
            path=path,
        )
    assert isinstance(thinker, dict)
    return {**text, "tie_word_embeddings": thinker.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


FAMILY = wrapped(
    qwen3_moe.FAMILY,
    "qwen3_omni_moe",
    bases=("thinker.model.", "thinker.model.language_model."),
    heads=("thinker.lm_head.weight",),
    audits="the thinker's text decoder (Qwen3-MoE architecture) of the Qwen3-Omni-MoE omni model",
    left_out={
        "thinker.audio_tower.": "audio encoder thinker.audio_tower.*",
        "thinker.visual.": "vision encoder thinker.visual.*",
        "thinker.model.audio_tower.": "audio encoder thinker.model.audio_tower.*",
        "thinker.model.visual.": "vision encoder thinker.model.visual.*",
        "talker.": "talker (speech-code generator) talker.*",
        "code2wav.": "speech decoder code2wav.*",
    },
    fields=_fields,
    decoder_config=_thinker_text,
    default_rope_theta=1e6,
)
