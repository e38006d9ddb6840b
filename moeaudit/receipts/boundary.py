"""Boundary receipts (`003` State1, `002` boundary mass and flip rate).

Shape suffixes: N tokens, E experts, K top-k, H hidden.
"""

from __future__ import annotations

from typing import Any

import torch

from moeaudit.policy import ReceiptSettings
from moeaudit.receipts.bootstrap import WindowBootstrap
from moeaudit.receipts.deferred import number, resolve
from moeaudit.replay.model import route
from moeaudit.spec.config import ModelSpec


def selection_margin(scores_NE: torch.Tensor, k: int) -> torch.Tensor:
    """m_t = s_(k) − s_(k+1) of the sorted selection scores (top-1: s_(1) − s_(2))."""
    top = scores_NE.double().topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def same_sets(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    return (a_NK.sort(dim=-1).values == b_NK.sort(dim=-1).values).all(dim=-1)


def flip_rate(
    spec: ModelSpec,
    router_EH: torch.Tensor,
    y_NH: torch.Tensor,
    topk_NK: torch.Tensor,
    sigma: float,
    seed: int,
    bias_E: torch.Tensor | None = None,
    logit_bias_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token flips of R_k under W_r ← W_r + σ·rms(W_r)·G, G ~ N(0, 1) seeded (`002` §7.2);
    a selection bias, the operator's setting, and a logit bias (gpt-oss) are kept as they are.
    G is drawn on the host (the same numbers whatever device computes) and copied over."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(router_EH.shape, generator=g, dtype=torch.float64).to(router_EH.device, non_blocking=True)
    rms = router_EH.double().pow(2).mean().sqrt()
    perturbed = (router_EH.double() + sigma * rms * noise).to(router_EH.dtype)
    return ~same_sets(route(spec, perturbed, y_NH, bias_E, logit_bias_E).topk_NK, topk_NK)


def boundary_receipts(
    spec: ModelSpec,
    scores_NE: torch.Tensor,
    router_EH: torch.Tensor,
    y_NH: torch.Tensor,
    topk_NK: torch.Tensor,
    settings: ReceiptSettings,
    boot: WindowBootstrap,
    seed: int,
    *,
    bias_E: torch.Tensor | None = None,
    margin_N: torch.Tensor | None = None,
    logit_bias_E: torch.Tensor | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """(receipts, per-token margins m_t). ``margin_N``: the router's own margin where a group
    limit decides R_k (:func:`moeaudit.replay.model.route`), else s_(k) − s_(k+1)."""
    out, m_N = boundary_pending(
        spec,
        scores_NE,
        router_EH,
        y_NH,
        topk_NK,
        settings,
        boot,
        seed,
        bias_E=bias_E,
        margin_N=margin_N,
        logit_bias_E=logit_bias_E,
    )
    return resolve(out), m_N


def boundary_pending(
    spec: ModelSpec,
    scores_NE: torch.Tensor,
    router_EH: torch.Tensor,
    y_NH: torch.Tensor,
    topk_NK: torch.Tensor,
    settings: ReceiptSettings,
    boot: WindowBootstrap,
    seed: int,
    *,
    bias_E: torch.Tensor | None = None,
    margin_N: torch.Tensor | None = None,
    logit_bias_E: torch.Tensor | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """:func:`boundary_receipts`, computed where the routing is and left there
    (``deferred.resolve`` reads it); the margins stay there too."""
    if spec.top_k >= scores_NE.shape[1]:  # E = k: no (k+1)-th score, R_k never changes
        no_margin_N = torch.full(scores_NE.shape[:1], float("inf"), dtype=torch.float64, device=scores_NE.device)
        return _no_boundary(settings), no_margin_N
    m_N = selection_margin(scores_NE, spec.top_k) if margin_N is None else margin_N.double()
    flips_N = flip_rate(spec, router_EH, y_NH, topk_NK, settings.flip_sigma, seed, bias_E, logit_bias_E)
    q = torch.quantile(m_N, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=m_N.device))
    scale = eta_scale(spec)
    mass = {_key(eta): number((m_N < eta * scale).double().mean()) for eta in settings.boundary_etas}
    out = {
        "margin_mean": number(m_N.mean()),
        "margin_quantiles": {"p10": number(q[0]), "p50": number(q[1]), "p90": number(q[2])},
        "boundary_mass": mass,
        "flip_rate": number(flips_N.double().mean()),
        "flip_sigma": settings.flip_sigma,
        "ci95": {
            "margin_mean": boot.mean_pending(m_N),
            "flip_rate": boot.mean_pending(flips_N),
            "boundary_mass": {_key(eta): boot.mean_pending(m_N < eta * scale) for eta in settings.boundary_etas},
        },
    }
    if scale != 1.0:
        out["boundary_mass_units"] = (
            f"sigmoid selection scores: B(η) counts margins below η·σ'(0) = {scale:g}·η, the score "
            "gap a logit gap η makes at the decision point, so the η grid means the same as for "
            "softmax (logit) routers"
        )
    return out, m_N


def eta_scale(spec: ModelSpec) -> float:
    """Units of the η grid: 1 for logit-scale scores (softmax routers); σ'(0) = 1/4 for sigmoid
    scores, whose margins live in (0, 1) — a logit grid there would call nearly every token a
    boundary token (B(0.1) = 0.92 on the deepseek sample). DeepSeek-V4's √softplus scores keep
    their own units (1, the lead's decision, docs/decisions.md): the gate note says the margins
    are √softplus gaps, not comparable with other families'."""
    return 0.25 if spec.gate.scoring == "sigmoid" else 1.0


def _no_boundary(settings: ReceiptSettings) -> dict[str, Any]:
    return {
        "margin_mean": None,
        "margin_quantiles": None,
        "boundary_mass": {_key(eta): 0.0 for eta in settings.boundary_etas},
        "flip_rate": 0.0,
        "flip_sigma": settings.flip_sigma,
        "reason": "every expert is active (E = k): there is no selection boundary",
        "ci95": None,
    }


def _key(eta: float) -> str:
    return repr(float(eta))  # "0.01", …, "1.0"
