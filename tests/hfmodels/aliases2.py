"""Tiny transformers checkpoints of the model types added after the first aliases
(:mod:`hfmodels.aliases`): Granite MoE with a shared MLP or sliding-window layers, and the
wrappers and text decoders below. Same conventions as :mod:`hfmodels.core` (seeded weights
re-drawn at std 1/√fan_in, float32 eval mode, eager attention); ``TINY`` is their table, which
:mod:`hfmodels` merges into ``REGISTRY``. ``SAVERS`` saves a tiny checkpoint of any model type
added here or by :mod:`hfmodels.aliases` (the wrappers and relabelled types ``save_tiny`` cannot
build), for ``hfmodels.save_any``. Importing this module needs transformers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from hfmodels import aliases
from hfmodels.base import TINY as BASE
from hfmodels.core import COMMON, redraw, save_tiny, tiny_config

_GRANITE = dict(embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=6.0)

TINY: dict[str, dict[str, Any]] = {
    # top-2 of 4 plus the shared MLP (gate/up fused, 40 wide), Granite-3.0's four multipliers
    "granitemoeshared": dict(num_local_experts=4, intermediate_size=24, shared_intermediate_size=40, **_GRANITE),
    # 4 layers: full attention on layer 0, a 5-token window on 1-3 (the config's default
    # layer_types), NoPE on layer 2, learned sinks; top-2 of 4 plus the shared MLP
    "granitemoe_swa": dict(
        num_hidden_layers=4,
        num_local_experts=4,
        intermediate_size=24,
        shared_intermediate_size=40,
        sliding_window=5,
        layer_rope_theta=[10000.0, 10000.0, 0, 10000.0],
        **_GRANITE,
    ),
    # Aria's text decoder: top-2 of 4 plus two shared experts (one SwiGLU 2 × 24 wide)
    # (num_experts_per_tok is not this config's key, and COMMON sets it: null)
    "aria_text": dict(
        moe_num_experts=4, moe_topk=2, intermediate_size=24, moe_num_shared_experts=2, num_experts_per_tok=None
    ),
    # DeepSeek-V3's tiny MLA decoder with Mistral 4's router (softmax, 8 experts in 4 groups, best
    # 2 compete), YaRN, and the query scaling switched on from position 4 (β 0.5) within 12 tokens
    "mistral4": {
        **{k: v for k, v in BASE["deepseek_v3"].items() if k != "num_nextn_predict_layers"},
        "routed_scaling_factor": 1.5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4,
            "llama_4_scaling_beta": 0.5,
        },
    },
    # DeepSeek-V3's tiny MLA decoder (8 experts in 4 groups, best 2 compete, selection bias, one
    # shared expert, a dense first layer) with A.X-K1's RMSNorm on the MoE output
    "axk1": {k: v for k, v in BASE["deepseek_v3"].items() if k != "num_nextn_predict_layers"},
}

# wrapper → its text decoder's family in TINY
WRAPPERS: dict[str, str] = {"aria": "aria_text"}
_SMALL_VISION = dict(
    num_hidden_layers=1, hidden_size=16, intermediate_size=16, num_attention_heads=2, image_size=28, patch_size=14
)


def wrapper_text_config(wrapper: str, **overrides: Any) -> dict[str, Any]:
    cfg = {**COMMON, **TINY[WRAPPERS[wrapper]], **overrides}
    return {k: v for k, v in cfg.items() if v is not None or k.endswith("token_id")}


def wrapper_model(wrapper: str, *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A wrapper (vision-language / omni) model around its tiny text decoder, float32, eval, eager."""
    default = transformers.AutoConfig.for_model(wrapper)
    vision = {k: v for k, v in _SMALL_VISION.items() if k in default.vision_config.to_dict()}
    config = transformers.AutoConfig.for_model(
        wrapper, text_config=wrapper_text_config(wrapper, **overrides), vision_config=vision
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    redraw(model, seed)
    return model.eval()


def save_wrapper(
    path: Path, wrapper: str, *, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any
) -> None:
    model = wrapper_model(wrapper, seed=seed, **overrides)
    (model if dtype is None else model.to(dtype)).save_pretrained(path)  # type: ignore[arg-type]


# causal LMs transformers' AutoModelForCausalLM does not map (Mistral 4 only under the pre-training
# and image-text-to-text auto classes)
CAUSAL_LM: dict[str, str] = {"mistral4": "Mistral4ForCausalLM"}


def save_causal(path: Path, family: str, *, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any) -> None:
    """``save_tiny`` through the family's causal-LM class."""
    cls = getattr(transformers, CAUSAL_LM[family])
    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float()
    redraw(model, seed)
    (model if dtype is None else model.to(dtype)).save_pretrained(path)


def load_causal(path: Path, family: str) -> transformers.PreTrainedModel:
    cls = getattr(transformers, CAUSAL_LM[family])
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# Qwen3-Omni-MoE: the thinker's text decoder is the tiny Qwen3-MoE of :mod:`hfmodels.base` with multimodal RoPE
# (interleaved sections), around one-block audio and vision towers; no talker (enable_audio_output off)
OMNI_ROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1], "interleaved": True}
_OMNI_AUDIO = dict(
    encoder_layers=1,
    encoder_attention_heads=2,
    encoder_ffn_dim=16,
    d_model=16,
    output_dim=32,
    num_mel_bins=8,
    downsample_hidden_size=8,
)
_OMNI_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=2,
    out_hidden_size=32,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0],
)


def omni_model(*, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    text = {**COMMON, **BASE["qwen3_moe"], "rope_parameters": OMNI_ROPE, **overrides}
    config = transformers.AutoConfig.for_model(
        "qwen3_omni_moe",
        thinker_config=dict(text_config=text, audio_config=_OMNI_AUDIO, vision_config=_OMNI_VISION),
        enable_audio_output=False,
    )
    config.thinker_config._attn_implementation = "eager"
    config.thinker_config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3OmniMoeForConditionalGeneration(config).float()  # type: ignore[arg-type]
    redraw(model, seed)
    return model.eval()


def save_omni(path: Path, *, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any) -> None:
    model = omni_model(seed=seed, **overrides)
    (model if dtype is None else model.to(dtype)).save_pretrained(path)  # type: ignore[arg-type]


def load_omni(path: Path) -> transformers.PreTrainedModel:
    return transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


class ThinkerView(torch.nn.Module):
    """A Qwen3-Omni-MoE model as ``hf_observed`` (tests/test_oracle_aliases2.py) reads a causal LM: its
    thinker's text decoder layers as ``model.layers``, parameters ``thinker.model.language_model.*`` named
    ``model.*``, the forward the thinker's own (text tokens only)."""

    def __init__(self, omni: Any) -> None:
        super().__init__()
        self.omni = omni
        self.thinker: Any = omni.thinker
        self.model = SimpleNamespace(layers=self.thinker.model.language_model.layers)

    def forward(self, tokens: torch.Tensor, **kwargs: Any) -> Any:
        return self.thinker(input_ids=tokens, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        for name, p in self.omni.named_parameters():
            yield name.replace("thinker.model.language_model.", "model.", 1), p


# DeepSeek-OCR-2: a text decoder of DeepSeek-V2's MoE on Llama attention (8 experts in 4 groups, the
# best 2 compete, two shared experts, a dense first layer) around one-block SAM and Qwen2 encoders
OCR2_TEXT = dict(
    n_routed_experts=8,
    moe_intermediate_size=24,
    intermediate_size=56,
    n_shared_experts=2,
    mlp_layer_types=["dense", "sparse", "sparse"],
    routed_scaling_factor=1.5,
    topk_method="group_limited_greedy",
    n_group=4,
    topk_group=2,
)
_OCR2_VISION = dict(
    sam_config=dict(
        hidden_size=16,
        output_channels=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=64,
        patch_size=16,
        window_size=2,
        global_attn_indexes=[0],
        mlp_dim=16,
        downsample_channels=[16, 32],
    ),
    encoder_config=dict(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        layer_types=["full_attention"],
    ),
)


def save_ocr2(
    path: Path, *, seed: int = 0, dtype: torch.dtype | None = None, model_type: str = "deepseek_ocr2", **overrides: Any
) -> None:
    """A DeepSeek-OCR-2 checkpoint, or with ``model_type`` "unlimited_ocr" an Unlimited-OCR one
    (the same text decoder classes; its own vision towers)."""
    text = {k: v for k, v in {**COMMON, **OCR2_TEXT, **overrides}.items() if v is not None}
    config = transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=_OCR2_VISION)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    redraw(model, seed)
    (model if dtype is None else model.to(dtype)).save_pretrained(path)  # type: ignore[arg-type]


# ERNIE 4.5 VL: the text decoder of the tiny ERNIE 4.5 MoE shape of :mod:`hfmodels.base` (top-2 of 4 text experts 24
# wide, one shared expert, a dense first layer) with a vision group of 4 experts 16 wide, multimodal
# RoPE sections [1, 1, 2] over 8-dim heads, around a one-block vision tower
ERNIE_VL_TEXT = dict(
    moe_num_experts=4,
    moe_k=2,
    moe_intermediate_size=[24, 16],
    intermediate_size=56,
    moe_num_shared_experts=1,
    head_dim=8,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
)


def save_ernie_vl(path: Path, *, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any) -> None:
    text = {k: v for k, v in {**COMMON, **ERNIE_VL_TEXT, **overrides}.items() if k != "num_experts_per_tok"}
    config = transformers.AutoConfig.for_model(
        "ernie4_5_vl_moe",
        text_config=text,
        tie_word_embeddings=text["tie_word_embeddings"],
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2),
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    redraw(model, seed)
    (model if dtype is None else model.to(dtype)).save_pretrained(path)  # type: ignore[arg-type]


def _relabelled(family: str, model_type: str) -> Callable[[Path], None]:
    def save(path: Path) -> None:
        save_tiny(path, family)
        aliases.relabel(path, model_type)

    return save


# model types whose tiny checkpoint is not ``save_tiny(path, model_type)``
SAVERS: dict[str, Callable[[Path], None]] = {
    "kimi_k25": lambda p: aliases.save_wrapper(p, "kimi_k25"),
    "qwen3_vl_moe": lambda p: aliases.save_wrapper(p, "qwen3_vl_moe"),
    "glm4v_moe": lambda p: aliases.save_wrapper(p, "glm4v_moe"),
    "kimi_k2": _relabelled("deepseek_v3", "kimi_k2"),
    "aria": lambda p: save_wrapper(p, "aria"),
    "qwen3_omni_moe": lambda p: save_omni(p),
    "deepseek_ocr2": lambda p: save_ocr2(p),
    "unlimited_ocr": lambda p: save_ocr2(p, model_type="unlimited_ocr", sliding_window=5, num_key_value_heads=4),
    "ernie4_5_vl_moe": lambda p: save_ernie_vl(p),
    **{f: functools.partial(save_causal, family=f) for f in CAUSAL_LM},
}
