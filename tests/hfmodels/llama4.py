"""The tiny Llama 4 vision-language checkpoint (``llama4``): ``llama4_text``'s tiny decoder of
:mod:`hfmodels.base` inside Llama4ForConditionalGeneration with a one-block vision tower."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from hfmodels.core import redraw, tiny_config


def save_llama4(path: Path) -> None:
    """Llama4ForConditionalGeneration as Scout and Maverick are released (tests/test_oracle_llama4.py)."""
    text = tiny_config("llama4_text").to_dict()
    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        image_size=28,
        patch_size=14,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).float()
    redraw(model, 0)
    model.save_pretrained(path)
