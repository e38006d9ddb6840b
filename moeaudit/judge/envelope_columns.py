"""The envelope over a long log: compact series and one streamed pass per series (docs/envelope.md).

A ``metrics.jsonl`` of 10⁶ logged steps is read into typed arrays (:class:`moeaudit.metrics.Rows`,
273 B a line for 8 layers × 8 experts). This module keeps the envelope over it in the same
budget (docs/benchmarks.md §10, docs/envelope.md "Long series"):

* :class:`RowsView` — a contiguous range of a layer's rows (``since``/``between`` slice the log
  without copying it);
* :class:`LazyValues` / :class:`VarianceColumn` — V(t) of a sample computed when it is read,
  with the very function the short path uses (:func:`moeaudit.metrics.variance`), never stored;
* :class:`Shown` and :class:`LongCheck` — the rows of a long series the report keeps, for
  :func:`moeaudit.judge.envelope.check_series_long` (the Grönwall windows and the Δ-fold
  discrete condition of ``check_series`` in one pass, the same rows for the same samples);
* :func:`dead_experts_columns` and :func:`starvation_columns` — the §10.3 and level rules with
  run lengths and a sliding window per expert, O(samples × experts).

Every number is computed with the same float operations in the same order as the short path
(``tests/test_envelope_long.py`` compares them on random series), so the verdict does not
depend on which path ran, and it is always computed over every sample, never the shown ones.
"""

from __future__ import annotations

import heapq
import math
import sys
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, overload

from moeaudit.metrics import POOLED, Column, Norms, Rows, RowSequence, layer_total, variance
from moeaudit.records import DeadRun, EnvelopeSample, PairCheck, ShownCount, ShownRows, StarvedWindow, WindowCheck

Vectors = Sequence[Sequence[float | None]]  # [S] vectors of [E] norms, as EnvelopeSeries.norms
Feed = Callable[[int, Sequence[float | None], float | None], None]  # (sample, its norms, its V): VarianceColumn's feed

# What the report shows of a long series (docs/envelope.md "Long series"): every row up to
# SHOW_CAP; beyond it every stride-th row (stride = ceil(n / SHOW_CAP)), the first and last,
# the first NONCOMPLIANT_CAP non-compliant rows and the WORST rows of smallest margin.
SHOW_CAP = 250
NONCOMPLIANT_CAP = 100
WORST = 16


class RowsView(RowSequence):
    """Rows ``lo``..``hi`` (exclusive) of a :class:`Rows`, read as it reads, without a copy."""

    __slots__ = ("_rows", "lo", "hi", "width")

    def __init__(self, rows: Rows | RowsView, lo: int, hi: int):
        base = rows.lo if isinstance(rows, RowsView) else 0
        self._rows: Rows = rows._rows if isinstance(rows, RowsView) else rows
        self.lo: int = base + lo
        self.hi: int = base + hi
        self.width: int = rows.width

    def __len__(self) -> int:
        return self.hi - self.lo

    def _row(self, j: int) -> Norms:
        return self._rows[self.lo + j]

    def __iter__(self) -> Iterator[Norms]:
        a, w = self._rows._a, self.width
        for j in range(self.lo, self.hi):
            yield tuple(None if v != v else v for v in a[j * w : (j + 1) * w])

    def expert(self, e: int) -> array[float]:
        """Expert ``e``'s norm at every row (NaN = null), one strided copy."""
        w = self.width
        return self._rows._a[self.lo * w + e : self.hi * w : w]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


def compact(rows: Vectors) -> RowsView | None:
    """``rows`` as a view when it is a typed layer of a parsed log, else None."""
    if isinstance(rows, RowsView):
        return rows
    if isinstance(rows, Rows):
        return RowsView(rows, 0, len(rows))
    return None


class PooledRows(RowSequence):
    """All layers' vectors concatenated per step (:func:`moeaudit.metrics.with_pooled`), built
    a step at a time."""

    def __init__(self, norms: Mapping[str, Vectors]):
        self._layers = list(norms.values())
        self._n = len(self._layers[0]) if self._layers else 0

    def __len__(self) -> int:
        return self._n

    def _row(self, j: int) -> Norms:
        return tuple(g for rows in self._layers for g in rows[j])

    def __iter__(self) -> Iterator[Norms]:
        for parts in zip(*self._layers, strict=True):
            yield tuple(g for part in parts for g in part)


class VarianceColumn(Sequence[float | None]):
    """V of one series at every sample, each computed when read (with
    :func:`moeaudit.metrics.variance`, as :func:`moeaudit.metrics.variance_series` does) and
    never stored: the checks read it once in step order.

    ``feed``: called once per sample, in step order, with ``(j, norms, V)`` as V is computed
    (the alert rule, :class:`moeaudit.judge.envelope_rules.AlertStream`): samples a reader skips
    are computed for it on the way, and :meth:`finish` feeds the rest, so a reader in step order
    and the rule share one V per sample."""

    __slots__ = ("_vectors", "_variant", "_memo", "_feed", "_fed")

    def __init__(self, vectors: Vectors, variant: str, feed: Feed | None = None):
        self._vectors = vectors
        self._variant = variant
        self._memo: tuple[int, float | None, str | None] = (-1, None, None)
        self._feed = feed
        self._fed = 0  # the samples before this one were fed

    def __len__(self) -> int:
        return len(self._vectors)

    def _at(self, j: int) -> tuple[float | None, str | None]:
        if self._memo[0] != j:
            g_E = self._vectors[j]
            self._memo = (j, *variance(g_E, self._variant))
            if self._feed is not None and j >= self._fed:
                self._feed_to(j)
                self._feed(j, g_E, self._memo[1])
                self._fed = j + 1
        return self._memo[1], self._memo[2]

    def _feed_to(self, stop: int) -> None:
        """Feed the samples from the last fed up to ``stop`` (exclusive), computing their V."""
        assert self._feed is not None
        for i in range(self._fed, stop):
            g_E = self._vectors[i]
            self._feed(i, g_E, variance(g_E, self._variant)[0])
        self._fed = max(self._fed, stop)

    def finish(self) -> None:
        """Feed every sample not fed yet (those after the last one read)."""
        if self._feed is not None:
            self._feed_to(len(self))

    @overload
    def __getitem__(self, j: int) -> float | None: ...
    @overload
    def __getitem__(self, j: slice) -> tuple[float | None, ...]: ...
    def __getitem__(self, j: int | slice) -> float | None | tuple[float | None, ...]:
        if isinstance(j, slice):
            return tuple(self[i] for i in range(*j.indices(len(self))))
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError("sample index out of range")
        return self._at(j)[0]

    def __iter__(self) -> Iterator[float | None]:
        for g_E in self._vectors:
            yield variance(g_E, self._variant)[0]

    def why(self, j: int) -> str | None:
        """Why sample ``j`` has no value (None when it has one)."""
        return self._at(j)[1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


class LazyValues(Mapping[str, Sequence[float | None]]):
    """V per series ("pooled" first, then layers) as :class:`VarianceColumn` s: nothing per
    sample is held (``notes``: :class:`LazyNotes`). :meth:`feeding` gives one column per series,
    each feeding a consumer as its V is computed."""

    def __init__(self, norms: Mapping[str, Vectors], variant: str):
        self._norms = norms
        self._variant = variant
        self._keys = [POOLED, *norms]
        self._fixed: dict[str, VarianceColumn] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __getitem__(self, key: str) -> VarianceColumn:
        if key not in self._keys:
            raise KeyError(key)
        if key in self._fixed:
            return self._fixed[key]
        return VarianceColumn(self.vectors(key), self._variant)

    def vectors(self, key: str) -> Vectors:
        """The series' per-step norm vectors (pooled: every layer's, concatenated per step)."""
        return PooledRows(self._norms) if key == POOLED else self._norms[key]

    def feeding(self, feeds: Mapping[str, Feed]) -> LazyValues:
        """The same values, the series in ``feeds`` each one column for every reader, fed as it
        computes V (:class:`VarianceColumn`): finish them (:meth:`finish`) when read."""
        out = LazyValues(self._norms, self._variant)
        out._fixed = {k: VarianceColumn(self.vectors(k), self._variant, feed) for k, feed in feeds.items()}
        return out

    def finish(self) -> None:
        """Feed every fed column's samples not read yet."""
        for column in self._fixed.values():
            column.finish()


class SampleNotes(Mapping[int, str]):
    """``{sample: why it has no value}`` of one series, looked up per sample; listing it
    (iteration, ``len``) walks the series once."""

    def __init__(self, column: VarianceColumn):
        self._column = column

    def __getitem__(self, j: int) -> str:
        why = self._column.why(j) if isinstance(j, int) and 0 <= j < len(self._column) else None
        if why is None:
            raise KeyError(j)
        return why

    def __iter__(self) -> Iterator[int]:
        return (j for j in range(len(self._column)) if self._column.why(j) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class LazyNotes(Mapping[str, Mapping[int, str]]):
    """``{series: {sample: why None}}`` of a :class:`LazyValues`; listed, only series with a note."""

    def __init__(self, values: LazyValues):
        self._values = values

    def __getitem__(self, key: str) -> SampleNotes:
        return SampleNotes(self._values[key])

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._values if len(self[k]))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def compactable(norms: Mapping[str, Vectors]) -> bool:
    """Are these a parsed log's typed layers (every one a :class:`Rows`, as many steps each)?"""
    views = [compact(v) for v in norms.values()]
    return bool(views) and all(v is not None for v in views) and len({len(v) for v in views if v is not None}) == 1


# --- the windows and discrete checks in one pass -------------------------------------------------


Row = TypeVar("Row", EnvelopeSample, WindowCheck, PairCheck)


@dataclass
class Shown(Generic[Row]):
    """Which rows of one list (samples, windows or discrete pairs) the report keeps."""

    n: int
    stride: int = field(init=False)
    kept: dict[int, Row] = field(default_factory=dict)
    worst: list[tuple[float, int, Row]] = field(default_factory=list)  # max-heap on margin
    noncompliant: int = 0

    def __post_init__(self) -> None:
        self.stride = max(1, -(-self.n // SHOW_CAP))

    def wants(self, i: int, compliant: bool, margin: float | None) -> bool:
        if self.n <= SHOW_CAP or i % self.stride == 0 or i == self.n - 1:
            return True
        if not compliant and self.noncompliant < NONCOMPLIANT_CAP:
            return True
        return margin is not None and (len(self.worst) < WORST or -self.worst[0][0] > margin)

    def add(self, i: int, row: Row, compliant: bool, margin: float | None) -> None:
        if not compliant:
            self.noncompliant += 1
        if self.n <= SHOW_CAP or i % self.stride == 0 or i == self.n - 1:
            self.kept[i] = row
        elif not compliant and self.noncompliant <= NONCOMPLIANT_CAP:
            self.kept[i] = row
        if margin is not None and self.n > SHOW_CAP:
            if len(self.worst) < WORST:
                heapq.heappush(self.worst, (-margin, i, row))
            elif -self.worst[0][0] > margin:
                heapq.heapreplace(self.worst, (-margin, i, row))

    def rows(self) -> list[Row]:
        out = dict(self.kept)
        for _, i, row in self.worst:
            out[i] = row
        return [out[i] for i in sorted(out)]

    def count(self, rows: Sequence[Row]) -> ShownCount:
        """How many rows were evaluated, are shown (``rows``: :meth:`rows`), and were not compliant."""
        return {"evaluated": self.n, "shown": len(rows), "noncompliant": self.noncompliant}


@dataclass(frozen=True)
class LongCheck:
    """:class:`moeaudit.judge.envelope.SeriesCheck` of a series whose rows are thinned for the
    report: ``compliant`` and ``counts`` are over every sample, the rows are those shown."""

    samples: list[EnvelopeSample]
    windows: list[WindowCheck]
    discrete: list[PairCheck]
    compliant: bool
    counts: ShownRows

    @property
    def thinned(self) -> bool:
        c = self.counts
        return any(n["shown"] < n["evaluated"] for n in (c["samples"], c["windows"], c["discrete"]))


# --- the level rules by run lengths and sliding windows ------------------------------------------


def _column(norms: Vectors, e: int) -> Sequence[float]:
    """Expert ``e``'s norm at every step, NaN for null."""
    view = compact(norms)
    if view is not None:
        return view.expert(e)
    return [math.nan if g_E[e] is None else g_E[e] for g_E in norms]  # type: ignore[misc]


def dead_experts_columns(steps: Sequence[int], norms: Vectors, dead_grad: float, dead_steps: int) -> list[DeadRun]:
    """:func:`moeaudit.judge.envelope.dead_experts` over one column per expert: each run of
    below-threshold samples is walked once."""
    out: list[DeadRun] = []
    width = len(norms[0]) if len(norms) else 0
    for e in range(width):
        since: int | None = None
        entry: DeadRun | None = None
        for t, g in zip(steps, _column(norms, e)):
            if g < dead_grad:  # NaN (null) compares False: it ends a run
                since = t if since is None else since
                if t - since + 1 > dead_steps:
                    if entry is None:
                        entry = {
                            "expert": e,
                            "since": since,
                            "step": t,
                            "until": t,
                            "steps": t - since + 1,
                            "recovered": False,
                        }
                        out.append(entry)
                    else:
                        entry["until"], entry["steps"] = t, t - since + 1
            else:
                if entry is not None and g == g:
                    entry["recovered"] = True
                since, entry = None, None
    return out


def starvation_columns(
    steps: Sequence[int],
    norms: Vectors,
    share: float,
    max_steps: int,
    fraction: float = 0.5,
    *,
    numpy_rows: int = 0,
) -> list[StarvedWindow]:
    """:func:`moeaudit.judge.envelope.starvation` with the counts of the window (t − max_steps, t]
    kept as it slides (two pointers), not recounted at every sample: O(samples × experts). A
    parsed log of at least :data:`VECTOR_FROM` samples is judged by :func:`_starvation_arrays`
    where numpy is loaded, or may be (``numpy_rows``: the most samples for which the caller's
    memory budget allows importing it; :data:`ENVELOPE_NUMPY_ROWS`, :data:`CERTIFY_NUMPY_ROWS`)."""
    out: list[StarvedWindow] = []
    n = len(steps)
    if not n:
        return out
    view = compact(norms)
    if view is not None and n >= VECTOR_FROM and 1 <= max_steps <= BLOCK and arrays_for(n, numpy_rows):
        return _starvation_arrays(steps, view, share, max_steps, fraction)
    width = len(norms[0])
    start = steps[0]
    totals: array[float] = array("d", [math.nan]) * n  # Σ_e g_e where every norm is known and > 0
    for j, g_E in enumerate(norms):
        if all(g is not None for g in g_E) and (total := layer_total(g_E)) > 0:  # type: ignore[arg-type]
            totals[j] = total
    for e in range(width):
        col = _column(norms, e)

        def share_at(i: int, col: Sequence[float] = col) -> float:  # g_e·E/Σg as starvation() has it
            total = totals[i]
            return math.nan if total != total else col[i] * width / total

        lo, seen, low = 0, 0, 0
        for j, t in enumerate(steps):
            x = share_at(j)
            if x == x:
                seen += 1
                low += x < share
            while steps[lo] <= t - max_steps:
                y = share_at(lo)
                if y == y:
                    seen -= 1
                    low -= y < share
                lo += 1
            if t - start + 1 < max_steps:
                continue  # the window (t − max_steps, t] reaches before the series
            if seen and low >= fraction * seen:
                lows = [y for i in range(lo, j + 1) if (y := share_at(i)) == y and y < share]
                out.append(
                    {
                        "expert": e,
                        "since": steps[lo],
                        "step": t,
                        "until": t,
                        "steps": max_steps,
                        "share": min(lows),
                        "fraction": low / seen,
                        "samples": seen,
                    }
                )
                break
    return out


# Samples from which a parsed log's level rule runs on numpy arrays, where numpy is loaded already
# (a replay's torch loads it) or the command's memory budget lets it import numpy (below). BLOCK:
# the rows formed at once, with the window reaching back before them (steps strictly increase, so a
# window of max_steps steps holds at most max_steps rows): a few MB whatever the log's length.
VECTOR_FROM = 4096
BLOCK = 1 << 15

# The most samples of a log for which a command imports numpy itself for the level rule, by the
# peak each was measured at with it (docs/benchmarks.md §10, budget 300 MB above the process's
# baseline for a 10⁶-line 8 × 8 log): `moeaudit envelope` stays inside it at 10⁶ lines, so it
# imports numpy for any long log; certify's envelope part (the parsed log kept alive while the
# report is serialised) went over by numpy's import at 10⁶ lines, so a certify that has not
# loaded numpy (served from the cache) imports it only up to half that. Below VECTOR_FROM samples
# no command imports it (a short log's cached certify stays numpy-free, tests/test_torch_free.py).
ENVELOPE_NUMPY_ROWS = sys.maxsize
CERTIFY_NUMPY_ROWS = 500_000


def arrays_for(n: int, numpy_rows: int) -> bool:
    """Does the level rule of ``n`` samples run on arrays: numpy loaded, or ``n`` within what the
    caller may import it for (``numpy_rows``)?"""
    return "numpy" in sys.modules or n <= numpy_rows


def _starvation_arrays(
    steps: Sequence[int], view: RowsView, share: float, max_steps: int, fraction: float
) -> list[StarvedWindow]:
    """:func:`starvation_columns` on arrays, a block of rows at a time, with the same float
    operations per sample: the layer's total added left to right (:func:`~moeaudit.metrics.layer_total`),
    g_e·E then ÷ total, exact comparisons, and the window's counts as differences of running sums
    (integers). No transcendental function, no reordered sum: the same bits as the loop."""
    import numpy as np

    n, width = len(view), view.width
    a = view._rows._a
    flat = np.frombuffer(a, dtype=np.float32 if a.typecode == "f" else np.float64)
    g_all = flat[view.lo * width : view.hi * width].reshape(n, width)
    t_all = np.frombuffer(steps._a, dtype=np.dtype(steps._a.typecode)) if isinstance(steps, Column) else None
    first = int(steps[0])
    found: dict[int, StarvedWindow] = {}
    for b0 in range(0, n, BLOCK):
        b1 = min(n, b0 + BLOCK)
        r0 = max(0, b0 - max_steps)  # no window of the block reaches before this row
        t = (t_all[r0:b1] if t_all is not None else np.asarray(steps[r0:b1])).astype(np.int64)
        lo = np.searchsorted(t, t[b0 - r0 :] - max_steps, side="right")  # each window's first row, from r0
        g = g_all[r0:b1].astype(np.float64)
        total = np.zeros(b1 - r0)
        for e in range(width):
            total += g[:, e]
        total[np.isnan(g).any(axis=1) | ~(total > 0)] = np.nan  # NaN: a null norm
        judged = t[b0 - r0 :] - first + 1 >= max_steps
        rows = np.arange(b0 - r0, b1 - r0)
        for e in range(width):
            if e in found:
                continue
            x = g[:, e] * width / total
            valid = ~np.isnan(x)
            is_low = valid & (x < share)
            seen_c = np.concatenate(([0], np.cumsum(valid)))
            low_c = np.concatenate(([0], np.cumsum(is_low)))
            seen, low = seen_c[rows + 1] - seen_c[lo], low_c[rows + 1] - low_c[lo]
            hit = np.flatnonzero(judged & (seen > 0) & (low >= fraction * seen))
            if len(hit):
                j, i = int(hit[0]), int(lo[hit[0]])  # the row (in the block) and its window's first (from r0)
                s_j, l_j = int(seen[j]), int(low[j])
                window = slice(i, b0 - r0 + j + 1)
                found[e] = {
                    "expert": e,
                    "since": int(t[i]),
                    "step": int(t[b0 - r0 + j]),
                    "until": int(t[b0 - r0 + j]),
                    "steps": max_steps,
                    "share": float(x[window][is_low[window]].min()),
                    "fraction": l_j / s_j,
                    "samples": s_j,
                }
        if len(found) == width:
            break
    return [found[e] for e in sorted(found)]
