"""Tiny random Hugging Face MoE models: the builders every family group shares.

The weights are re-drawn after transformers' own init (which gives std-0.02 matrices, unit
norm gains and zero biases): matrices at std 1/sqrt(fan_in) so routing is decisive and
activations are O(1), gains near 1 and small non-zero biases so that a wrong norm or a
dropped bias shows up in the numbers instead of hiding behind an identity.

A family's tiny configuration is ``COMMON`` updated with its entry in ``hfmodels.REGISTRY``
(looked up when a model is built). Importing this module needs transformers; test modules
guard with ``pytest.importorskip("transformers")`` first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import transformers

import hfmodels

VOCAB = 96

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    num_experts_per_tok=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# norm gains whose names do not end in "norm.weight" (DBRX's norm_1 / norm_2 / norm_f, Nemotron-H's
# final norm_f): the first rule below draws them as biases, near 0; the second pass redraws them
# near 1
_GAINS = re.compile(r"\.norm_(1|2|f)\.weight$")


def tiny_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    kwargs = {**COMMON, **hfmodels.REGISTRY[family], **overrides}
    return transformers.AutoConfig.for_model(family, **kwargs)


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter from ``seed``, then (from ``seed + 1``) the gains ``_GAINS`` names
    near 1 and a real selection bias for LFM2-MoE (``expert_bias``, a buffer left at zero by
    transformers' init). One rule for every family, so a family's weights do not depend on
    which other family groups a test session happened to import."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() >= 2:
            p.copy_(noise / p.shape[-1] ** 0.5)
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        else:  # biases
            p.copy_(0.1 * noise)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 selection bias (fp32 buffer)
            b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    for name, p in sorted(model.named_parameters(remove_duplicate=False)):
        if name.endswith("e_score_correction_bias"):  # ERNIE 4.5: a frozen parameter, [1, E]
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in sorted(model.named_parameters()):
        if _GAINS.search(name):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    for name, b in sorted(model.named_buffers()):
        if name.endswith("feed_forward.expert_bias"):  # LFM2-MoE's selection bias (zeros at init)
            b.copy_(0.2 * torch.randn(b.shape, generator=gen))


def tiny_model(family: str, *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A float32, eval-mode, eager-attention causal LM with seeded random weights."""
    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    redraw(model, seed)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def save_tiny(
    path: Path,
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Save a tiny model with ``save_pretrained`` (optionally cast and sharded); return it."""
    model = tiny_model(family, seed=seed, **overrides)
    to_save = model if dtype is None else tiny_model(family, seed=seed, **overrides).to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    to_save.save_pretrained(path, **kwargs)
    return model


def load(path: Path) -> transformers.PreTrainedModel:
    """Load a checkpoint back into a float32, eval-mode, eager-attention HF model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def random_tokens(windows: int = 3, length: int = 12, *, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    """A seeded ``[W, T]`` int64 token block (a canary stand-in)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (windows, length), generator=gen)
