"""Occupancy receipts of one routed layer (`003` Eq. 16–17).

Shape suffixes: N canary tokens, W windows, E experts, K top-k, D domains.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from moeaudit.receipts.bootstrap import WindowBootstrap
from moeaudit.receipts.deferred import Pending, apply, floats, integer, integers, number, resolve

# Pairwise domain receipts (JS of routing, gradient conflict) are P × P per layer: written in
# full up to this many domains, beyond it replaced by linear summaries (docs/decisions.md, "Pairwise domain receipts
# stay linear in the number of domains").
MAX_PAIRWISE_DOMAINS = 32


def _load_stats(counts_XE: torch.Tensor, n_tokens: torch.Tensor | float, k: int) -> dict[str, torch.Tensor]:
    """Occupancy statistics of (possibly batched, [..., E]) expert counts."""
    E = counts_XE.shape[-1]
    mean = counts_XE.mean(-1)
    p = counts_XE / (k * n_tokens if not torch.is_tensor(n_tokens) else k * n_tokens[..., None])
    # 0 − Σ, not −Σ: a one-expert load reads +0.0, never −0.0 ("H_norm -0.000" in a sentence)
    ent = 0.0 - (torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))).sum(-1)
    return {
        "pi_min": counts_XE.min(-1).values / n_tokens,
        "dead": (counts_XE == 0).sum(-1).double(),
        "cv": counts_XE.std(-1, unbiased=False) / mean,
        "imbalance": counts_XE.max(-1).values / mean,
        "entropy_norm": ent / math.log(E) if E > 1 else ent * 0,
        "entropy": ent,
    }


def _one_stat(name: str, n_tokens: float, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Statistic ``name`` of batched counts [B, E] → [B], for the window bootstrap."""
    return lambda counts_BE: _load_stats(counts_BE, n_tokens, k)[name]


def counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(idx, minlength=n)`` for indices known to be below ``n``, without the
    maximum bincount reads back to size its result (a synchronisation on a GPU)."""
    flat = idx.reshape(-1).long()
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def occupancy(
    topk_NK: torch.Tensor, probs_NE: torch.Tensor, boot: WindowBootstrap | None = None, zero_experts: int = 0
) -> dict[str, Any]:
    """Counts, marginal π, dead experts, CV, imbalance, load entropy, smooth marginal π̃."""
    return resolve(occupancy_pending(topk_NK, probs_NE, boot, zero_experts))  # type: ignore[no-any-return]


def occupancy_pending(
    topk_NK: torch.Tensor, probs_NE: torch.Tensor, boot: WindowBootstrap | None = None, zero_experts: int = 0
) -> dict[str, Any]:
    """:func:`occupancy`, its numbers left where the routing is (``deferred.resolve`` reads them).
    ``zero_experts`` (LongCat: the last experts are identity experts) adds ``zero_expert_share``,
    the share of the N·K routed slots they take; every other number counts them as experts."""
    N, K = topk_NK.shape
    E = probs_NE.shape[1]
    counts_E = counts(topk_NK, E).double()
    stats = _load_stats(counts_E, float(N), K)
    out: dict[str, Any] = {
        "counts": integers(counts_E),
        "pi": floats(counts_E / N),
        "pi_min": number(stats["pi_min"]),
        "dead": integer(stats["dead"]),
        "cv": number(stats["cv"]),
        "imbalance": number(stats["imbalance"]),
        "entropy": number(stats["entropy"]),
        "entropy_norm": number(stats["entropy_norm"]),
        "pi_smooth": floats(probs_NE.double().mean(0)),
        "active_sets": active_sets_pending(topk_NK, num_experts=E),
    }
    if boot is not None and boot.W and N % boot.W == 0:
        # each window's last token predicts nothing, so no gradient reaches what it routes to: the
        # counts without it say which experts were routed a token the loss reads (health.silent_experts)
        last_N = torch.arange(N, device=topk_NK.device) % (N // boot.W) == N // boot.W - 1
        out["loss_bearing_counts"] = integers(counts(topk_NK[~last_N], E))
    if zero_experts:
        out["zero_expert_share"] = number(counts_E[E - zero_experts :].sum() / (N * K))
    if boot is not None and boot.idx_BW is not None:
        onehot_NE = torch.zeros(N, E, dtype=torch.float64, device=topk_NK.device).scatter_(1, topk_NK, 1.0)
        per_window_WE = onehot_NE.view(boot.W, -1, E).sum(1)
        T = N // boot.W
        out["ci95"] = {
            name: boot.statistic_pending(per_window_WE, _one_stat(name, float(boot.W * T), K))
            for name in ("pi_min", "dead", "cv", "entropy_norm")
        }
        out["replicates"] = {
            "pi_min": boot.statistic_replicates_pending(per_window_WE, _one_stat("pi_min", float(boot.W * T), K))
        }
    return out


def _set_counts(topk_NK: torch.Tensor, E: int) -> torch.Tensor:
    """How many tokens visit each distinct active set, sets in lexicographic order. A sorted set
    read as K base-E digits is one int64 in the same order, so a 1-D ``unique`` gives the
    counts of ``unique(dim=0)`` (which unbinds every row: 50 k tensor ops for 16 k tokens)."""
    sorted_NK = topk_NK.sort(dim=-1).values
    K = sorted_NK.shape[1]
    if K * math.log2(max(E, 2)) >= 62:  # the key would overflow int64: rows as they are
        return torch.unique(sorted_NK, dim=0, return_counts=True)[1]
    digits_K = torch.tensor([E ** (K - 1 - j) for j in range(K)], dtype=torch.int64, device=sorted_NK.device)
    keys_N = (sorted_NK.long() * digits_K).sum(-1)
    return torch.unique(keys_N, return_counts=True)[1]


def active_sets(topk_NK: torch.Tensor, top: int = 10, num_experts: int | None = None) -> dict[str, Any]:
    """Active-set occupancy μ (`003` Eq. 16): distinct sets visited, entropy, top-10 mass."""
    return resolve(active_sets_pending(topk_NK, top, num_experts))  # type: ignore[no-any-return]


def active_sets_pending(topk_NK: torch.Tensor, top: int = 10, num_experts: int | None = None) -> dict[str, Any]:
    """:func:`active_sets` left on the device. ``unique`` sizes its result from the data, so on
    a GPU it waits for the device once (the number of distinct sets is a shape)."""
    if num_experts is None:
        num_experts = int(topk_NK.max()) + 1 if topk_NK.numel() else 1
    set_counts = _set_counts(topk_NK, num_experts)
    mu = set_counts.double() / set_counts.sum()
    order = mu.argsort(descending=True, stable=True)
    return {
        "distinct": int(set_counts.shape[0]),
        "entropy": number(0.0 - (mu * mu.log()).sum()),
        "top10_mass": number(mu[order[:top]].sum()),
    }


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence in nats along the last dim; exactly 0 when p == q."""
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)

    def kl(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (a.clamp_min(1e-300) / m.clamp_min(1e-300)).log(), torch.zeros_like(a)).sum(-1)

    return (0.5 * kl(p) + 0.5 * kl(q)).clamp_min(0.0)


def domain_counts(
    topk_NK: torch.Tensor, domain_ids_W: torch.Tensor, num_domains: int, E: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_D, counts_DE): each domain's token count and expert counts, in one bincount
    each (a mask per domain would be O(D·N): quadratic when the canary grows with D)."""
    N, K = topk_NK.shape
    D = num_domains
    dom_N = domain_ids_W.long().repeat_interleave(N // domain_ids_W.shape[0])
    keys_NK = dom_N[:, None] * E + topk_NK.long()
    counts_DE = counts(keys_NK, D * E).view(D, E)  # canary domain ids are < D (canary.py checks)
    return counts(dom_N, D).double(), counts_DE.double()


def domain_routing(
    topk_NK: torch.Tensor, domain_ids_W: torch.Tensor, domains: tuple[str, ...], E: int
) -> dict[str, Any]:
    """Per-domain π and JS divergences between domains' loads (:func:`domain_routing_pending`)."""
    return resolve(domain_routing_pending(topk_NK, domain_ids_W, domains, E))  # type: ignore[no-any-return]


def domain_routing_pending(
    topk_NK: torch.Tensor, domain_ids_W: torch.Tensor, domains: tuple[str, ...], E: int
) -> dict[str, Any]:
    """Per-domain π (the domain routing heatmap) and JS divergence between domains' loads.

    Linear in the number of domains P present: ``pi`` (P × E) and ``js_to_pooled``, each
    domain's JS to the layer's pooled load (all canary tokens). The pairwise ``js`` (P × P)
    only up to :data:`MAX_PAIRWISE_DOMAINS`; beyond it ``js`` is null and ``bounded.js`` says
    why and gives an upper bound on every pair: √JS is a metric (Endres & Schindelin 2003),
    so √JS(a, b) ≤ √JS(a, pooled) + √JS(pooled, b).
    """
    K = topk_NK.shape[1]
    dev = topk_NK.device
    # which domains are present: the canary's, read on the host; the counts where the routing is
    present = torch.bincount(domain_ids_W.cpu().long(), minlength=len(domains))[: len(domains)].nonzero()[:, 0]
    names = [domains[d] for d in present.tolist()]
    tokens_D, counts_DE = domain_counts(topk_NK, domain_ids_W.to(dev, non_blocking=True), len(domains), E)
    present = present.to(dev, non_blocking=True)
    tokens_P, counts_PE = tokens_D[present], counts_DE[present]
    load_PE = counts_PE / (K * tokens_P[:, None])
    pooled_E = counts_PE.sum(0) / (K * tokens_P.sum())
    to_pooled_P = js_divergence(load_PE, pooled_E[None, :])

    def by_name(rows: list[Any]) -> dict[str, Any]:
        return dict(zip(names, rows, strict=True))

    out: dict[str, Any] = {
        "domains": names,
        "pi": apply(floats(counts_PE / tokens_P[:, None]), by_name),
        "js_to_pooled": apply(floats(to_pooled_P), by_name),
    }
    if len(names) <= MAX_PAIRWISE_DOMAINS:
        # entry by entry the same float ops as js_divergence(load[a], load[b])
        out["js"] = floats(js_divergence(load_PE[:, None, :], load_PE[None, :, :]))
        return out
    top2 = to_pooled_P.sqrt().topk(2).values
    out["js"] = None
    out["bounded"] = {
        "js": {
            "max_domains": MAX_PAIRWISE_DOMAINS,
            "reason": f"{len(names)} domains > {MAX_PAIRWISE_DOMAINS}: the pairwise matrix (O(D²) per "
            "layer) is omitted; js_to_pooled gives each domain's JS to the pooled load",
            "pair_max_upper": Pending(top2.sum() ** 2, lambda h: min(math.log(2), float(h))),
        }
    }
    return out
