"""Helpers of tests/test_oracle_afmoe.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from support.oracle import Observed, transformers_observed  # noqa: E402


def afmoe_observed(model: Any, tokens_WT: torch.Tensor) -> Observed:
    """transformers' side: the MoE input h is what ``pre_mlp_layernorm`` reads (AFMoE's
    ``post_attention_layernorm`` norms the attention output), and the attention gradient norm
    takes in that norm's gain."""
    layers = model.model.layers
    routed = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    seen: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Any:
        def hook(_module: Any, args: Any, _out: Any) -> None:
            seen[i] = args[0].detach().flatten(0, -2)

        return hook

    hooks = [layers[i].pre_mlp_layernorm.register_forward_hook(keep(i)) for i in routed]
    try:
        ref = transformers_observed(model, tokens_WT, gate="router")
    finally:
        for h in hooks:
            h.remove()
    ref.moe_inputs = seen
    for i in routed:
        parts = ("self_attn.", "input_layernorm.", "post_attention_layernorm.")
        grads = [p.grad for n, p in layers[i].named_parameters() if n.startswith(parts) and p.grad is not None]
        ref.attention_grads[i] = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
    return ref
