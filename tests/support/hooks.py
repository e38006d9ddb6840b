"""Helpers of tests/test_hooks.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import torch


def _per_expert_params(prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Per-expert Mixtral names as transformers v4 wrote them, with seeded gradients."""
    gen = torch.Generator().manual_seed(0)
    named = []
    for layer in range(2):
        base = f"{prefix}model.layers.{layer}.block_sparse_moe."
        names = (
            [base + "gate.weight"]
            + [f"{base}experts.{e}.{w}.weight" for e in range(3) for w in ("w1", "w3", "w2")]
            + [f"{prefix}model.layers.{layer}.self_attn.q_proj.weight"]
        )
        for name in names:
            t = torch.zeros(4, 5, requires_grad=True)
            t.grad = torch.randn(4, 5, generator=gen)
            named.append((name, t))
    return named
