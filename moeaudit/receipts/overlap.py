"""Overlap-compatibility receipts (`003` State2, Eq. 10, 14, 20–22, Table 2).

Shape suffixes: N tokens, E experts, K top-k, C = K' candidates (top-K' by score,
K' = min(E, 2k)), H hidden.
"""

from __future__ import annotations

from typing import Any

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.policy import ReceiptSettings
from moeaudit.receipts.bootstrap import WindowBootstrap
from moeaudit.receipts.deferred import Pending, integer, mean_or_none, number, resolve
from moeaudit.replay.model import MoETap, Routing, experts_forward_sets, input_scales
from moeaudit.spec.config import ModelSpec

EPS_KAPPA = 1e-8


def visible_field(u_NXH: torch.Tensor, z_NH: torch.Tensor, centred: bool = False) -> torch.Tensor:
    """v = P_z u with P_z = I − z zᵀ/d (`003` Eq. 10), the directions the next RMSNorm passes.
    ``centred`` (LayerNorm, Phi-3.5-MoE, whose Jacobian also removes the mean): P = I − 11ᵀ/d −
    z zᵀ/d, z of mean 0 and ‖z‖² = d, so the two projections are orthogonal."""
    d = z_NH.shape[-1]
    z = z_NH[:, None, :]
    if centred:
        u_NXH = u_NXH - u_NXH.mean(-1, keepdim=True)
    return u_NXH - z * (u_NXH * z).sum(-1, keepdim=True) / d


def kappa(v_NXH: torch.Tensor) -> torch.Tensor:
    """κ(e, e') for every pair of the X fields of each token (`003` Eq. 20) → [N, X, X]."""
    v = v_NXH.double()
    norms = v.norm(dim=-1)
    return (v @ v.transpose(1, 2)) / (norms[:, :, None] * norms[:, None, :] + EPS_KAPPA)


def pair_weighted(kappa_NXX: torch.Tensor, w_NXX: torch.Tensor) -> torch.Tensor:
    """Σ_{e≠e'} w κ / Σ_{e≠e'} w per token (NaN where the pair weight vanishes)."""
    return pair_weighted_defined(kappa_NXX, w_NXX)[0]


def pair_weighted_defined(kappa_NXX: torch.Tensor, w_NXX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_{e≠e'} w κ / Σ_{e≠e'} w, defined) per token. A token whose pair weight Σ w is 0 — a
    router so confident that ρ of every co-active partner underflows to 0 — has no weighted
    mean: it is ``defined = False`` (its value NaN), to be left out of the mean over tokens
    and counted (docs/policy.md, "C2 where the pair weight vanishes")."""
    off = 1.0 - torch.eye(kappa_NXX.shape[-1], dtype=w_NXX.dtype, device=w_NXX.device)
    w = w_NXX * off
    den = w.sum((1, 2))
    return (w * kappa_NXX).sum((1, 2)) / den, den > 0


def defined_mean(values_N: torch.Tensor, defined_N: torch.Tensor) -> torch.Tensor:
    """The mean over the defined tokens (NaN where none is): the plain mean, bit for bit,
    when every token is defined."""
    kept = torch.where(defined_N, values_N, torch.zeros_like(values_N))
    return torch.where(defined_N.all(), values_N.mean(), kept.sum() / defined_N.sum())


def candidates(scores_NE: torch.Tensor, topk_NK: torch.Tensor, n: int) -> torch.Tensor:
    """R_k followed by the next (n − k) experts by score: [N, n]."""
    k = topk_NK.shape[1]
    if n <= k:
        return topk_NK
    masked = scores_NE.double().scatter(1, topk_NK, float("-inf"))
    return torch.cat([topk_NK, masked.topk(n - k, dim=-1).indices], dim=1)


def random_outside(topk_NK: torch.Tensor, E: int, seed: int) -> torch.Tensor:
    """A seeded uniformly random expert outside R_k for every token: [N, 1]. The draws are made
    on the host (the same numbers whatever device computes) and copied to R_k's device."""
    g = torch.Generator().manual_seed(seed)
    r = torch.rand((topk_NK.shape[0], E), generator=g, dtype=torch.float64).to(topk_NK.device, non_blocking=True)
    return r.scatter(1, topk_NK, -1.0).argmax(dim=-1, keepdim=True)


def extra_experts(routing: Routing, seed: int) -> dict[str, torch.Tensor]:
    """The experts beyond R_k whose outputs the overlap receipts need: the next K' − k by
    score (c2_smooth, transition) and one random expert outside R_k (adjacency specificity).
    The replay computes them in its own sweep over the experts (``MoETap.extra_u``)."""
    N, K = routing.topk_NK.shape
    E = routing.probs_NE.shape[1]
    if E <= K:
        return {}
    cand_NC = candidates(routing.scores_NE, routing.topk_NK, min(E, 2 * K))
    return {
        "overlap_candidates": cand_NC[:, K:].contiguous(),
        "overlap_random": random_outside(routing.topk_NK, E, seed),
    }


TOKEN_CHUNK = 1024  # tokens per step: every quantity is per token, so chunks change no value


def _per_token(
    u_NKH: torch.Tensor,
    extra_NXH: torch.Tensor,
    u_rand_N1H: torch.Tensor,
    z_NH: torch.Tensor,
    rho_NC: torch.Tensor,
    s_NC: torch.Tensor,
    c_k_N: torch.Tensor,
    beta_adj: float,
    centred: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-token c2 (Eq. 20), c2_smooth (Eq. 21–22), transition jump (Eq. 14) and adjacency
    specificity (Table 2) for a chunk of tokens; the [n, K', H] fields stay small."""
    K = u_NKH.shape[1]
    v_NCH = visible_field(torch.cat([u_NKH, extra_NXH], dim=1), z_NH, centred)
    v_rand = visible_field(u_rand_N1H, z_NH, centred)
    kap_NCC = kappa(v_NCH)
    rho_K = rho_NC[:, :K]
    out = {}
    if K > 1:
        out["c2"], out["c2_defined"] = pair_weighted_defined(kap_NCC[:, :K, :K], rho_K[:, :, None] * rho_K[:, None, :])
    w_adj = rho_NC[:, :, None] * rho_NC[:, None, :] * torch.exp(-beta_adj * (s_NC[:, :, None] - s_NC[:, None, :]).abs())
    out["c2s"], out["c2s_defined"] = pair_weighted_defined(kap_NCC, w_adj)
    # Transition incompatibility at the k-th / (k+1)-th swap (`003` Eq. 14).
    out["jump"] = c_k_N * (v_NCH[:, K] - v_NCH[:, K - 1]).double().norm(dim=-1)
    # Adjacency specificity (`003` Table 2, ΔBrand): κ(e(k), e_rand) − κ(e(k), e(k+1)).
    k_rand = kappa(torch.stack([v_NCH[:, K - 1], v_rand[:, 0]], dim=1))[:, 0, 1]
    out["spec"] = k_rand - kap_NCC[:, K - 1, K]
    return out


def overlap_receipts(
    tap: MoETap,
    lw: LayerWeights,
    m_N: torch.Tensor,
    settings: ReceiptSettings,
    boot: WindowBootstrap,
    seed: int,
    spec: ModelSpec | None = None,
) -> dict[str, Any]:
    return resolve(overlap_pending(tap, lw, m_N, settings, boot, seed, spec))  # type: ignore[no-any-return]


def overlap_pending(
    tap: MoETap,
    lw: LayerWeights,
    m_N: torch.Tensor,
    settings: ReceiptSettings,
    boot: WindowBootstrap,
    seed: int,
    spec: ModelSpec | None = None,
) -> dict[str, Any]:
    """:func:`overlap_receipts` computed where the taps are, left there (``deferred.resolve``).
    The mean over boundary tokens takes a boolean index: on a GPU one wait for its size."""
    r = tap.routing
    N, K = r.topk_NK.shape
    E = r.probs_NE.shape[1]
    if E <= 1:
        return {"c2": None, "c2_smooth": None, "reason": "a single expert: no co-active pairs"}
    if E <= K:
        return _every_expert_active(tap, r, settings, boot, spec)
    z = tap.z_NH
    cand_NC = candidates(r.scores_NE, r.topk_NK, min(E, 2 * K))
    if "overlap_candidates" in tap.extra_u:  # computed by the replay's sweep (``extra_experts``)
        extra, u_rand = tap.extra_u["overlap_candidates"], tap.extra_u["overlap_random"]
    else:
        wanted = extra_experts(r, seed)
        sets = list(wanted.values())
        glu, scales = (None, None) if spec is None else (spec.expert_glu(lw.layer), input_scales(spec, r, sets))
        extra, u_rand = experts_forward_sets(lw.experts, tap.y_NH, sets, glu, scales)
    rho_NC = r.probs_NE.double().gather(1, cand_NC)
    s_NC = r.scores_NE.double().gather(1, cand_NC)
    c_k = r.combine_NK[:, K - 1].double()
    centred = spec is not None and spec.layer_norm
    chunks = [
        _per_token(tap.u_NKH[t], extra[t], u_rand[t], z[t], rho_NC[t], s_NC[t], c_k[t], settings.beta_adj, centred)
        for t in (slice(a, a + TOKEN_CHUNK) for a in range(0, N, TOKEN_CHUNK))
    ]
    c2_N = torch.cat([c["c2"] for c in chunks]) if K > 1 else None
    c2_def_N = torch.cat([c["c2_defined"] for c in chunks]) if K > 1 else None
    c2s_N, c2s_def_N, jump_N, spec_N = (
        torch.cat([c[n] for c in chunks]) for n in ("c2s", "c2s_defined", "jump", "spec")
    )
    if E == K + 1:  # the one expert outside R_k is e(k+1): the difference is 0 by definition,
        spec_N = torch.zeros_like(spec_N)  # not the last bits of two separately batched products
    # the gate probability outside the candidates: none when they are every expert (K' = E), and
    # never below 0 (1 − Σρ of every expert is a rounding error, not a mass); the same operators
    # either way, so a layer's op count does not depend on E (tests/test_op_counts.py)
    left_out_N = (1.0 - rho_NC.sum(1)).clamp_min(0.0) * float(cand_NC.shape[1] < E)
    boundary_N = m_N < settings.boundary_layer_eta
    n_boundary = boundary_N.sum()
    # C2 where the pair weight vanishes (docs/policy.md): such tokens are left out of the mean
    # and counted; a layer with no token left has no C2 (None, with the reason).
    excluded = {} if c2_def_N is None else {"c2_excluded_tokens": integer((~c2_def_N).sum())}
    return {
        "c2": None if c2_N is None or c2_def_N is None else _mean_or_reason(c2_N, c2_def_N),
        **({"reason": "no co-active pairs (top-1 routing)"} if c2_N is None else {}),
        **excluded,
        "c2_smooth": _mean_or_reason(c2s_N, c2s_def_N),
        "c2_smooth_excluded_tokens": integer((~c2s_def_N).sum()),
        "c2_smooth_candidates": int(cand_NC.shape[1]),
        "c2_smooth_truncation_mass": number(left_out_N.mean()),
        "transition_incompatibility": {
            "all": number(jump_N.mean()),
            "boundary": mean_or_none(jump_N[boundary_N].mean(), n_boundary),  # NaN, unread, if none
            "boundary_tokens": integer(n_boundary),
        },
        "adjacency_specificity": number(spec_N.mean()),
        "replicates": {"c2": None if c2_N is None else boot.mean_replicates_pending(_zeroed(c2_N, c2_def_N), c2_def_N)},
        "ci95": {
            "c2": None if c2_N is None else boot.mean_pending(_zeroed(c2_N, c2_def_N), c2_def_N),
            "c2_smooth": boot.mean_pending(_zeroed(c2s_N, c2s_def_N), c2s_def_N),
            "transition_incompatibility_all": boot.mean_pending(jump_N),
            "transition_incompatibility_boundary": boot.mean_pending(jump_N, boundary_N),
            "adjacency_specificity": boot.mean_pending(spec_N),
        },
    }


EVERY_EXPERT_ACTIVE = (
    "every expert is active (E = k): no (k+1)-th expert by score and none outside R_k, so no "
    "transition incompatibility or adjacency specificity"
)


def _every_expert_active(
    tap: MoETap, r: Routing, settings: ReceiptSettings, boot: WindowBootstrap, spec: ModelSpec | None
) -> dict[str, Any]:
    """E = k: R_k is every expert, so the co-active pairs exist and c2 (`003` Eq. 20) is the mean
    over them; the K' = min(E, 2k) = E candidates are R_k itself, so c2_smooth (Eq. 21–22) weighs
    the same pairs by Eq. 21 and leaves no mass out. Eq. 14 and Table 2 need an expert beyond R_k:
    they are None, with the reason."""
    K = r.topk_NK.shape[1]
    centred = spec is not None and spec.layer_norm
    rho_NK = r.probs_NE.double().gather(1, r.topk_NK)
    s_NK = r.scores_NE.double().gather(1, r.topk_NK)
    parts = []
    for t in (slice(a, a + TOKEN_CHUNK) for a in range(0, rho_NK.shape[0], TOKEN_CHUNK)):
        kap_NKK = kappa(visible_field(tap.u_NKH[t], tap.z_NH[t], centred))
        rho, s_ = rho_NK[t], s_NK[t]
        w_adj = (
            rho[:, :, None] * rho[:, None, :] * torch.exp(-settings.beta_adj * (s_[:, :, None] - s_[:, None, :]).abs())
        )
        parts.append(
            (*pair_weighted_defined(kap_NKK, rho[:, :, None] * rho[:, None, :]), *pair_weighted_defined(kap_NKK, w_adj))
        )
    c2_N, c2_def_N, c2s_N, c2s_def_N = (torch.cat([p[i] for p in parts]) for i in range(4))
    return {
        "c2": _mean_or_reason(c2_N, c2_def_N),
        "c2_excluded_tokens": integer((~c2_def_N).sum()),
        "c2_smooth": _mean_or_reason(c2s_N, c2s_def_N),
        "c2_smooth_excluded_tokens": integer((~c2s_def_N).sum()),
        "c2_smooth_candidates": K,
        "c2_smooth_truncation_mass": 0.0,  # the candidates are every expert: nothing is left out
        "transition_incompatibility": None,
        "adjacency_specificity": None,
        "reason": EVERY_EXPERT_ACTIVE,
        "replicates": {"c2": boot.mean_replicates_pending(_zeroed(c2_N, c2_def_N), c2_def_N)},
        "ci95": {
            "c2": boot.mean_pending(_zeroed(c2_N, c2_def_N), c2_def_N),
            "c2_smooth": boot.mean_pending(_zeroed(c2s_N, c2s_def_N), c2s_def_N),
        },
    }


def _zeroed(values_N: torch.Tensor, defined_N: torch.Tensor | None) -> torch.Tensor:
    """The values with 0 where undefined (a masked sum must not meet NaN · 0)."""
    return values_N if defined_N is None else torch.where(defined_N, values_N, torch.zeros_like(values_N))


def _mean_or_reason(values_N: torch.Tensor, defined_N: torch.Tensor) -> Pending:
    """The mean over defined tokens; None where no token is defined (never NaN)."""
    return mean_or_none(defined_mean(values_N, defined_N), defined_N.sum())
