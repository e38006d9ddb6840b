"""Helpers of tests/test_oracle_nemotron.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from support.oracle import Observed, _cross_entropy, _norm  # noqa: E402


def hf_observed(model: Any, tokens_WT: torch.Tensor) -> Observed:
    """``test_oracle.transformers_observed`` for Nemotron-H's single-block layers: a MoE layer is
    norm → ``mixer`` (router ``mixer.gate``); its token-mixer gradient is its norm's."""
    layers = model.model.layers
    routed = [i for i, layer in enumerate(layers) if layer.block_type == "moe"]
    seen: dict[tuple[str, int], Any] = {}

    def keep(kind: str, i: int):
        def hook(_module, args, out):
            seen[kind, i] = args[0].detach().flatten(0, -2) if kind == "h" else out

        return hook

    hooks = [layers[i].norm.register_forward_hook(keep("h", i)) for i in routed]
    hooks += [layers[i].mixer.gate.register_forward_hook(keep("gate", i)) for i in routed]
    try:
        out = model(tokens_WT, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    nll_WT1, loss, entropy = _cross_entropy(out.logits, tokens_WT)
    loss.backward()
    grads = dict(model.named_parameters())

    def norm(i: int, prefix: str) -> float:
        return _norm([p.grad for n, p in grads.items() if n.startswith(f"model.layers.{i}.{prefix}")])

    experts = {}
    for i in routed:
        e = layers[i].mixer.experts
        experts[i] = sum(p.grad.double().pow(2).flatten(1).sum(1) for p in (e.up_proj, e.down_proj)).sqrt()
    return Observed(
        loss=loss.detach(),
        nll_windows_W=nll_WT1.detach().mean(1),
        entropy=entropy,
        layer_inputs=[h.detach() for h in out.hidden_states],
        moe_inputs={i: seen["h", i] for i in routed},
        scores={i: seen["gate", i][0].detach() for i in routed},
        topk={i: seen["gate", i][2] for i in routed},
        combine={i: seen["gate", i][1].detach() for i in routed},
        expert_grads=experts,
        router_grads={i: norm(i, "mixer.gate.") for i in routed},
        shared_grads={i: norm(i, "mixer.shared_experts.") for i in routed},
        attention_grads={i: norm(i, "norm.") for i in routed},
    )


def worst(ref: Observed, ours: Observed) -> tuple[float, float]:
    """(|NLL difference|, largest relative gradient-norm difference) of one comparison."""
    rel = [
        float(((o.double() - r.double()).abs() / r.double()).max())
        for o, r in ((ours.expert_grads[i], ref.expert_grads[i]) for i in ref.scores)
    ]
    for name in ("router_grads", "shared_grads", "attention_grads"):
        rel += [abs(getattr(ours, name)[i] - w) / w for i, w in getattr(ref, name).items() if w > 1e-6]
    return abs(float(ours.loss) - float(ref.loss)), max(rel)


CASES: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    # Mamba-2, MoE, attention, dense MLP, MoE; top-2 of 4 (one group), renormalised, × 1.5; a
    # shared expert of 40; 2 Mamba groups, chunks of 5 (a 12-token window: 3 chunks, the last padded)
    "nemotron_h": ({}, (3, 12)),
    # MoE first, then Mamba, attention, MoE; top-3 of 8 within the best 1 of 2 groups, not
    # renormalised, unscaled; a narrow shared expert of 16; one Mamba group, unbiased conv, the
    # time step clamped below at 0.05, chunks of 8 (20 tokens: 3 chunks)
    "nemotron_h-top3-of-8-grouped": (
        dict(
            layers_block_type=["moe", "linear_attention", "full_attention", "moe"],
            num_hidden_layers=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            moe_shared_expert_intermediate_size=16,
            n_groups=1,
            use_conv_bias=False,
            time_step_min=0.05,
            chunk_size=8,
        ),
        (2, 20),
    ),
}
