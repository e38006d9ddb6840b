"""Helpers of tests/test_oracle_llama4.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from moeaudit.checkpoint import Checkpoint  # noqa: E402
from support.oracle import transformers_observed  # noqa: E402


def _chosen(top_k: int):
    """Llama4Router returns (scores [N, E]: σ of the chosen logits, 0 elsewhere; logits)."""

    def chosen(out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        scores, logits = out
        idx = logits.topk(top_k, dim=1).indices
        return idx, scores.gather(1, idx)

    return chosen


def hf_observed(model: Any, ckpt: Checkpoint, tokens: torch.Tensor):
    return transformers_observed(model, tokens, moe="feed_forward", gate="router", chosen=_chosen(ckpt.spec.top_k))
