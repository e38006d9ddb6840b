"""Domain gradient conflict (`001` Eq. 14–15 mapped to a standard MoE; SPEC §4 "Gradients").

For each canary domain a, the gradient of the domain's mean NLL with respect to each routed
layer's shared parameters (router, attention, shared expert); conflict(a, b) =
max(0, −cos(∇_a, ∇_b)). Opt-in: one extra backward per domain.
"""

from __future__ import annotations

from typing import Any

import torch

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint, LayerWeights
from moeaudit.replay import replay

SHARED = ("router", "q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm",
          "shared_w1", "shared_w3", "shared_w2", "shared_gate")


def _flat_grad(lw: LayerWeights) -> torch.Tensor:
    grads = [lw.params[n].grad for n in SHARED if n in lw.params]
    parts = [g.double().reshape(-1) for g in grads if g is not None]
    return torch.cat(parts)


def domain_conflict(ckpt: Checkpoint, canary: Canary) -> dict[str, Any]:
    names = [n for d, n in enumerate(canary.domains) if bool((canary.domain_ids == d).any())]
    grads: dict[str, dict[int, torch.Tensor]] = {}
    for d, name in enumerate(canary.domains):
        mask = (canary.domain_ids == d).double()
        if not bool(mask.any()):
            continue
        per_layer: dict[int, torch.Tensor] = {}

        def keep(lw: LayerWeights, store: dict[int, torch.Tensor] = per_layer) -> None:
            if lw.routed:
                store[lw.layer] = _flat_grad(lw)

        replay(ckpt, canary.tokens, grad_observers=[keep], window_weights_W=mask / mask.sum())
        grads[name] = per_layer
    layers = []
    for layer in ckpt.spec.routed_layers:
        g = torch.stack([grads[n][layer] for n in names])
        unit = g / g.norm(dim=1, keepdim=True).clamp_min(1e-300)
        cos = unit @ unit.T
        layers.append({"layer": layer, "cos": cos.tolist(), "conflict": (-cos).clamp_min(0).tolist(),
                       "max_conflict": float((-cos).clamp_min(0).max())})
    return {"domains": names, "parameters": list(SHARED), "layers": layers}
