"""The series the envelope checks (`000` §6; docs/envelope.md): V per series at common steps, built from
training logs, the hook's canary probe or checkpoint replays, and resampled to the constants'
sampling interval. A parsed log stays in its typed arrays (:mod:`moeaudit.judge.envelope_columns`)."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice

from moeaudit.errors import InputError
from moeaudit.judge import envelope_columns as columns
from moeaudit.metrics import POOLED, VARIANTS, Column, MetricsSeries, Rows, variance_series
from moeaudit.records import LogFinding

SOURCES = ("logs", "replay", "probe")  # probe: the hook's canary probe (canary_probe.jsonl)


# --- the series ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvelopeSeries:
    """V per series ("pooled" first, then layers) at common steps, from logs or replays.

    ``norms`` (per-expert gradient norms per layer, [S] vectors of [E]) is optional: without it
    the alert rule (Eq. 21) and dead experts (§10.3) cannot be evaluated and are reported skipped.
    """

    source: str  # "logs" | "replay" | "probe"
    variant: str  # "raw" | "normalized"
    steps: Sequence[int]  # a tuple, or a typed Column for a parsed log (envelope_columns)
    values: Mapping[str, Sequence[float | None]]
    norms: Mapping[str, Sequence[Sequence[float | None]]] | None = None
    notes: Mapping[str, Mapping[int, str]] = field(default_factory=dict)  # series → sample → why None
    origin: str = ""  # the run directory or log it came from
    findings: tuple[LogFinding, ...] = ()
    precision: str | None = None  # a probe's lines computed in bf16/fp16 weights (not float32 as a replay)

    def since(self, step: int) -> EnvelopeSeries:
        """The samples at or after ``step`` (e.g. a healthy reference past its warmup)."""
        return self._keep_range(bisect_left(self.steps, step), len(self.steps))

    def between(self, start: int | None, end: int | None, *, include_start: bool) -> EnvelopeSeries:
        """The samples in (start, end] — or [start, end] with ``include_start`` — the window a
        verdict speaks for (a gate's (base, candidate], a run's first to last checkpoint)."""

        lo = 0 if start is None else (bisect_left if include_start else bisect_right)(self.steps, start)
        hi = len(self.steps) if end is None else bisect_right(self.steps, end)
        return self._keep_range(lo, max(lo, hi))  # steps increase: the samples inside are a range

    def at(self, steps: Iterable[int]) -> EnvelopeSeries:
        """Only the samples at ``steps`` (e.g. logs at a run's checkpoint steps)."""
        wanted = set(steps)
        return self._keep([j for j, t in enumerate(self.steps) if t in wanted])

    def _keep_range(self, lo: int, hi: int) -> EnvelopeSeries:
        if isinstance(self.values, columns.LazyValues):  # a parsed log: views, no copy
            return _keep_compact(self, lo, hi)
        return self._keep(list(range(lo, hi)))

    def _keep(self, keep: list[int]) -> EnvelopeSeries:
        norms = None if self.norms is None else {k: tuple(v[j] for j in keep) for k, v in self.norms.items()}
        pos = {j: i for i, j in enumerate(keep)}
        notes = {k: {pos[j]: why for j, why in n.items() if j in pos} for k, n in self.notes.items()}
        return replace(
            self,
            steps=tuple(self.steps[j] for j in keep),
            norms=norms,
            notes=notes,
            values={k: tuple(v[j] for j in keep) for k, v in self.values.items()},
        )


def from_norms(
    source: str,
    steps: Sequence[int],
    norms: Mapping[str, Sequence[Sequence[float | None]]],
    variant: str,
    *,
    origin: str = "",
    findings: Iterable[LogFinding] = (),
) -> EnvelopeSeries:
    """A series from per-expert gradient norms ``{layer: [S] vectors of [E]}`` (logs or replay)."""
    _check_steps(steps, origin, variant)
    for layer, vectors in norms.items():
        if len(vectors) != len(steps):
            raise InputError(f"layer {layer}: {len(vectors)} norm vectors for {len(steps)} steps", path=origin or None)
    values, notes = variance_series(norms, variant)
    frozen = {k: tuple(tuple(v) for v in vs) for k, vs in norms.items()}
    return EnvelopeSeries(
        _source(source),
        variant,
        tuple(steps),
        {k: tuple(v) for k, v in values.items()},
        frozen,
        notes,
        origin,
        tuple(findings),
    )


def from_metrics(metrics: MetricsSeries, variant: str, source: str = "logs") -> EnvelopeSeries:
    """A series from a parsed ``metrics.jsonl`` (every logged step), or from the hook's
    ``canary_probe.jsonl`` (same format, ``source="probe"``). A log read by
    :func:`moeaudit.metrics.read_metrics` stays in its typed arrays (envelope_columns)."""
    precision = "/".join(metrics.precisions) or None
    if columns.compactable(metrics.norms):
        _check_steps(metrics.steps, metrics.path, variant)
        series = _compact_series(
            _source(source), metrics, variant, findings=tuple(f.to_json() for f in metrics.findings)
        )
    else:
        series = from_norms(
            source,
            metrics.steps,
            metrics.norms,
            variant,
            origin=metrics.path,
            findings=[f.to_json() for f in metrics.findings],
        )
    return replace(series, precision=precision) if precision else series


Record = tuple[int, Mapping[str, float | None], float | None]  # (step, {layer: V}, pooled V)


def from_records(source: str, records: Iterable[Record], variant: str, *, origin: str = "") -> EnvelopeSeries:
    """A series from ``(step, {layer: V}, pooled V)`` records, V already in ``variant``."""
    records = list(records)
    steps = [r[0] for r in records]
    _check_steps(steps, origin, variant)
    layers = list(records[0][1]) if records else []
    values: dict[str, list[float | None]] = {POOLED: [], **{k: [] for k in layers}}
    notes: dict[str, dict[int, str]] = {}
    for j, (step, by_layer, pooled) in enumerate(records):
        if list(by_layer) != layers:
            raise InputError(f"step {step}: layers {list(by_layer)} differ from {layers}", path=origin or None)
        for key, v in [(POOLED, pooled), *by_layer.items()]:
            finite = v is not None and math.isfinite(v)
            values[key].append(float(v) if finite else None)  # type: ignore[arg-type]
            if not finite:
                notes.setdefault(key, {})[j] = "value is non-finite"
    return EnvelopeSeries(
        _source(source), variant, tuple(steps), {k: tuple(v) for k, v in values.items()}, None, notes, origin
    )


def median_gap(steps: Sequence[int]) -> int | None:
    """The gap at index ⌊n/2⌋ of the sorted gaps, counted (a log's few distinct gaps), not sorted."""
    counts = Counter(b - a for a, b in zip(steps, islice(steps, 1, None)))
    rank = sum(counts.values()) // 2
    for gap in sorted(counts):
        rank -= counts[gap]
        if rank < 0:
            return gap
    return None


def resample(series: EnvelopeSeries, interval: int) -> EnvelopeSeries:
    """The series in blocks of ``interval`` steps — (0, K], (K, 2K], … — each the mean of the
    block's samples (V and every norm), at the step of the block's last sample; a partial
    first or last block (under half the samples of a typical block) is left out.

    `000`'s V(t) is an expected variance; a log of every step carries the minibatch noise of
    each step on top, and constants fitted at one sampling do not transfer to another. A series
    logged more often than the constants' ``sampling_interval`` is therefore checked on block
    means of that interval (docs/policy.md). A series sampled at least that coarsely is
    returned unchanged."""
    gap = median_gap(series.steps)
    if gap is None or interval <= 1 or gap >= interval:
        return series
    groups: list[range] = []  # steps increase, so each block is a range of samples
    lo = 0
    for j in range(1, len(series.steps) + 1):
        if j == len(series.steps) or -(-series.steps[j] // interval) != -(-series.steps[lo] // interval):
            groups.append(range(lo, j))
            lo = j
    full = sorted(len(g) for g in groups)[len(groups) // 2]
    # a first or last block holding under half the samples of a typical one is a partial
    # block: its mean carries more noise than the constants were fitted to, so it is left out
    while len(groups) > 2 and 2 * len(groups[-1]) < full:
        groups.pop()
    while len(groups) > 2 and 2 * len(groups[0]) < full:
        groups.pop(0)

    def mean(xs: Sequence[float | None]) -> float | None:
        known = [x for x in xs if x is not None]
        return sum(known) / len(known) if known else None

    if isinstance(series.values, columns.LazyValues):  # a long log: the block means stay typed
        return _resample_compact(series, groups, interval, mean)
    values = {k: tuple(mean([v[j] for j in g]) for g in groups) for k, v in series.values.items()}
    norms = (
        None
        if series.norms is None
        else {
            k: tuple(tuple(mean(by_e) for by_e in zip(*(v[j] for j in g), strict=True)) for g in groups)
            for k, v in series.norms.items()
        }
    )
    return replace(
        series,
        steps=tuple(series.steps[g[-1]] for g in groups),
        values=values,
        norms=norms,
        notes={},
        origin=f"{series.origin} (means over blocks of {interval} steps)",
    )


Mean = Callable[[Sequence[float | None]], float | None]


def _resample_compact(series: EnvelopeSeries, groups: Sequence[range], interval: int, mean: Mean) -> EnvelopeSeries:
    """:func:`resample` of a parsed log's series, the same means kept in typed arrays: V's block
    means as a :class:`Column` (8 bytes a block), the norms' as :class:`Rows` views."""
    values = {
        k: Column(array("d", [math.nan if (m := mean([v[j] for j in g])) is None else m for g in groups]))
        for k, v in series.values.items()
    }
    norms: dict[str, columns.RowsView] = {}
    for k, vectors in (series.norms or {}).items():
        rows = Rows(len(vectors[0]) if len(vectors) else 0)
        for g in groups:
            rows.append(tuple(mean(by_e) for by_e in zip(*(vectors[j] for j in g), strict=True)))
        norms[k] = columns.RowsView(rows, 0, len(rows))
    return replace(
        series,
        steps=Column(array("q", [series.steps[g[-1]] for g in groups])),
        values=values,
        norms=norms if series.norms is not None else None,
        notes={},
        origin=f"{series.origin} (means over blocks of {interval} steps)",
    )


def from_rows(
    source: str,
    steps: Sequence[int],
    rows: Mapping[str, Rows],
    variant: str,
    *,
    origin: str = "",
) -> EnvelopeSeries:
    """:func:`from_norms` of norms built in typed rows (a starved copy of a long run for the
    falsifiability checks): kept as a parsed log is, V computed per series when asked for with
    the same function, so every number equals :func:`from_norms`'s."""
    _check_steps(steps, origin, variant)
    for layer, r in rows.items():
        if len(r) != len(steps):
            raise InputError(f"layer {layer}: {len(r)} norm vectors for {len(steps)} steps", path=origin or None)
    views = {k: columns.RowsView(r, 0, len(r)) for k, r in rows.items()}
    values = columns.LazyValues(views, variant)
    return EnvelopeSeries(_source(source), variant, steps, values, views, columns.LazyNotes(values), origin)


def _source(source: str) -> str:
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    return source


def _check_steps(steps: Sequence[int], origin: str, variant: str) -> None:
    if variant not in VARIANTS:
        raise InputError(f"envelope variant must be one of {VARIANTS}, got {variant!r}")
    for a, b in zip(steps, islice(steps, 1, None)):
        if not b > a:
            raise InputError(f"steps must strictly increase, got {a} then {b}", path=origin or None)


# --- a long series (a parsed log of millions of steps): docs/envelope.md, "Long series" ------------


def _compact_series(
    source: str, metrics: MetricsSeries, variant: str, *, findings: tuple[LogFinding, ...]
) -> EnvelopeSeries:
    """:func:`moeaudit.judge.envelope.from_metrics` of a parsed log, left in its arrays: the
    steps as their :class:`Column`, the norms as views, V computed per series when asked for."""
    views = {k: v for k, v in ((k, columns.compact(v)) for k, v in metrics.norms.items()) if v is not None}
    values = columns.LazyValues(views, variant)
    steps = metrics.steps if isinstance(metrics.steps, Column) else tuple(metrics.steps)
    return EnvelopeSeries(source, variant, steps, values, views, columns.LazyNotes(values), metrics.path, findings)


def _keep_compact(series: EnvelopeSeries, lo: int, hi: int) -> EnvelopeSeries:
    """Samples ``lo``..``hi`` of a compact series, still compact (``since``, ``between``)."""
    if lo == 0 and hi == len(series.steps):
        return series  # nothing dropped: no copy of the steps
    views = {
        k: columns.RowsView(v, lo, hi)
        for k, v in (series.norms or {}).items()
        if isinstance(v, (Rows, columns.RowsView))
    }
    values = columns.LazyValues(views, series.variant)
    return replace(series, steps=series.steps[lo:hi], norms=views, values=values, notes=columns.LazyNotes(values))
