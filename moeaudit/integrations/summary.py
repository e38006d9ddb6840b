"""Per-layer scalars for the tracker a trainer reports to.

Names group per layer on a dashboard (TensorBoard, W&B and MLflow split tags on ``/``)::

    moe/layer_3/pi_min              min_e π_e, π_e = tokens routed to e / tokens  (receipts' π_min)
    moe/layer_3/load_entropy_norm   H(π/k) / ln E, in [0, 1]                      (receipts' entropy_norm)
    moe/layer_3/dead_experts        experts that received no token
    moe/layer_3/near_dead_experts   experts whose gradient share g_e / ḡ < envelope.starve_share
    moe/layer_3/grad_norm_max       max_e g_e      moe/layer_3/grad_norm_min   min_e g_e
    moe/layer_3/envelope_margin     Grönwall margin B(t) − V(t) of the layer's series (online)
    moe/pooled/envelope_margin      the same for the pooled series
    moe/envelope_events             envelope events raised so far (alerts, starvation, dead, bound)

Routing statistics are counted over the forward passes with autograd on (training; not
evaluation, not the canary probe) since the previous report;
gradient statistics are of the last logged step. The routing is read where transformers v5 hands
it to the fused experts (``experts(hidden, top_k_index, top_k_weights)``): a forward pre-hook
adds ``top_k_index`` into a per-layer count on the device (``scatter_add_``, no host sync); the
counts come back with the gradient norms in the one sync of a logged step. A layout whose
experts module does not take ``top_k_index`` (per-expert modules, our ``LayerWeights``) gets the
gradient statistics only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moeaudit.metrics import POOLED


class RoutingCounts:
    """Tokens routed to each expert of each routed layer, counted during training forwards."""

    def __init__(self, model: torch.nn.Module, layers: Mapping[int, Any]):
        owner = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
        self.E = {layer: lp.num_experts() for layer, lp in layers.items()}
        self._counts: dict[int, torch.Tensor] = {}
        self.tokens = {layer: 0 for layer in layers}
        self.k: dict[int, int] = {}
        self.paused = False  # set during the canary probe
        self._handles = []
        for layer, lp in layers.items():
            module = owner.get(id(lp.fused[0])) if lp.fused else None
            if module is not None:
                self._handles.append(module.register_forward_pre_hook(self._hook(layer), with_kwargs=True))

    def _hook(self, layer: int) -> Any:
        def count(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            idx = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if (
                self.paused
                or not torch.is_grad_enabled()
                or not isinstance(idx, torch.Tensor)
                or idx.is_floating_point()
            ):
                return  # evaluation, the canary probe, or not the routing we know
            flat = idx.detach().reshape(-1)
            counts = self._counts.get(layer)
            if counts is None:
                counts = self._counts[layer] = torch.zeros(self.E[layer], dtype=torch.int64, device=flat.device)
            counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
            self.tokens[layer] += idx.shape[0]
            self.k[layer] = idx.shape[-1] if idx.dim() > 1 else 1

        return count

    def take(self) -> tuple[list[int], list[torch.Tensor], dict[int, int]]:
        """(layers, their device counts, their token counts), and start counting afresh."""
        layers = sorted(self._counts)
        out = [self._counts.pop(layer) for layer in layers]
        tokens = {layer: self.tokens[layer] for layer in layers}
        self.tokens = dict.fromkeys(self.tokens, 0)
        return layers, out, tokens

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class Summary:
    """Accumulates routing counts (host side) between reports and builds the scalars."""

    def __init__(self) -> None:
        self.counts: dict[int, list[float]] = {}
        self.tokens: dict[int, int] = {}
        self.k: dict[int, int] = {}
        self.last: dict[str, float] = {}

    def add_counts(
        self, layers: Sequence[int], counts: Sequence[Sequence[float]], tokens: Mapping[int, int], k: Mapping[int, int]
    ) -> None:
        for layer, c in zip(layers, counts, strict=True):
            old = self.counts.get(layer, [0.0] * len(c))
            self.counts[layer] = [a + b for a, b in zip(old, c, strict=True)]
            self.tokens[layer] = self.tokens.get(layer, 0) + tokens[layer]
            self.k[layer] = k[layer]

    def update(
        self, record: Mapping[str, Any], margins: Mapping[str, float | None], events: int, starve_share: float
    ) -> None:
        """The scalars of the last logged ``record`` (a metrics line) and the routing so far."""
        out: dict[str, float] = {}
        for layer, g_E in record["expert_grad_norms"].items():
            out.update(_grad_scalars(f"moe/layer_{layer}", g_E, starve_share))
            margin = margins.get(layer)
            if margin is not None and math.isfinite(margin):
                out[f"moe/layer_{layer}/envelope_margin"] = margin
        pooled = margins.get(POOLED)
        if pooled is not None and math.isfinite(pooled):
            out[f"moe/{POOLED}/envelope_margin"] = pooled
        out["moe/envelope_events"] = float(events)
        self.last.update(out)

    def take(self) -> dict[str, float]:
        """Everything to report now: the last gradient scalars and the routing since the last
        report (then the routing counts start afresh)."""
        out = dict(self.last)
        for layer, c in self.counts.items():
            out.update(_routing_scalars(f"moe/layer_{layer}", c, self.tokens[layer], self.k[layer]))
        self.counts.clear()
        self.tokens.clear()
        return out


def _grad_scalars(prefix: str, g_E: Sequence[float | None], starve_share: float) -> dict[str, float]:
    finite = [g for g in g_E if g is not None]
    if not finite:
        return {}
    out = {f"{prefix}/grad_norm_max": max(finite), f"{prefix}/grad_norm_min": min(finite)}
    mean = sum(finite) / len(finite)
    if mean > 0 and len(finite) == len(g_E):
        out[f"{prefix}/near_dead_experts"] = float(sum(g / mean < starve_share for g in finite))
    return out


def _routing_scalars(prefix: str, counts_E: Sequence[float], tokens: int, k: int) -> dict[str, float]:
    """`003` Eq. 16-17 as :mod:`moeaudit.receipts.occupancy` computes them, from counts."""
    if tokens <= 0:
        return {}
    E = len(counts_E)
    p = [c / (k * tokens) for c in counts_E]
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    return {
        f"{prefix}/pi_min": min(counts_E) / tokens,
        f"{prefix}/load_entropy_norm": entropy / math.log(E) if E > 1 else 0.0,
        f"{prefix}/dead_experts": float(sum(c == 0 for c in counts_E)),
    }
