"""Domain gradient conflict (`001` Eq. 14–15 mapped to a standard MoE).

For each canary domain a, the gradient of the domain's mean NLL with respect to each routed
layer's shared parameters — the router, the token mixer (softmax attention, MLA, linear
attention, DeltaNet, Mamba, … : whatever the layer has, ``replay.groups.CONFLICT``) and the
shared expert; the document's ``parameters`` names them, and a layer whose names differ from it
(a hybrid's other mixer) carries its own; conflict(a, b) =
max(0, −cos(∇_a, ∇_b)). Opt-in: one extra backward per domain, each over that domain's windows
only, so the domains together replay the canary once (plus one weight read per domain).

Linear in the number of domains P (docs/decisions.md, "Pairwise domain receipts stay linear in the number of
domains"): ``conflict_to_pooled`` is each domain's conflict with the gradient of the whole canary's mean NLL, Σ_a
(W_a/W) ∇_a. The pairwise ``cos`` and ``conflict`` (P × P) only up to ``MAX_PAIRWISE_DOMAINS``; beyond it they are null
and ``max_conflict_upper`` bounds every pair: the angle between unit vectors is a metric, so
∠(a, b) ≤ ∠(a, pooled) + ∠(pooled, b).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint, LayerWeights
from moeaudit.receipts.domains import domain_windows
from moeaudit.receipts.occupancy import MAX_PAIRWISE_DOMAINS
from moeaudit.replay import replay
from moeaudit.replay.device import Device
from moeaudit.replay.groups import CONFLICT, present


def _flat_grad(lw: LayerWeights) -> tuple[list[str], torch.Tensor]:
    """The names whose gradient the layer's conflict vector holds, and the vector: one float64
    vector, on the host (one copy per layer from a device: the P domains' vectors of every layer
    outlive the layer)."""
    names = [n for n in present(CONFLICT, lw.params) if lw.params[n].grad is not None]
    parts = [g.double().reshape(-1) for n in names if (g := lw.params[n].grad) is not None]
    return names, torch.cat(parts).cpu()


def _domain_grads(
    ckpt: Checkpoint, tokens_WT: torch.Tensor, device: Device
) -> dict[int, tuple[list[str], torch.Tensor]]:
    """Each routed layer's shared-parameter gradient of the mean NLL over ``tokens_WT``, with
    the names it covers."""
    per_layer: dict[int, tuple[list[str], torch.Tensor]] = {}

    def keep(lw: LayerWeights) -> None:
        if lw.routed:
            per_layer[lw.layer] = _flat_grad(lw)

    W = tokens_WT.shape[0]
    replay(
        ckpt, tokens_WT, grad_observers=[keep], window_weights_W=torch.ones(W, dtype=torch.float64) / W, device=device
    )
    return per_layer


def _layer(layer: int, grads_PX: torch.Tensor, share_P: torch.Tensor, names: list[str]) -> dict[str, Any]:
    unit_PX = grads_PX / grads_PX.norm(dim=1, keepdim=True).clamp_min(1e-300)
    pooled_X = share_P @ grads_PX  # = the gradient of the whole canary's mean NLL
    cos_P = (unit_PX @ (pooled_X / pooled_X.norm().clamp_min(1e-300))).clamp(-1.0, 1.0)
    out: dict[str, Any] = {
        "layer": layer,
        "conflict_to_pooled": dict(zip(names, (-cos_P).clamp_min(0).tolist(), strict=True)),
    }
    if len(names) <= MAX_PAIRWISE_DOMAINS:
        cos = unit_PX @ unit_PX.T
        conflict = (-cos).clamp_min(0)
        return {**out, "cos": cos.tolist(), "conflict": conflict.tolist(), "max_conflict": float(conflict.max())}
    widest = float(cos_P.acos().topk(2).values.sum())
    return {
        **out,
        "cos": None,
        "conflict": None,
        "max_conflict": None,
        "max_conflict_upper": max(0.0, -math.cos(min(math.pi, widest))),
    }


def domain_conflict(ckpt: Checkpoint, canary: Canary, device: Device = None) -> dict[str, Any]:
    """The conflict receipts; the per-domain backwards run on ``device`` (the cosines, on the
    host, are P × P numbers per layer)."""
    windows = [(n, idx) for n, idx in zip(canary.domains, domain_windows(canary), strict=True) if idx.numel()]
    names = [n for n, _ in windows]
    grads = [_domain_grads(ckpt, canary.tokens[idx], device) for _, idx in windows]
    share_P = torch.tensor([idx.numel() / canary.num_windows for _, idx in windows], dtype=torch.float64)
    used = {layer: grads[0][layer][0] for layer in ckpt.spec.routed_layers}  # the same for every domain
    assert all(g[layer][0] == used[layer] for g in grads for layer in used)
    parameters = [n for n in CONFLICT if any(n in u for u in used.values())]
    layers = [
        {
            **_layer(layer, torch.stack([g[layer][1] for g in grads]), share_P, names),
            **({"parameters": used[layer]} if used[layer] != parameters else {}),
        }
        for layer in ckpt.spec.routed_layers
    ]
    out: dict[str, Any] = {"domains": names, "parameters": parameters, "layers": layers}
    if len(names) > MAX_PAIRWISE_DOMAINS:
        out["bounded"] = {
            "conflict": {
                "max_domains": MAX_PAIRWISE_DOMAINS,
                "reason": f"{len(names)} domains > {MAX_PAIRWISE_DOMAINS}: the pairwise cos/conflict matrices "
                "(O(D²) per layer) are omitted; conflict_to_pooled gives each domain's conflict "
                "with the whole canary's gradient",
            }
        }
    return out
