"""The live monitors' load-balance metrics of one routed layer, with their definitions and names
(docs/monitors.md), so a replay can be checked against a training dashboard value for value.

* Megatron-Core ``layer-router-health`` (``--tensor-metrics``): each canary window is one of its
  sequences. Per window w: the mean gate distribution ``score_w = mean_t ρ_t``, the unbiased
  top-k load ``aux_w`` (top-k of ρ, no selection bias or group limit: its aux-loss routing map),
  the dispatched load ``actual_w`` (R_k), both normalised to sum 1, and the mean top-k boundary
  relative margin ``(ρ_floor − ρ_ceil)⁺ / ρ_floor`` (lowest selected vs highest unselected ρ of
  the unbiased map). ``seq-*`` values are means over windows; ``global-*`` pool the windows by
  their token counts (every window has T tokens).
* NeMo AutoModel's load-balance metrics, from the dispatched counts (its Gate's
  ``expert_load``): ``cv`` (sample std, N − 1, over the mean), ``dead_expert_frac``,
  ``expert_diversity = exp(H)/E`` and the utilisation ratios ``counts / (Σ counts / E)``.

Shape suffixes: N canary tokens, W windows, T window length, E experts, K top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from moeaudit.receipts.deferred import number
from moeaudit.receipts.occupancy import counts

# Megatron computes the diagnostics in float32 and guards the relative margin's divisor with
# float32's eps; the same guard here (only a zero floor meets it).
MARGIN_EPS = float(torch.finfo(torch.float32).eps)


def _loads(topk_NK: torch.Tensor, W: int, E: int) -> torch.Tensor:
    """Per-window load over experts, normalised to sum 1: [W, E]."""
    N, K = topk_NK.shape
    win_NK = torch.arange(N, device=topk_NK.device).div(N // W, rounding_mode="floor")[:, None]
    c_WE = counts(win_NK * E + topk_NK.long(), W * E).view(W, E).double()
    return c_WE / c_WE.sum(-1, keepdim=True).clamp_min(1)


def relative_margin_N(probs_NE: torch.Tensor, aux_NK: torch.Tensor) -> torch.Tensor:
    """Per token ``(ρ_floor − ρ_ceil)⁺ / max(ρ_floor, eps)``: the lowest selected and the highest
    unselected gate probability of the unbiased top-k (E > k: every token has a boundary)."""
    rho = probs_NE.double()
    chosen = torch.zeros_like(rho, dtype=torch.bool).scatter_(1, aux_NK, True)
    floor = rho.masked_fill(~chosen, float("inf")).amin(-1)
    ceil = rho.masked_fill(chosen, float("-inf")).amax(-1)
    return (floor - ceil).clamp_min(0) / floor.clamp_min(MARGIN_EPS)


def megatron_health(
    probs_NE: torch.Tensor, topk_NK: torch.Tensor, W: int, aux_NK: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """This layer's value of each ``layer-router-health`` operation (its worst-layer roll-up is
    the max over layers, the min for the boundary margin). ``aux_NK``: the unbiased top-k of ρ
    (Megatron's aux-loss routing map), computed when not given."""
    N, K = topk_NK.shape
    E = probs_NE.shape[1]
    if aux_NK is None:
        aux_NK = probs_NE.topk(K, dim=-1).indices
    score_WE = probs_NE.double().view(W, N // W, E).mean(1)
    aux_WE, actual_WE = _loads(aux_NK, W, E), _loads(topk_NK, W, E)
    aux_E, actual_E, score_E = aux_WE.mean(0), actual_WE.mean(0), score_WE.mean(0)  # equal windows

    def imbalance(load: torch.Tensor) -> torch.Tensor:
        return E * (load - 1.0 / E).square().sum(-1)

    seq_loss = (E * (aux_WE * score_WE).sum(-1)).mean()
    global_loss = E * (aux_E * score_E).sum()
    margin_W = relative_margin_N(probs_NE, aux_NK).view(W, N // W).mean(1)
    return {
        "seq-loss": seq_loss,
        "seq-assignment-imbalance": imbalance(aux_WE).mean(),
        "seq-score-imbalance": imbalance(score_WE).mean(),
        "global-batch-loss": global_loss,
        "seq-global-loss-gap": seq_loss - global_loss,
        "global-aux-max-over-mean": E * aux_E.max(),
        "global-actual-imbalance": imbalance(actual_E),
        "global-actual-max-over-mean": E * actual_E.max(),
        "topk-boundary-relative-margin": margin_W.mean(),
    }


def nemo_load_balance(counts_E: torch.Tensor) -> dict[str, torch.Tensor]:
    """NeMo AutoModel's per-layer load-balance metrics of the dispatched counts (a layer with no
    routed token: cv 0, diversity 0, as NeMo returns)."""
    load = counts_E.double()
    E, total, mean = load.shape[0], load.sum(), load.mean()
    routed = total > 0
    util = torch.where(routed, load / (total / E).clamp_min(1e-300), torch.zeros_like(load))
    p = load / total.clamp_min(1)
    H = -torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p)).sum()
    return {
        "cv": torch.where(mean > 0, load.std() / mean.clamp_min(1e-300), torch.zeros_like(mean)),
        "dead_expert_frac": (load == 0).double().mean(),
        "expert_diversity": torch.where(routed, H.exp() / E, torch.zeros_like(mean)),
        "utilization_min": util.min(),
        "utilization_max": util.max(),
    }


def topk_overlap(aux_NK: torch.Tensor, topk_NK: torch.Tensor, W: int, E: int) -> torch.Tensor:
    """Megatron's ``topk-overlap-mean`` (``layer-router-routing-balance``): per window the share
    of the unbiased top-k assignments that were dispatched, averaged over windows (1 unless a
    selection bias or a group limit changed R_k)."""
    N, K = topk_NK.shape
    aux_NE = torch.zeros(N, E, dtype=torch.bool, device=topk_NK.device).scatter_(1, aux_NK, True)
    actual_NE = torch.zeros_like(aux_NE).scatter_(1, topk_NK.long(), True)
    both_W = (aux_NE & actual_NE).view(W, N // W, E).sum((1, 2)).double()
    return (both_W / aux_NE.view(W, N // W, E).sum((1, 2)).double().clamp_min(1)).mean()


def monitors_pending(probs_NE: torch.Tensor, topk_NK: torch.Tensor, windows: int) -> dict[str, Any]:
    """The layer's ``monitors`` receipt, left where the routing is (``deferred.resolve``)."""
    N, K = topk_NK.shape
    E = probs_NE.shape[1]
    if K >= E:  # E = k: no boundary, every load uniform
        return {"reason": "every expert is active (E = k): the monitors' load metrics are constant"}
    aux_NK = probs_NE.topk(K, dim=-1).indices
    mega = megatron_health(probs_NE, topk_NK, windows, aux_NK)
    mega["topk-overlap-mean"] = topk_overlap(aux_NK, topk_NK, windows, E)
    return {
        "megatron": {k: number(v) for k, v in mega.items()},
        "nemo": {k: number(v) for k, v in nemo_load_balance(counts(topk_NK, E)).items()},
    }
