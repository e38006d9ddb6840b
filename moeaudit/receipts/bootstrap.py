"""Window bootstrap for 95% intervals (`003` §5: tokens within a window share context and are
not independent, so we resample windows, never tokens).

Every interval here is a ratio of per-window sums Σ num / Σ den over a resample of windows;
a plain mean is the case den = tokens per window.

The resamples are drawn on the host (a CPU ``torch.Generator``: the same windows whatever
device computes) and moved once per layer to where the receipts are computed (``on``); every
statistic is then taken there, and the ``*_pending`` forms leave their result on the device for
one read per layer (:mod:`moeaudit.receipts.deferred`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeaudit.receipts.deferred import Pending, interval, resolve

GATHER_ELEMENTS = 1 << 24  # float64: 128 MiB per block of resamples


class WindowBootstrap:
    """Seeded resamples of W windows, shared by every receipt of one layer."""

    def __init__(self, num_windows: int, resamples: int, seed: int):
        self.W = num_windows
        self.B = resamples
        g = torch.Generator().manual_seed(seed)
        self.idx_BW = torch.randint(num_windows, (resamples, num_windows), generator=g) if resamples else None

    def on(self, device: torch.device) -> WindowBootstrap:
        """The same resamples, their indices on ``device`` (one copy)."""
        if self.idx_BW is None or self.idx_BW.device == device:
            return self
        out = WindowBootstrap.__new__(WindowBootstrap)
        out.W, out.B, out.idx_BW = self.W, self.B, self.idx_BW.to(device, non_blocking=True)
        return out

    def per_window(
        self, values_N: torch.Tensor, mask_N: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ values, count) per window for token-level values [W·T] (optionally masked)."""
        v = values_N.double().view(self.W, -1)
        m = torch.ones_like(v) if mask_N is None else mask_N.double().view(self.W, -1)
        return (v * m).sum(1), m.sum(1)

    def ratio_pending(self, num_W: torch.Tensor, den_W: torch.Tensor) -> Pending | None:
        if self.idx_BW is None:
            return None
        num, den = num_W[self.idx_BW].sum(1), den_W[self.idx_BW].sum(1)
        # resamples with no denominator are left out (NaN: no boolean index, no sync)
        stat = torch.where(den > 0, num / den, float("nan"))
        return interval_pending(stat)

    def ratio(self, num_W: torch.Tensor, den_W: torch.Tensor) -> list[float] | None:
        return resolve(self.ratio_pending(num_W, den_W))  # type: ignore[no-any-return]

    def mean_pending(self, values_N: torch.Tensor, mask_N: torch.Tensor | None = None) -> Pending | None:
        return self.ratio_pending(*self.per_window(values_N, mask_N))

    def mean(self, values_N: torch.Tensor, mask_N: torch.Tensor | None = None) -> list[float] | None:
        return resolve(self.mean_pending(values_N, mask_N))  # type: ignore[no-any-return]

    def mean_replicates_pending(self, values_N: torch.Tensor, mask_N: torch.Tensor | None = None) -> Pending | None:
        """The B resampled means themselves, in resample order. Every checkpoint's receipts of
        one layer resample the same windows (same seed), so replicate b of two checkpoints is a
        paired draw: margins built from several receipts get a paired interval (judge/margins)."""
        if self.idx_BW is None:
            return None
        num, den = self.per_window(values_N, mask_N)
        return replicates_pending(num[self.idx_BW].sum(1) / den[self.idx_BW].sum(1))

    def mean_replicates(self, values_N: torch.Tensor) -> list[float] | None:
        return resolve(self.mean_replicates_pending(values_N))  # type: ignore[no-any-return]

    def _resampled(self, per_window_WX: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        values_WX = per_window_WX.double()
        return fn(torch.cat([values_WX[idx].sum(1) for idx in self._chunks(values_WX)]))

    def statistic_replicates_pending(
        self, per_window_WX: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> Pending | None:
        if self.idx_BW is None:
            return None
        return replicates_pending(self._resampled(per_window_WX, fn))

    def statistic_replicates(
        self, per_window_WX: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> list[float] | None:
        return resolve(self.statistic_replicates_pending(per_window_WX, fn))  # type: ignore[no-any-return]

    def statistic_pending(
        self, per_window_WX: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> Pending | None:
        """Interval of ``fn`` applied to resampled sums of per-window vectors [W, X] → [B, X]."""
        if self.idx_BW is None:
            return None
        return interval_pending(self._resampled(per_window_WX, fn))

    def statistic(self, per_window_WX: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> list[float] | None:
        return resolve(self.statistic_pending(per_window_WX, fn))  # type: ignore[no-any-return]

    def _chunks(self, values_WX: torch.Tensor) -> list[torch.Tensor]:
        """Rows of ``idx_BW`` in blocks whose gather [b, W, X] holds at most GATHER_ELEMENTS
        numbers (each resample's sum is unchanged, bit for bit; memory no longer grows as B·W·X)."""
        assert self.idx_BW is not None
        per_row = max(1, values_WX[0].numel() * self.W)
        return list(self.idx_BW.split(max(1, GATHER_ELEMENTS // per_row)))


def _replicates(h: torch.Tensor) -> list[float] | None:
    if not bool(torch.isfinite(h).all()):
        return None
    return [float(f"{x:.7g}") for x in h.tolist()]


def replicates_pending(stat_B: torch.Tensor) -> Pending:
    """Replicates as JSON numbers, 7 significant digits (none when any is not finite)."""
    return Pending(stat_B.double(), _replicates)


def replicates(stat_B: torch.Tensor) -> list[float] | None:
    return resolve(replicates_pending(stat_B))  # type: ignore[no-any-return]


def interval_pending(stat_B: torch.Tensor) -> Pending:
    """The 2.5 % and 97.5 % quantiles of the finite replicates (None if there are none).
    ``nanquantile`` over the replicates with the non-finite ones set to NaN ranks and
    interpolates exactly as ``quantile`` over the finite ones alone, without the boolean index
    (a data-dependent shape: a synchronisation on a GPU)."""
    s = stat_B.double()
    s = torch.where(torch.isfinite(s), s, float("nan"))
    q = torch.tensor([0.025, 0.975], dtype=torch.float64, device=s.device)
    return interval(torch.nanquantile(s, q))


def _interval(stat_B: torch.Tensor) -> list[float] | None:
    return resolve(interval_pending(stat_B))  # type: ignore[no-any-return]
