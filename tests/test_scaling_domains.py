"""Receipts stay linear in the number of canary domains (docs/decisions.md, "Pairwise domain receipts stay
linear in the number of domains").

The pairwise domain receipts (JS between domains' routing loads, gradient conflict) are written
in full up to ``MAX_PAIRWISE_DOMAINS`` and replaced beyond it by linear summaries that the
receipts name (``bounded``). Here: many domains give receipts in bounded time, and the
summaries match a direct computation.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rich.console import Console

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint, LayerWeights
from moeaudit.receipts import conflict as conflict_mod
from moeaudit.receipts.occupancy import MAX_PAIRWISE_DOMAINS, domain_routing, js_divergence
from moeaudit.receipts.state import state_receipts
from moeaudit.replay import replay
from moeaudit.report import terminal

VOCAB = 96  # hfmodels.VOCAB


def _canary(windows: int, domains: int, length: int = 8) -> Canary:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (windows, length), generator=gen).int()
    ids = torch.randint(0, domains, (windows,), generator=gen).int()
    ids[:domains] = torch.arange(domains, dtype=torch.int32)  # every domain present
    return Canary(tokens, ids, tuple(f"dom{d}" for d in range(domains)))


def _direct(topk_NK: torch.Tensor, ids_W: torch.Tensor, D: int, E: int) -> list[tuple[torch.Tensor, int]]:
    """Each domain's expert counts and tokens, by a mask per domain (as the definition reads)."""
    dom_N = ids_W.long().repeat_interleave(topk_NK.shape[0] // ids_W.shape[0])
    return [
        (torch.bincount(topk_NK[dom_N == d].reshape(-1), minlength=E).double(), int((dom_N == d).sum()))
        for d in range(D)
    ]


def _direct_loads(topk_NK: torch.Tensor, ids_W: torch.Tensor, D: int, E: int) -> list[torch.Tensor]:
    return [counts / (topk_NK.shape[1] * n) for counts, n in _direct(topk_NK, ids_W, D, E)]


def _routing(D: int, E: int = 6, K: int = 2, W: int = 90, T: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(D)
    topk_NK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(W * T)])
    ids_W = torch.randint(0, D, (W,), generator=gen)
    ids_W[:D] = torch.arange(D)
    return topk_NK, ids_W.int()


def test_domain_routing_small_d_matches_direct_computation() -> None:
    topk_NK, ids_W = _routing(D=5)
    names = tuple("abcde")
    doc = domain_routing(topk_NK, ids_W, names, 6)
    loads = _direct_loads(topk_NK, ids_W, 5, 6)
    pooled = torch.bincount(topk_NK.reshape(-1), minlength=6).double() / topk_NK.numel()
    assert "bounded" not in doc
    assert doc["js"] == [[float(js_divergence(a, b)) for b in loads] for a in loads]  # exact
    assert doc["pi"] == {
        name: (counts / n).tolist() for name, (counts, n) in zip(names, _direct(topk_NK, ids_W, 5, 6), strict=True)
    }
    for n, load in zip(names, loads, strict=True):
        assert doc["js_to_pooled"][n] == pytest.approx(float(js_divergence(load, pooled)), abs=1e-15)


def test_domain_routing_beyond_the_bound_names_it_and_bounds_every_pair() -> None:
    D = MAX_PAIRWISE_DOMAINS + 8
    topk_NK, ids_W = _routing(D=D, W=3 * D)
    doc = domain_routing(topk_NK, ids_W, tuple(f"d{i}" for i in range(D)), 6)
    loads = _direct_loads(topk_NK, ids_W, D, 6)
    pairs = [float(js_divergence(a, b)) for a in loads for b in loads]
    bound = doc["bounded"]["js"]
    assert doc["js"] is None and bound["max_domains"] == MAX_PAIRWISE_DOMAINS
    assert f"{D} domains" in bound["reason"]
    assert max(pairs) <= bound["pair_max_upper"] <= math.log(2)
    assert len(doc["js_to_pooled"]) == len(doc["pi"]) == D


def test_domain_routing_is_linear_in_domains() -> None:
    """3000 domains: one bincount, not 9 M divergences (≈ 5 min the pairwise way)."""
    topk_NK, ids_W = _routing(D=3000, E=8, W=6000, T=4)
    start = time.perf_counter()
    doc = domain_routing(topk_NK, ids_W, tuple(f"d{i}" for i in range(3000)), 8)
    assert time.perf_counter() - start < 5.0
    assert doc["js"] is None and len(doc["js_to_pooled"]) == 3000


def test_many_domains_receipts_in_bounded_time(hf_checkpoint: Callable[..., Path]) -> None:
    ckpt = Checkpoint(hf_checkpoint("mixtral"))
    canary = _canary(windows=300, domains=300)
    start = time.perf_counter()
    doc = state_receipts(ckpt, canary)
    assert time.perf_counter() - start < 60.0  # ≈ 1 s here; minutes when the JS was pairwise
    for entry in doc["layers"]:
        dom = entry["domains"]
        assert dom["js"] is None and "300 domains" in dom["bounded"]["js"]["reason"]
        assert len(dom["pi"]) == len(dom["js_to_pooled"]) == 300
    ids = canary.domain_ids
    nll_W = torch.tensor(doc["nll_windows"], dtype=torch.float64)
    for d in (0, 7, 299):
        assert doc["nll_by_domain"][f"dom{d}"] == pytest.approx(float(nll_W[ids == d].mean()), rel=1e-6)


def _masked_grads(ckpt: Checkpoint, canary: Canary, weights_W: torch.Tensor) -> dict[int, torch.Tensor]:
    """Shared-parameter gradients of a window-weighted NLL over the whole canary."""
    out: dict[int, torch.Tensor] = {}

    def keep(lw: LayerWeights) -> None:
        if lw.routed:
            out[lw.layer] = conflict_mod._flat_grad(lw)[1]

    replay(ckpt, canary.tokens, grad_observers=[keep], window_weights_W=weights_W)
    return out


def test_conflict_matches_direct_computation_and_bounds(
    hf_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint(hf_checkpoint("mixtral"))
    canary = _canary(windows=9, domains=3)
    doc = conflict_mod.domain_conflict(ckpt, canary)
    ids = canary.domain_ids
    direct = [_masked_grads(ckpt, canary, (ids == d).double() / (ids == d).sum()) for d in range(3)]
    pooled = _masked_grads(ckpt, canary, torch.full((9,), 1 / 9, dtype=torch.float64))
    for entry in doc["layers"]:
        g = torch.stack([d[entry["layer"]] for d in direct])
        unit = g / g.norm(dim=1, keepdim=True)
        assert torch.tensor(entry["cos"]) == pytest.approx(unit @ unit.T, abs=1e-5)
        to_pooled = (-(unit @ pooled[entry["layer"]]) / pooled[entry["layer"]].norm()).clamp_min(0)
        assert list(entry["conflict_to_pooled"].values()) == pytest.approx(to_pooled.tolist(), abs=1e-5)
    monkeypatch.setattr(conflict_mod, "MAX_PAIRWISE_DOMAINS", 2)
    receipts = state_receipts(ckpt, canary, conflict=True)
    bounded = receipts["conflict"]
    assert "3 domains > 2" in bounded["bounded"]["conflict"]["reason"]
    for full, short in zip(doc["layers"], bounded["layers"], strict=True):
        assert short["cos"] is None and short["max_conflict"] is None
        assert full["max_conflict"] <= short["max_conflict_upper"] + 1e-12
        assert short["conflict_to_pooled"] == full["conflict_to_pooled"]
    text = io.StringIO()
    monkeypatch.setattr(terminal, "out", Console(file=text, width=140, highlight=False))
    terminal.print_receipts(receipts)
    worst = max(x["max_conflict_upper"] for x in bounded["layers"])
    assert f"domain gradient conflict: max ≤ {worst:.4f}" in text.getvalue()
