"""Tiny Step-3.7 (``step3p7``) checkpoints around a tiny Step 3.5 text decoder (``step3p5``), the
vision tower one small block; ``save_step3p5`` writes the same decoder as a text-only checkpoint
(``text_config`` as config.json, the vision tensors dropped); ``SAVERS`` names both savers for
``hfmodels.save_any``, and :mod:`hfmodels.wrap`'s ``TextView`` reads step3p7's text decoder.
Importing this module needs transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from hfmodels.core import VOCAB, redraw

# 4 layers: sliding (8 heads, RoPE θ 100 on the whole head, a 5-token window < T = 12), full
# (4 heads, θ 1e4 on half the head), sliding, full; the first dense; top-2 of 8 sigmoid with a
# selection bias, one ungated shared expert; 2 kv heads
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts_per_tok=2,
    n_routed_experts=8,
    moe_intermediate_size=24,
    share_expert_dim=40,
    intermediate_size=56,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_sliding_attention_heads=8,
    sliding_window=5,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    max_position_embeddings=64,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    pad_token_id=0,
)
VISION: dict[str, Any] = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    max_position_embeddings=4,
)


def step_model(*, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model("step3p7", text_config={**TEXT, **overrides}, vision_config=VISION)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Step3p7ForConditionalGeneration(config).float()
    redraw(model, seed)
    return model.eval()


def save_step3p7(path: Path, *, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any) -> None:
    model = step_model(seed=seed, **overrides)
    (model if dtype is None else model.to(dtype)).save_pretrained(path)  # type: ignore[arg-type]


def save_step3p5(path: Path, **kwargs: Any) -> None:
    """The text decoder alone: step3p7's files with ``text_config`` as config.json."""
    from safetensors.torch import load_file, save_file

    save_step3p7(path, **kwargs)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg["text_config"]))
    (file,) = path.glob("*.safetensors")
    tensors = {k: v for k, v in load_file(file).items() if k.startswith(("model.", "lm_head."))}
    save_file(tensors, file, metadata={"format": "pt"})


def load_step3p7(path: Path) -> transformers.PreTrainedModel:
    return transformers.Step3p7ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


SAVERS: dict[str, Callable[[Path], None]] = {
    "step3p7": lambda p: save_step3p7(p),
    "step3p5": lambda p: save_step3p5(p),
}
