"""Sparse-attention key selection (``moeaudit.replay.selection.keep_best``): topk's keys where the
cut is not tied, the earlier key where it is, whatever order the backend's topk gives tied keys
(docs/decisions.md, "DSA key selection: ties broken by position, on every device")."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit.replay.selection import keep_best

LOWEST = torch.finfo(torch.float32).min


def _kept(row: list[float], k: int) -> list[int]:
    return keep_best(torch.tensor([row]), k)[0].nonzero().flatten().tolist()


def _topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(k, dim=-1).indices, True)


def _reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Pure Python: rank keys by (score descending, position ascending), NaN as +inf, −0.0 = +0.0."""
    out = torch.zeros_like(scores, dtype=torch.bool)
    for r, row in enumerate(scores.view(-1, scores.shape[-1]).tolist()):
        rank = sorted(range(len(row)), key=lambda j: (-(math.inf if math.isnan(row[j]) else row[j]), j))
        out.view(-1, scores.shape[-1])[r, rank[:k]] = True
    return out


def test_tied_cuts_keep_the_earlier_keys() -> None:
    # the lead's row: CPU topk keeps [0, 5, 8, 9] (not the earliest zero)
    assert _kept([3.0, 0, 0, 0, 0, 2, 0, 0, 1, 0, 0, 0], 4) == [0, 1, 5, 8]
    assert _kept([0.0, 0.5, 0, 0, 0.5], 2) == [1, 4]  # tied inside the kept set: both kept
    assert _kept([0.0, 0.5, 0, 0, 0.5], 3) == [0, 1, 4]
    assert _kept([1.0, 1, 1, 1], 2) == [0, 1]
    assert _kept([2.0, 1, 1, 1, 5], 3) == [0, 1, 4]
    # masked keys (float32's lowest, as the DSA mask writes them) only fill rows short of k keys
    assert _kept([0.0, LOWEST, LOWEST, LOWEST], 2) == [0, 1]
    assert _kept([-1.0, 0.0, -math.inf, -math.inf], 3) == [0, 1, 2]
    assert _kept([1.0, 2.0], 5) == [0, 1]  # S ≤ k: every key
    assert _kept([1.0, 2.0], 0) == []


def test_signed_zeros_tie_and_nan_ranks_first() -> None:
    # −0.0 and +0.0 are one score (CUDA's sort orders them apart, the CPU's does not)
    assert _kept([1.0, 0.0, -0.0, 0.0], 2) == [0, 1]
    assert _kept([1.0, -0.0, 0.0, -0.0], 2) == [0, 1]
    assert _kept([-0.0, 0.0, 3.0], 2) == [0, 2]
    # NaN above every number, as topk and sort rank it; ties with +inf by position
    assert _kept([1.0, math.nan, 2.0, 0.0], 2) == [1, 2]
    assert _kept([math.inf, 0.0, math.nan], 1) == [0]


def test_untied_rows_are_topks_selection() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 40, 57, generator=g)
    assert scores.sort(-1).values.diff(dim=-1).ne(0).all()  # no two scores of a row equal
    for k in (1, 7, 56):
        assert torch.equal(keep_best(scores, k), _topk_mask(scores, k))


def _tied_scores(seed: int, shape: tuple[int, ...] = (60, 33)) -> torch.Tensor:
    """Few distinct values (ReLU's exact zeros among them, with either sign), so most cuts tie."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-1, 4, shape, generator=g).float().clamp_min(0)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return s * sign.where(s == 0, torch.ones(()))


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_pure_python_ranking_on_tied_scores(seed: int) -> None:
    s = _tied_scores(seed)
    S = s.shape[-1]
    assert (s == 0).any() and (s.signbit() & (s == 0)).any()
    for k in (1, 2, 5, 16, S - 1, S):
        assert torch.equal(keep_best(s, k), _reference(s, k))


@pytest.mark.parametrize("seed", range(3))
def test_the_selection_does_not_depend_on_how_topk_orders_ties(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each backend's topk returns some k best keys: here topk sees every row through a random
    permutation of its keys (mapped back), so it breaks ties differently on every call. The
    kept keys do not change; a plain topk's do."""
    s = _tied_scores(seed, (40, 25))
    want = {k: keep_best(s, k) for k in (3, 8, 20)}
    plain = torch.Tensor.topk
    g = torch.Generator().manual_seed(100 + seed)

    def shuffled_topk(self: torch.Tensor, k: int, dim: int = -1, **_: Any) -> Any:
        perm = torch.randperm(self.shape[-1], generator=g)
        res = plain(self[..., perm], k, dim=-1)
        return torch.return_types.topk([res.values, perm[res.indices]])

    monkeypatch.setattr(torch.Tensor, "topk", shuffled_topk)
    plain_differs = False
    for _ in range(4):
        for k, kept in want.items():
            assert torch.equal(keep_best(s, k), kept)
            plain_differs |= not torch.equal(_topk_mask(s, k), kept)
    assert plain_differs  # the shuffled topk really breaks ties another way


@pytest.mark.parametrize("family", ["hy_v4", "hy_v4_vl"])
def test_the_device_probe_replays_as_the_explicit_rule(
    family: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``tests/test_device.py``'s probe on the tiny hy_v4 / hy_v4_vl (the families whose CUDA
    replay left the CPU's) meets tied cuts in their indexers; the receipts are those of a
    reference that breaks them by position explicitly (pure Python), and differ from those of
    the opposite rule (the later key wins), so the ties decide something. No cut that is not
    tied is closer than 1e-5 of its row's largest score, so another device's float32 rounding
    (≈ 1e-7 relative) cannot move a selection there: the CUDA test's 1e-5 on the NLL can hold."""
    pytest.importorskip("transformers")
    import hfmodels

    import moeaudit.replay.dsa as dsa
    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.receipts.state import state_receipts

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, hfmodels.VOCAB, (4, 16), generator=g, dtype=torch.int32)
    probe = canary_mod.Canary(tokens, torch.arange(4, dtype=torch.int32) % 2, ("code", "prose"))
    tied: list[int] = []
    gaps: list[float] = []

    def counted(scores: torch.Tensor, k: int) -> torch.Tensor:
        best = scores.sort(-1, descending=True).values
        tied.append(int(((best[..., k - 1] == best[..., k]) & (best[..., k - 1] > LOWEST)).sum()))
        real = best[..., k] > LOWEST  # the query has more than k keys to choose from
        gap = (best[..., k - 1] - best[..., k]).double()
        scale = scores.masked_fill(scores == LOWEST, 0).abs().amax(-1).double()
        untied = real & (gap > 0)
        gaps.append(float((gap[untied] / scale[untied]).min()))
        return keep_best(scores, k)

    def later_wins(scores: torch.Tensor, k: int) -> torch.Tensor:
        return _reference(scores.flip(-1), k).flip(-1)

    ckpt = Checkpoint(hfmodels.save_any(tmp_path / family, family))
    receipts = {}
    for name, rule in (("ours", counted), ("reference", _reference), ("later", later_wins)):
        monkeypatch.setattr(dsa, "keep_best", rule)
        r = state_receipts(ckpt, probe)
        receipts[name] = {k: v for k, v in r.items() if k != "environment"}
    assert len(tied) == 2 * 3 and sum(tied[:3]) >= 1  # three DSA layers, forward and backward
    assert min(gaps) > 1e-5, gaps  # measured: 1.1e-4 (hy_v4_vl), 1.8e-4 (hy_v4)
    assert receipts["ours"] == receipts["reference"]
    assert receipts["later"]["nll"] != receipts["ours"]["nll"]
