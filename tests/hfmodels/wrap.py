"""Tiny wrapper checkpoints around replayed text decoders: ``nemotron_h_omni`` and
``nemo_speechlm`` around :mod:`hfmodels.nemotron`'s tiny Nemotron-H, ``hy_v4_vl`` around
:mod:`hfmodels.hy_v4`'s tiny HY-V4, each saved by transformers' own wrapper class with one-block
vision / audio parts; and a view that lets the text decoder's oracle (Nemotron-H's and HY-V4's
``hf_observed`` / ``hy_v4_observed``) read the wrapper's text decoder while running the
wrapper's own forward on text tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from hfmodels import hy_v4, nemotron
from hfmodels.core import COMMON, VOCAB, redraw


def nemotron_text(**overrides: Any) -> dict[str, Any]:
    """The tiny Nemotron-H config (:mod:`hfmodels.nemotron`) as a wrapper's ``text_config``."""
    cfg = {**COMMON, **nemotron.TINY["nemotron_h"], **overrides}
    return {k: v for k, v in cfg.items() if v is not None}


# HY-V4-VL's multimodal RoPE sections (time, height, width) must sum to qk_rope_head_dim / 2 = 2
HY_V4_VL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]}


def hy_v4_text(**overrides: Any) -> dict[str, Any]:
    """The tiny HY-V4 config (:mod:`hfmodels.hy_v4`) as HY-V4-VL's ``text_config`` (its token ids
    kept at None: HYV4VLTextConfig's defaults are past the tiny vocabulary)."""
    cfg = {**COMMON, **hy_v4.TINY["hy_v4"], "rope_parameters": HY_V4_VL_ROPE, **overrides}
    return {k: v for k, v in cfg.items() if v is not None or k.endswith("token_id")}


# RADIO with one block of width 16 (patches of 4 on 16-pixel images), one Parakeet block
_RADIO = dict(
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    patch_size=4,
    image_size=16,
    max_img_size=32,
    num_cls_tokens=1,
    num_registers=1,
    video_temporal_patch_size=2,
)
_PARAKEET = dict(
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=16,
    subsampling_conv_channels=4,
    num_mel_bins=16,
    projection_hidden_size=16,
    projection_bias=False,
)
# Nemotron 3.5 Transcribe's speech side: one-block recognition and diarization encoders, a
# one-block word-timestamp decoder; its audio token past the text vocabulary, as released
_BLOCK = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
_SPEECH_AUDIO = dict(
    asr_config=dict(_BLOCK, num_mel_bins=16),
    diarization_config=dict(
        audio_config=dict(_BLOCK, num_mel_bins=16),
        head_config=dict(hidden_size=8, audio_hidden_size=16, num_speakers=2),
        streaming_config=dict(num_speakers=2),
    ),
)
_WORD_TIMESTAMP = dict(_BLOCK, vocab_size=10, blank_token_id=9)
# HY-V4-VL's vision tower: one block of width 16, patches of 4
_HY_VISION = dict(
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    out_hidden_size=32,
    patch_size=4,
    max_image_size=32,
)


def _config(wrapper: str, **overrides: Any) -> transformers.PretrainedConfig:
    if wrapper == "hy_v4_vl":
        cfg = transformers.AutoConfig.for_model(wrapper, text_config=hy_v4_text(**overrides), vision_config=_HY_VISION)
    elif wrapper == "nemotron_h_omni":
        cfg = transformers.AutoConfig.for_model(
            wrapper,
            text_config=nemotron_text(**overrides),
            vision_config=_RADIO,
            audio_config=_PARAKEET,
            vision_hidden_size=16,
            projector_hidden_size=16,
        )
    else:
        cfg = transformers.AutoConfig.for_model(
            wrapper,
            text_config=nemotron_text(**overrides),
            audio_config=_SPEECH_AUDIO,
            word_timestamp_config=_WORD_TIMESTAMP,
            audio_token_id=VOCAB,
        )
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    return cfg


CLASSES = {
    "hy_v4_vl": "HYV4VLForConditionalGeneration",
    "nemotron_h_omni": "NemotronH_Omni_Reasoning_V3",
    "nemo_speechlm": "Nemotron3_5TranscribeForConditionalGeneration",
}


def wrapper_model(wrapper: str, *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """The wrapper around its tiny text decoder (``overrides`` its text config), float32, eval."""
    cls = getattr(transformers, CLASSES[wrapper])
    torch.manual_seed(seed)
    model = cls(_config(wrapper, **overrides)).float()
    redraw(model, seed)
    return model.eval()


def save_wrapper(
    path: Path, wrapper: str, *, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any
) -> None:
    model = wrapper_model(wrapper, seed=seed, **overrides)
    (model if dtype is None else model.to(dtype)).save_pretrained(path)  # type: ignore[arg-type]


def load_wrapper(path: Path, wrapper: str) -> transformers.PreTrainedModel:
    cls = getattr(transformers, CLASSES[wrapper])
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# where each wrapper keeps its text decoder's layers, and its parameters' prefix
DECODER = {
    "hy_v4_vl": "model.language_model.",
    "nemotron_h_omni": "language_model.model.",
    "nemo_speechlm": "model.language_model.",
    "step3p7": "model.language_model.",  # saved by hfmodels.step
}


class TextView(torch.nn.Module):
    """A wrapper as Nemotron-H's oracle (``hf_observed``) reads a causal LM: ``model.layers`` the
    text decoder's layers, its parameters named ``model.layers.*``, the forward the wrapper's own
    (text tokens only)."""

    def __init__(self, wrapper: transformers.PreTrainedModel, family: str) -> None:
        super().__init__()
        self.wrapper, self.prefix = wrapper, DECODER[family]
        decoder = wrapper
        for name in self.prefix.strip(".").split("."):
            decoder = getattr(decoder, name)
        self.model = SimpleNamespace(layers=decoder.layers)

    def forward(self, tokens: torch.Tensor, **kwargs: Any) -> Any:
        return self.wrapper(input_ids=tokens, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        for name, p in self.wrapper.named_parameters():
            yield name.replace(self.prefix, "model.", 1), p


SAVERS: dict[str, Callable[[Path], None]] = {f: (lambda p, f=f: save_wrapper(p, f)) for f in CLASSES}
