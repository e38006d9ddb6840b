"""Helpers of tests/test_oracle_aliases2.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from moeaudit.checkpoint import Checkpoint  # noqa: E402
from support.oracle import FORWARD, GRADIENT, Observed, _cross_entropy, _norm, assert_agree, moeaudit_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek  # noqa: E402
from support.oracle_deepseek import observed as deepseek_observed  # noqa: E402


@dataclass(frozen=True)
class Modules:
    """Where a decoder layer keeps its parts (module attribute names, parameter prefixes)."""

    moe: str = "mlp"  # the MoE block
    gate: str = "gate"  # its router
    pre_norm: str = "post_attention_layernorm"  # the norm whose input is the MoE block's h
    shared: tuple[str, ...] = ()  # the shared expert's parameter prefixes (under the layer)
    mixer: tuple[str, ...] = ("self_attn.", "input_layernorm.")  # the token mixer's, with its norm


def _module(layer: Any, path: str) -> Any:
    """``layer``'s submodule at a dotted path (ERNIE 4.5 VL: ``mlp.text_moe``), None where absent."""
    for name in path.split("."):
        layer = getattr(layer, name, None)
    return layer


def hf_observed(model: Any, tokens_WT: torch.Tensor, m: Modules) -> Observed:
    """``test_oracle.transformers_observed`` for these module names (routers returning
    (logits, combine, top-k))."""
    layers = model.model.layers
    routed = [i for i, layer in enumerate(layers) if hasattr(_module(layer, m.moe), "experts")]
    seen: dict[tuple[str, int], Any] = {}

    def keep(kind: str, i: int):
        def hook(_module, args, out):
            seen[kind, i] = args[0].detach().flatten(0, -2) if kind == "h" else out

        return hook

    hooks = [getattr(layers[i], m.pre_norm).register_forward_hook(keep("h", i)) for i in routed]
    hooks += [_module(layers[i], f"{m.moe}.{m.gate}").register_forward_hook(keep("gate", i)) for i in routed]
    try:
        out = model(tokens_WT, output_hidden_states=True, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    nll_WT1, loss, entropy = _cross_entropy(out.logits, tokens_WT)
    loss.backward()
    grads = dict(model.named_parameters())

    def norm(i: int, *prefixes: str) -> float:
        return _norm([p.grad for n, p in grads.items() if any(n.startswith(f"model.layers.{i}.{x}") for x in prefixes)])

    experts = {}
    for i in routed:
        fused = _module(layers[i], m.moe).experts
        experts[i] = sum(p.grad.double().pow(2).flatten(1).sum(1) for p in (fused.gate_up_proj, fused.down_proj)).sqrt()
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
        router_grads={i: norm(i, f"{m.moe}.{m.gate}.") for i in routed},
        shared_grads={i: norm(i, *m.shared) if m.shared else 0.0 for i in routed},
        attention_grads={i: norm(i, *m.mixer) for i in routed},
    )


def worst(ref: Observed, ours: Observed) -> tuple[float, float]:
    """(|NLL difference|, largest relative gradient-norm difference) of one comparison."""
    rel = [
        float(((o.double() - r.double()).abs() / r.double())[r > 1e-6].max())
        for o, r in ((ours.expert_grads[i], ref.expert_grads[i]) for i in ref.scores)
    ]  # an unchosen expert: 0 both
    for name in ("router_grads", "shared_grads", "attention_grads"):
        rel += [abs(getattr(ours, name)[i] - w) / w for i, w in getattr(ref, name).items() if w > 1e-6]
    return abs(float(ours.loss) - float(ref.loss)), max(rel)


def agree(ckpt: Checkpoint, model: Any, tokens: torch.Tensor, m: Modules) -> tuple[float, float]:
    """Assert the oracle checks (``test_oracle``'s, or ``test_oracle_deepseek``'s where routing is
    group-limited or biased) and the issue's bounds; return (NLL abs, grad rel)."""
    ref = hf_observed(model, tokens, m)
    g = ckpt.spec.gate
    if g.grouped or g.selection_bias:  # group-limited or biased top-k: near-ties from the replay's margins
        ours = deepseek_observed(ckpt, tokens)
        assert_agree_deepseek(ref, ours, ckpt)
    else:
        ours = moeaudit_observed(ckpt, tokens)
        assert_agree(ref, ours, ckpt.spec.top_k, FORWARD, GRADIENT)
    nll_abs, grad_rel = worst(ref, ours)
    if path := os.environ.get("MOEAUDIT_WORST_LOG"):  # the figures docs/families.md quotes
        with open(path, "a", encoding="utf-8") as f:
            f.write(
                json.dumps(
                    {
                        "test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
                        "nll_abs": nll_abs,
                        "grad_rel": grad_rel,
                    }
                )
                + "\n"
            )
    assert nll_abs <= 1e-4 and grad_rel <= 2e-3
    assert ckpt.spec.routed_layers == tuple(
        i for i, layer in enumerate(model.model.layers) if hasattr(_module(layer, m.moe), "experts")
    )
    return nll_abs, grad_rel
