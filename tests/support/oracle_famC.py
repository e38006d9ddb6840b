"""Helpers of tests/test_oracle_famC.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
from support.oracle import (  # noqa: E402
    _norm,
)


def _attention_grads_with_linear_layers(model: Any) -> dict[int, float]:
    """``transformers_observed`` sums ``self_attn.`` and ``input_layernorm.`` gradients; a
    DeltaNet layer's token mixer is ``linear_attn.``, which our attention norm includes."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        out[i] = _norm([p.grad for p in [*mixer.parameters(), *layer.input_layernorm.parameters()]])
    return out
