"""Helpers of tests/test_oracle_longcat.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from support.oracle import Observed, _cross_entropy, _norm  # noqa: E402


def longcat_observed(model: Any, tokens_WT: torch.Tensor) -> Observed:
    """transformers' side, as ``transformers_observed`` forms it for the other families, but h is
    what ``post_attention_layernorm[0]`` reads (the norms are module lists), the expert norms are
    the parametric experts' (the fused ``gate_up_proj`` has rows for the identity experts, whose
    gradient is 0), and the attention norm is both sub-blocks' and both input norms'."""
    layers = model.model.layers
    seen: dict[tuple[str, int], Any] = {}

    def keep(kind: str, i: int) -> Any:
        def hook(_module: Any, args: Any, out: Any) -> None:
            seen[kind, i] = args[0].detach().flatten(0, -2) if kind == "h" else out

        return hook

    hooks = [layer.post_attention_layernorm[0].register_forward_hook(keep("h", i)) for i, layer in enumerate(layers)]
    hooks += [layer.mlp.router.register_forward_hook(keep("gate", i)) for i, layer in enumerate(layers)]
    try:
        out = model(tokens_WT, output_hidden_states=True, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    nll_WT1, loss, entropy = _cross_entropy(out.logits, tokens_WT)
    loss.backward()
    routed = range(len(layers))
    expert_grads, attention_grads, router_grads = {}, {}, {}
    for i, layer in enumerate(layers):
        experts = layer.mlp.experts
        E = experts.num_routed_experts
        sq = experts.down_proj.grad.double().pow(2).flatten(1).sum(1)
        sq = sq + experts.gate_up_proj.grad[:E].double().pow(2).flatten(1).sum(1)
        assert float(experts.gate_up_proj.grad[E:].abs().sum()) == 0.0  # the identity experts' unused rows
        expert_grads[i] = sq.sqrt()
        parts = ("self_attn.", "input_layernorm.")
        attention_grads[i] = _norm([p.grad for n, p in layer.named_parameters() if n.startswith(parts)])
        router_grads[i] = _norm([p.grad for p in layer.mlp.router.parameters()])
    return Observed(
        loss=loss.detach(),
        nll_windows_W=nll_WT1.detach().mean(1),
        entropy=entropy,
        layer_inputs=[h.detach() for h in out.hidden_states],
        moe_inputs={i: seen["h", i] for i in routed},
        scores={i: logits.detach() for i, logits in zip(routed, out.router_logits, strict=True)},
        topk={i: seen["gate", i][2] for i in routed},
        combine={i: seen["gate", i][1].detach() for i in routed},
        expert_grads=expert_grads,
        router_grads=router_grads,
        shared_grads={i: 0.0 for i in routed},
        attention_grads=attention_grads,
    )
