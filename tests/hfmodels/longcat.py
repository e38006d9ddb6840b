"""A tiny LongCat-Flash (``longcat_flash``) checkpoint config, same conventions as
:mod:`hfmodels.core`: its table, which :mod:`hfmodels` merges into ``REGISTRY``, and its saver."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hfmodels.core import save_tiny

TINY: dict[str, dict[str, Any]] = {
    # 2 decoder layers (num_hidden_layers counts the 4 attention sub-blocks), each two MLA
    # sub-blocks and two dense MLPs around the shortcut MoE: top-2 of 6 parametric + 2
    # zero-computation experts, a selection bias, combine weights × 2.5
    "longcat_flash": dict(
        num_hidden_layers=4,
        num_key_value_heads=4,  # MLA expands every head from the latent
        n_routed_experts=6,
        zero_expert_num=2,
        moe_topk=2,
        expert_ffn_hidden_size=24,
        ffn_hidden_size=40,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        head_dim=4,
        v_head_dim=6,
        routed_scaling_factor=2.5,
    ),
}


def save_longcat(path: Path, dtype: torch.dtype | None = None, **overrides: Any) -> None:
    """``save_tiny`` with, in the file, the selection bias scaled to std 0.02 and the sub-block norm
    gains redrawn near 1 (``hfmodels.core`` draws gains by the name ending "norm.weight", which
    ``input_layernorm.0.weight`` does not have, so they came out as biases, near 0)."""
    save_tiny(path, "longcat_flash", dtype=dtype, **overrides)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(2)
    for key in sorted(tensors):
        t = tensors[key]
        if key.endswith("e_score_correction_bias"):
            tensors[key] = t * 0.1
        elif re.search(r"layernorm\.[01]\.weight$", key):
            tensors[key] = (1.0 + 0.2 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, file, metadata={"format": "pt"})
