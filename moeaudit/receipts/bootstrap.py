"""Window bootstrap for 95% intervals (`003` §5: tokens within a window share context and are
not independent, so we resample windows, never tokens).

Every interval here is a ratio of per-window sums Σ num / Σ den over a resample of windows;
a plain mean is the case den = tokens per window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GATHER_ELEMENTS = 1 << 24  # float64: 128 MiB per block of resamples


class WindowBootstrap:
    """Seeded resamples of W windows, shared by every receipt of one layer."""

    def __init__(self, num_windows: int, resamples: int, seed: int):
        self.W = num_windows
        self.B = resamples
        g = torch.Generator().manual_seed(seed)
        self.idx_BW = torch.randint(num_windows, (resamples, num_windows), generator=g) if resamples else None

    def per_window(self, values_N: torch.Tensor,
                   mask_N: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ values, count) per window for token-level values [W·T] (optionally masked)."""
        v = values_N.double().view(self.W, -1)
        m = torch.ones_like(v) if mask_N is None else mask_N.double().view(self.W, -1)
        return (v * m).sum(1), m.sum(1)

    def ratio(self, num_W: torch.Tensor, den_W: torch.Tensor) -> list[float] | None:
        if self.idx_BW is None:
            return None
        num, den = num_W[self.idx_BW].sum(1), den_W[self.idx_BW].sum(1)
        stat = (num / den)[den > 0]
        return _interval(stat)

    def mean(self, values_N: torch.Tensor, mask_N: torch.Tensor | None = None) -> list[float] | None:
        return self.ratio(*self.per_window(values_N, mask_N))

    def mean_replicates(self, values_N: torch.Tensor) -> list[float] | None:
        """The B resampled means themselves, in resample order. Every checkpoint's receipts of
        one layer resample the same windows (same seed), so replicate b of two checkpoints is a
        paired draw: margins built from several receipts get a paired interval (judge/margins)."""
        if self.idx_BW is None:
            return None
        num, den = self.per_window(values_N)
        return replicates(num[self.idx_BW].sum(1) / den[self.idx_BW].sum(1))

    def statistic_replicates(self, per_window_WX: torch.Tensor,
                             fn: Callable[[torch.Tensor], torch.Tensor]) -> list[float] | None:
        if self.idx_BW is None:
            return None
        values_WX = per_window_WX.double()
        return replicates(fn(torch.cat([values_WX[idx].sum(1) for idx in self._chunks(values_WX)])))

    def statistic(self, per_window_WX: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> list[float] | None:
        """Interval of ``fn`` applied to resampled sums of per-window vectors [W, X] → [B, X]."""
        if self.idx_BW is None:
            return None
        values_WX = per_window_WX.double()
        return _interval(fn(torch.cat([values_WX[idx].sum(1) for idx in self._chunks(values_WX)])))

    def _chunks(self, values_WX: torch.Tensor) -> list[torch.Tensor]:
        """Rows of ``idx_BW`` in blocks whose gather [b, W, X] holds at most GATHER_ELEMENTS
        numbers (each resample's sum is unchanged, bit for bit; memory no longer grows as B·W·X)."""
        assert self.idx_BW is not None
        per_row = max(1, values_WX[0].numel() * self.W)
        return list(self.idx_BW.split(max(1, GATHER_ELEMENTS // per_row)))


def replicates(stat_B: torch.Tensor) -> list[float] | None:
    """Replicates as JSON numbers, 7 significant digits (none when any is not finite)."""
    if not bool(torch.isfinite(stat_B).all()):
        return None
    return [float(f"{x:.7g}") for x in stat_B.double().tolist()]


def _interval(stat_B: torch.Tensor) -> list[float] | None:
    stat_B = stat_B[torch.isfinite(stat_B)]
    if stat_B.numel() == 0:
        return None
    q = torch.quantile(stat_B.double(), torch.tensor([0.025, 0.975], dtype=torch.float64))
    return [float(q[0]), float(q[1])]
