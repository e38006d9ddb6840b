"""Tiny transformers checkpoints of the model types moeaudit replays as another family's decoder
(vision-language wrappers: their text decoder as in :mod:`hfmodels.base`, plus a one-block
vision tower) and relabelled text models; and ``glm4_moe_lite``'s table, which :mod:`hfmodels`
merges into ``REGISTRY``. Same conventions as :mod:`hfmodels.core` (seeded weights re-drawn at
std 1/√fan_in, float32 eval mode, eager attention). Importing this module needs transformers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from hfmodels.base import TINY as BASE
from hfmodels.core import COMMON, redraw

TINY: dict[str, dict[str, Any]] = {
    # GLM-4.7-Flash: DeepSeek-V3's MLA tiny config with GLM's router defaults (one group)
    "glm4_moe_lite": {
        k: v for k, v in BASE["deepseek_v3"].items() if k not in ("first_k_dense_replace", "num_nextn_predict_layers")
    },
}

# the text decoder of each wrapper: its text family's tiny config, minus keys the text config lacks
TEXT: dict[str, tuple[str, tuple[str, ...]]] = {
    "kimi_k25": ("deepseek_v3", ()),
    "qwen3_vl_moe": ("qwen3_moe", ()),
    "glm4v_moe": ("glm4_moe", ("use_qk_norm", "num_nextn_predict_layers", "partial_rotary_factor")),
}
# GLM-4.5V's multimodal RoPE: 16-dim heads, the first half rotated, its 4 frequencies split 2/1/1
# over the temporal, height and width streams
GLM4V_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}
_SMALL = dict(
    depth=1,
    num_hidden_layers=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=2,
    num_attention_heads=2,
    out_hidden_size=32,
    pos_emb_height=4,
    pos_emb_width=4,
    num_position_embeddings=16,
)


def text_config(wrapper: str, **overrides: Any) -> dict[str, Any]:
    family, drop = TEXT[wrapper]
    cfg = {**COMMON, **BASE[family]}
    if wrapper == "glm4v_moe":
        cfg.update(head_dim=16, rope_parameters=GLM4V_ROPE)
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if k not in drop}


def wrapper_model(wrapper: str, *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    default = transformers.AutoConfig.for_model(wrapper)
    vision = {k: v for k, v in _SMALL.items() if k in default.vision_config.to_dict()}
    extra: dict[str, Any] = {}
    if wrapper == "kimi_k25":
        extra = dict(projection_hidden_size=16, tie_word_embeddings=False)
    config = transformers.AutoConfig.for_model(
        wrapper, text_config=text_config(wrapper, **overrides), vision_config=vision, **extra
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


def load_wrapper(path: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


class TextView(torch.nn.Module):
    """A wrapper model as ``transformers_observed`` reads a causal LM: ``model.layers``
    its text decoder's layers, parameters named ``model.layers.*``, the forward the wrapper's own
    (text tokens only)."""

    def __init__(self, wrapper: transformers.PreTrainedModel) -> None:
        super().__init__()
        self.wrapper = wrapper
        self.model = SimpleNamespace(layers=wrapper.model.language_model.layers)

    def forward(self, tokens: torch.Tensor, **kwargs: Any) -> Any:
        return self.wrapper(input_ids=tokens, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        for name, p in self.wrapper.named_parameters():
            yield name.replace("model.language_model.", "model.", 1), p


def relabel(path: Path, model_type: str) -> None:
    """Rewrite a saved checkpoint's config.json under another ``model_type`` (kimi_k2)."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = model_type
    cfg_path.write_text(json.dumps(cfg))
