"""What a replay hands its callers (docs/glossary.md, "Taps"): the observers it calls with each layer's taps, the
routing and the per-layer gradient norms it returns. Shared by the one-process replay
(``replay.engine``) and the expert-parallel one (``replay.sharded``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.replay.device import to_host
from moeaudit.replay.groups import ATTENTION, ROUTER, SHARED_EXPERT, present
from moeaudit.replay.model import ExtraExperts, MoETap, Routing

Observer = Callable[[MoETap, LayerWeights], None]
Progress = Callable[[str, int, int], None]


@dataclass
class LayerGrads:
    """‖∇L‖₂ per weight group of one layer (`000` Def. 6.1)."""

    experts_E: torch.Tensor  # over all of expert e's weights
    router: float = 0.0
    shared: float = 0.0
    attention: float = 0.0


@dataclass
class ReplayResult:
    nll: float
    nll_windows_W: torch.Tensor  # mean NLL of each window
    entropy: float  # teacher-forced predictive entropy, mean over the W·(T−1) positions
    routing: dict[int, Routing] = field(default_factory=dict)
    grads: dict[int, LayerGrads] = field(default_factory=dict)
    nonfinite_weights: list[str] = field(default_factory=list)  # "layer 3 router", "lm_head", ...
    parallel: dict[str, Any] | None = None  # expert-parallel replay: world size, backend, devices
    kept_layers: list[int] = field(default_factory=list)  # layers whose W1/W3 products the backward reused


def detached(r: Routing) -> Routing:
    """The routing without its autograd graph (the one a replay returns and keeps)."""
    return Routing(
        r.scores_NE.detach(),
        r.probs_NE.detach(),
        r.topk_NK,
        r.combine_NK.detach(),
        None if r.logits_NE is None else r.logits_NE.detach(),
        r.margin_N,
    )


def extra_requests(observers: Sequence[Observer]) -> ExtraExperts | None:
    """Merge the observers' ``extra_experts(layer, routing)`` requests (optional method): the
    expert outputs they need beyond R_k, computed in the replay's own sweep over the experts."""
    asks = [ask for o in observers if (ask := getattr(o, "extra_experts", None)) is not None]
    if not asks:
        return None

    def extra(layer: int, routing: Routing) -> dict[str, torch.Tensor]:
        return {name: idx for ask in asks for name, idx in ask(layer, routing).items()}

    return extra


def _sum_sq(tensors: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """Σ ‖grad‖² over ``tensors`` in float64, where the gradients live (no host sync)."""
    total = like.new_zeros(())
    for t in tensors:
        if t is not None and t.grad is not None:
            total = total + t.grad.double().pow(2).sum()
    return total


def layer_grads(lw: LayerWeights, sq_E: torch.Tensor, device: torch.device | None = None) -> LayerGrads:
    """Gradient norms of one layer from ``sq_E`` = ‖∇_{θ_e} L‖² per expert (float64, on the
    compute device) and the ``.grad`` of its other weights: every number of the layer comes to
    the host in one transfer (docs/decisions.md, "The GPU path: receipts on the device, copies ahead, inputs
    offloaded"), not one sync per tensor."""
    p = lw.params
    groups = ([p[n] for n in present(g, p)] for g in (ROUTER, ATTENTION, SHARED_EXPERT))
    sq = to_host(torch.cat([sq_E, torch.stack([_sum_sq(g, sq_E) for g in groups])]), device)
    router, attention, shared = (float(v) ** 0.5 for v in sq[len(sq_E) :].tolist())
    return LayerGrads(sq[: len(sq_E)].sqrt(), router=router, shared=shared, attention=attention)
