"""The Gradient Starvation Envelope (`000` §6, §10; SPEC §7): checks, report, calibration, alerts.

A series ``V(t_j)`` — ``var_grad`` ("raw") or ``var_grad_norm`` ("normalized") per routed layer
and pooled, at training steps t_0 < t_1 < … from training logs or checkpoint replays — is held
to two conditions, and is compliant only if both hold everywhere:

* discrete, between consecutive samples Δ = t_{j+1} − t_j steps apart, the Δ-fold composition of
  `000` Eq. 11: ``V(t_{j+1}) ≤ (1−δ)^Δ V(t_j) + ε (1 − (1−δ)^Δ)/δ``;
* Grönwall (`000` Eq. 12), in compliance windows of length τ anchored at a sample a:
  ``B(t) = V(a) e^{−δ(t−a)} + ε/δ`` and margin ``B(t) − V(t) ≥ 0`` at every sample of the window.

Window rule: the first sample anchors window 0; a window holds its anchor and every later sample
at most τ steps after it (closed, as `000` Clause 1), and at least the next sample (a window
whose horizon holds none is *stretched* to it and marked so). Its last sample anchors the next
window, so every sample after the first is checked against a bound anchored strictly before it.

Everything here takes plain Python data (STYLE: torch stays out of the envelope algebra); the
per-step variances come from :mod:`moeaudit.metrics`. See ``docs/envelope.md``.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, cast

from moeaudit.errors import InputError
from moeaudit.judge import envelope_columns as columns
from moeaudit.metrics import POOLED, VARIANTS, Column, MetricsSeries, Rows, var_grad, variance_series
from moeaudit.policy import EnvelopeSettings, alert_rule_problem
from moeaudit.records import EnvelopeReport

SCHEMA = "moeaudit.envelope/v1"
SOURCES = ("logs", "replay", "probe")  # probe: the hook's canary probe (canary_probe.jsonl)
RTOL = 1e-9  # floating-point slack on "margin ≥ 0", relative to the bound
CALIBRATION_C = 3.0  # `000` Eq. 16 safety margin, SPEC §7


# --- the bounds (`000` Eq. 11, 12, 18) -----------------------------------------------------------


def _decay(delta: float, gap: float) -> tuple[float, float]:
    """``(1−δ)^Δ`` and ``1 − (1−δ)^Δ``, the latter without cancellation when δΔ is small."""
    x = gap * math.log1p(-delta)
    return math.exp(x), -math.expm1(x)


def composed_bound(v_prev: float, delta: float, epsilon: float, gap: int) -> float:
    """Eq. 11 applied Δ times: ``(1−δ)^Δ V + ε (1 − (1−δ)^Δ)/δ``."""
    q, one_minus_q = _decay(delta, gap)
    return q * v_prev + epsilon * one_minus_q / delta


def gronwall(v0: float, t0: float, t: float, delta: float, epsilon: float) -> float:
    """Eq. 12 for a window anchored at t0: ``V(t0) e^{−δ(t−t0)} + ε/δ``."""
    return v0 * math.exp(-delta * (t - t0)) + epsilon / delta


def budget(delta: float, epsilon: float) -> float:
    """Residual imbalance budget ε/δ (Eq. 18)."""
    return epsilon / delta


def _holds(value: float, bound: float) -> bool:
    return bound - value >= -RTOL * abs(bound)


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
    findings: tuple[dict[str, Any], ...] = ()

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
    findings: Iterable[dict[str, Any]] = (),
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
    if columns.compactable(metrics.norms):
        _check_steps(metrics.steps, metrics.path, variant)
        return _compact_series(_source(source), metrics, variant, findings=tuple(f.to_json() for f in metrics.findings))
    return from_norms(
        source,
        metrics.steps,
        metrics.norms,
        variant,
        origin=metrics.path,
        findings=[f.to_json() for f in metrics.findings],
    )


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


# --- windows and checks --------------------------------------------------------------------------


def segments(steps: Sequence[int], breaks: Iterable[int] = ()) -> list[range]:
    """Sample index ranges split before the first sample at or after each break step."""
    cuts = sorted({j for b in breaks if 0 < (j := bisect_left(steps, b)) < len(steps)})
    bounds = [0, *cuts, len(steps)]
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


def windows(steps: Sequence[int], window: int) -> list[tuple[int, list[int]]]:
    """``(anchor index, member indices after it)`` per window (rule in the module docstring)."""
    out: list[tuple[int, list[int]]] = []
    i = 0
    while i < len(steps) - 1:
        members = [i + 1]
        while members[-1] + 1 < len(steps) and steps[members[-1] + 1] - steps[i] <= window:
            members.append(members[-1] + 1)
        out.append((i, members))
        i = members[-1]
    return out


def discrete_checks(
    steps: Sequence[int], values: Sequence[float | None], delta: float, epsilon: float
) -> list[dict[str, Any]]:
    """The composed Eq. 11 condition for every consecutive pair of samples."""
    out = []
    for j in range(len(steps) - 1):
        gap, v0, v1 = steps[j + 1] - steps[j], values[j], values[j + 1]
        row: dict[str, Any] = {
            "from_step": steps[j],
            "to_step": steps[j + 1],
            "gap": gap,
            "value_from": v0,
            "value": v1,
        }
        if v0 is None or v1 is None:
            row.update(bound=None, margin=None, compliant=False, reason="non-finite value")
        else:
            bound = composed_bound(v0, delta, epsilon, gap)
            row.update(bound=bound, margin=bound - v1, compliant=_holds(v1, bound))
        out.append(row)
    return out


@dataclass(frozen=True)
class SeriesCheck:
    """One series checked: the per-sample log (`000` §8.4), its windows and its discrete pairs."""

    samples: list[dict[str, Any]]
    windows: list[dict[str, Any]]
    discrete: list[dict[str, Any]]

    @property
    def compliant(self) -> bool:
        return all(r["compliant"] for r in self.samples + self.windows + self.discrete)


def check_series(
    steps: Sequence[int],
    values: Sequence[float | None],
    delta: float,
    epsilon: float,
    window: int,
    *,
    breaks: Iterable[int] = (),
    notes: Mapping[int, str] | None = None,
) -> SeriesCheck:
    """Grönwall windows and discrete checks of one series, restarting at each break."""
    notes = notes or {}
    samples: list[dict[str, Any]] = []
    wins: list[dict[str, Any]] = []
    discrete: list[dict[str, Any]] = []
    for seg in segments(steps, breaks):
        t, v = [steps[j] for j in seg], [values[j] for j in seg]
        first = None if v[0] is None else gronwall(v[0], t[0], t[0], delta, epsilon)
        samples.append(_row(t[0], v[0], first, len(wins) if len(t) > 1 else None, notes.get(seg[0])))
        for anchor, members in windows(t, window):
            v_a, t_a, index = v[anchor], t[anchor], len(wins)
            rows = [
                _row(
                    t[m],
                    v[m],
                    None if v_a is None else gronwall(v_a, t_a, t[m], delta, epsilon),
                    index,
                    notes.get(seg[m]) or (None if v_a is not None else "anchor is non-finite"),
                )
                for m in members
            ]
            samples.extend(rows)
            wins.append(
                {
                    "index": index,
                    "start": t_a,
                    "end": t[members[-1]],
                    "anchor_value": v_a,
                    "samples": len(members) + 1,
                    "stretched": t[members[-1]] - t_a > window,
                    "min_margin": _min_margin(rows),
                    "compliant": v_a is not None and all(r["compliant"] for r in rows),
                }
            )
        discrete.extend(discrete_checks(t, v, delta, epsilon))
    return SeriesCheck(samples, wins, discrete)


def holds(
    steps: Sequence[int],
    values: Sequence[float],
    delta: float,
    epsilon: float,
    window: int,
    *,
    breaks: Iterable[int] = (),
) -> bool:
    """``check_series(...).compliant`` for a finite series, stopping at the first violation."""
    for seg in segments(steps, breaks):
        t, v = [steps[j] for j in seg], [values[j] for j in seg]
        for j in range(len(t) - 1):
            if not _holds(v[j + 1], composed_bound(v[j], delta, epsilon, t[j + 1] - t[j])):
                return False
        for anchor, members in windows(t, window):
            for m in members:
                if not _holds(v[m], gronwall(v[anchor], t[anchor], t[m], delta, epsilon)):
                    return False
    return True


def _row(step: int, value: float | None, bound: float | None, window: int | None, why: str | None) -> dict[str, Any]:
    if value is None or bound is None:
        return {
            "step": step,
            "value": value,
            "bound": bound,
            "margin": None,
            "compliant": False,
            "window": window,
            "reason": why or "non-finite value",
        }
    return {
        "step": step,
        "value": value,
        "bound": bound,
        "margin": bound - value,
        "compliant": _holds(value, bound),
        "window": window,
    }


def _min_margin(rows: list[dict[str, Any]]) -> float | None:
    margins = [r["margin"] for r in rows if r["margin"] is not None]
    return min(margins) if margins else None


# --- alert rule (`000` Eq. 21) and dead experts (§10.3) ------------------------------------------


def alerts(
    steps: Sequence[int],
    norms: Sequence[Sequence[float | None]],
    values: Sequence[float | None],
    a: float,
    b: float,
    n: int,
) -> list[dict[str, Any]]:
    """Eq. 21 on one series: ``max_e g_e < a ∧ V > b`` for n consecutive samples.

    One alert per run of consecutive samples meeting the condition, firing at the n-th; a
    sample with a non-finite norm or value ends a run (it is already a finding).
    """
    out: list[dict[str, Any]] = []
    run: list[int] = []
    for j, (g_E, v) in enumerate(zip(norms, values, strict=True)):
        known = v is not None and all(g is not None for g in g_E)
        if known and max(g_E) < a and v > b:  # type: ignore[operator, type-var]
            run.append(j)
            if len(run) == n:
                out.append(
                    {
                        "step": steps[j],
                        "since": steps[run[0]],
                        "until": steps[j],
                        "samples": n,
                        "max_grad": max(g_E),  # type: ignore[type-var]
                        "value": v,
                    }
                )
            elif len(run) > n:
                out[-1].update(until=steps[j], samples=len(run))
        else:
            run = []
    return out


def dead_experts(
    steps: Sequence[int], norms: Sequence[Sequence[float | None]], dead_grad: float, dead_steps: int
) -> list[dict[str, Any]]:
    """§10.3: expert e is dead once ``g_e < dead_grad`` for more than ``dead_steps`` steps.

    Counted in training steps, not samples (logs may be every K steps): a run of consecutive
    below-threshold samples from t_i to t_j spans t_j − t_i + 1 steps, assuming the unlogged
    steps between them were below too. A null norm ends a run.
    """
    out: list[dict[str, Any]] = []
    for e in range(len(norms[0]) if norms else 0):
        since: int | None = None
        entry: dict[str, Any] | None = None
        for j, g_E in enumerate(norms):
            g = g_E[e]
            if g is not None and g < dead_grad:
                since = steps[j] if since is None else since
                if steps[j] - since + 1 > dead_steps:
                    if entry is None:
                        entry = {"expert": e, "since": since, "step": steps[j]}
                        out.append(entry)
                    entry.update(until=steps[j], steps=steps[j] - since + 1, recovered=False)
            else:
                if entry is not None and g is not None:
                    entry["recovered"] = True
                since, entry = None, None
    return out


def starvation(
    steps: Sequence[int], norms: Sequence[Sequence[float | None]], share: float, max_steps: int, fraction: float = 0.5
) -> list[dict[str, Any]]:
    """The level side of `000` §8.1 / Eq. 13: expert e is starved when, in some window of
    ``max_steps`` consecutive training steps, at least ``fraction`` of the logged samples give it
    a share of the layer's gradient signal g_e / mean_e g below ``share``. Counting the fraction
    (not one unbroken stretch) catches starvation that comes and goes (issue 23 §4).

    Only windows the series covers whole are judged (see :func:`starvation_evaluable`); a
    sample with a null norm or an all-zero layer is not counted either way. One entry per
    expert: the first window that meets the rule, with its worst share and starved fraction.
    """
    out: list[dict[str, Any]] = []
    if not steps:
        return out
    start = steps[0]
    shares: list[list[float | None]] = []
    for g_E in norms:
        known = all(g is not None for g in g_E) and sum(g_E) > 0  # type: ignore[arg-type]
        total = sum(g_E) if known else 0.0  # type: ignore[arg-type]
        shares.append([g * len(g_E) / total if known else None for g in g_E])  # type: ignore[operator]
    for e in range(len(norms[0]) if norms else 0):
        lo = 0
        for j, t in enumerate(steps):
            while steps[lo] <= t - max_steps:
                lo += 1
            if t - start + 1 < max_steps:
                continue  # the window (t − max_steps, t] reaches before the series
            seen: list[float] = [x for i in range(lo, j + 1) if (x := shares[i][e]) is not None]
            low = [x for x in seen if x < share]
            if seen and len(low) >= fraction * len(seen):
                out.append(
                    {
                        "expert": e,
                        "since": steps[lo],
                        "step": t,
                        "until": t,
                        "steps": max_steps,
                        "share": min(low),
                        "fraction": len(low) / len(seen),
                        "samples": len(seen),
                    }
                )
                break
    return out


def starvation_evaluable(steps: Sequence[int], max_steps: int) -> bool:
    """Can :func:`starvation` fire on this series at all: does it cover one whole window?"""
    return bool(steps) and steps[-1] - steps[0] + 1 >= max_steps


def unevaluable_rules(series: EnvelopeSeries, settings: EnvelopeSettings) -> list[dict[str, Any]]:
    """Gated rules that could not fire on this series (too few samples or too short a span):
    such a rule is not evaluated — never "compliant" (issue 23 §1)."""
    out = []
    span = series.steps[-1] - series.steps[0] + 1 if series.steps else 0
    if series.norms is None:
        out.append({"check": "starvation", "reason": "no per-expert gradient norms in the series"})
    elif not starvation_evaluable(series.steps, settings.starve_steps):
        out.append(
            {
                "check": "starvation",
                "reason": f"the series spans {span} step(s) (steps {series.steps[0]}–"
                f"{series.steps[-1]}); the level rule judges windows of "
                f"envelope.starve_steps = {settings.starve_steps} steps",
            }
        )
    return out


# --- the report (`moeaudit.envelope/v1`) ---------------------------------------------------------


def evaluate(
    series: EnvelopeSeries, settings: EnvelopeSettings, *, breaks: Iterable[int] = (), policy_path: str | None = None
) -> EnvelopeReport:
    """Check every series of ``series`` under ``settings``; the plain-dict envelope report.

    ``breaks``: steps of resume / regime-change events; windows re-anchor at the first sample at
    or after each, and the discrete pair across it is not checked (listed under ``skipped``).
    """
    _check_fit(series, settings, policy_path)
    d, e, tau = settings.delta, settings.epsilon, settings.window
    breaks = sorted(breaks)
    native = series
    if settings.calibrated:  # the variance bound at the sampling it was fitted at
        series = resample(series, settings.sampling_interval)
    # check_series in one pass a series, keeping the rows the report shows (docs/envelope.md,
    # "Long series"); the verdict is over every sample
    checks = {
        key: check_series_long(series.steps, values, d, e, tau, breaks=breaks, notes=series.notes.get(key))
        for key, values in series.values.items()
    }
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "source": series.source,
        "origin": series.origin,
        "variant": series.variant,
        "constants": {"delta": d, "epsilon": e, "window": tau, "budget": budget(d, e)},
        "calibrated": settings.calibrated,
        "provenance": settings.provenance,
        "rules": {
            "alert": {"a": settings.alert_a, "b": settings.alert_b, "n": settings.alert_n},
            "dead_expert": {"grad": settings.dead_grad, "steps": settings.dead_steps},
            "starvation": {
                "share": settings.starve_share,
                "steps": settings.starve_steps,
                "fraction": settings.starve_fraction,
            },
        },
        "series": {key: c.samples for key, c in checks.items()},
        "windows": [{"series": key, **w} for key, c in checks.items() for w in c.windows],
        "discrete": [{"series": key, **r} for key, c in checks.items() for r in c.discrete],
        "compliant": all(c.compliant for c in checks.values()),
        "first_violation": first_violation(checks),
        "alerts": [],
        "dead_experts": [],
        "starvation": [],
        "findings": list(series.findings),
        "skipped": [
            {
                "check": "discrete",
                "series": "*",
                "from_step": series.steps[s.start - 1],
                "to_step": series.steps[s.start],
                "reason": "resume / regime change between",
            }
            for s in segments(series.steps, breaks)[1:]
        ],
    }
    if any(c.thinned for c in checks.values()):
        report["shown"] = {key: c.counts for key, c in checks.items()}
    report["sampling"] = sampling(series, settings)
    if series is not native:
        report["sampling"]["resampled"] = {
            "native_gap": median_gap(native.steps),
            "block": settings.sampling_interval,
            "samples": len(series.steps),
        }
    if native.steps:
        report["window"] = {"from": native.steps[0], "to": native.steps[-1]}
    # The variance bound (Grönwall + Δ-step) is gated only under calibrated constants: under
    # 000 Table 6's illustrative ones it is reported, never a non-compliance (docs/policy.md).
    # ``compliant`` is the gated rules alone, what certify's envelope check reads; the variance
    # result is named as reported where it is not gated (``variance_within_bound``).
    report["variance_gated"] = bool(settings.calibrated)
    report["variance_within_bound"] = report["compliant"]
    report["compliant"] = report["compliant"] or not settings.calibrated
    report["unevaluable"] = unevaluable_rules(native, settings)
    _rules(native, settings, report)  # the level rules on every logged sample
    if report["starvation"]:
        report["compliant"] = False
        first = min(report["starvation"], key=lambda r: (r["step"], r["layer"] == POOLED))
        fv = report["first_violation"]
        if fv is None or first["step"] < fv["step"]:
            report["first_violation"] = {
                "layer": first["layer"],
                "step": first["step"],
                "check": "starvation",
                "expert": first["expert"],
                "value": first["share"],
                "bound": settings.starve_share,
                "steps": first["steps"],
                "fraction": first["fraction"],
                "series": [first["layer"]],
            }
    return cast(EnvelopeReport, report)


def sampling(series: EnvelopeSeries, settings: EnvelopeSettings) -> dict[str, Any]:
    """Is the series sampled as the constants assume, and can it fail at this sampling at all?

    ``envelope.sampling_interval`` is the gap the constants were fitted at (``calibrate``
    records it). Constants do not transfer between gaps: the Δ-step bound from V = 0,
    ``ε(1 − (1−δ)^Δ)/δ``, grows with Δ. For the normalized variant V of E experts is at most
    E − 1 (a variance over a squared mean of non-negative values), so where that bound
    reaches E − 1 no value can fail the discrete check, nor the Grönwall windows (whose bound
    is at least ε/δ): such series are listed under ``vacuous``.
    """
    gap = median_gap(series.steps)
    out: dict[str, Any] = {
        "policy_interval": settings.sampling_interval,
        "median_gap": gap,
        "floor_bound": None,
        "vacuous": [],
        "warnings": [],
    }
    if gap is None:
        return out
    if gap != settings.sampling_interval:
        out["warnings"].append(
            f"the constants are for samples every {settings.sampling_interval} steps "
            f"(envelope.sampling_interval); this series is sampled every {gap} (median gap) — "
            "constants fitted at one sampling do not transfer to another; calibrate at this one"
        )
    floor = composed_bound(0.0, settings.delta, settings.epsilon, gap)
    out["floor_bound"] = floor
    if series.variant != "normalized" or not series.norms:
        return out
    sizes = {k: len(next((v for v in vs if v is not None), ())) for k, vs in series.norms.items()}
    sizes[POOLED] = sum(sizes.values())
    out["vacuous"] = [k for k in series.values if k in sizes and floor >= sizes[k] - 1]
    if out["vacuous"]:
        out["warnings"].append(
            f"vacuous at this sampling: from V = 0 the {gap}-step bound is {floor:.4g}, at or above "
            f"the largest possible var_grad_norm (E − 1) of series {', '.join(out['vacuous'])}; "
            "nothing there can leave the envelope"
        )
    return out


def _check_fit(series: EnvelopeSeries, settings: EnvelopeSettings, policy_path: str | None) -> None:
    if series.variant != settings.variant:
        raise InputError(
            f"the series is {series.variant!r} variance but the policy asks for {settings.variant!r}",
            path=policy_path,
            hint="build the series with the policy's envelope.variant",
        )
    if len(series.steps) < 2:
        raise InputError("the envelope needs at least two samples (steps) of the series", path=series.origin or None)
    if series.norms is not None:
        sizes = {k: len(v[0]) for k, v in series.norms.items()}  # with_pooled's widths, not its copy
        sizes = {POOLED: sum(sizes.values()), **sizes}
        for key, size in sorted(sizes.items(), key=lambda kv: kv[0] == POOLED):  # layers first
            why = alert_rule_problem(settings.alert_a, settings.alert_b, settings.variant, size)
            if why:
                raise InputError(f"envelope.alert_b: on series {key!r}, {why}", path=policy_path)


def first_violation(checks: Mapping[str, SeriesCheck | columns.LongCheck]) -> dict[str, Any] | None:
    """The earliest step where any series leaves the envelope (a layer before "pooled")."""
    found = []
    for order, (key, c) in enumerate(checks.items()):
        rank = (key == POOLED, order)  # at a tie a layer names the place, pooled last
        for r in c.samples:
            if not r["compliant"]:
                found.append((r["step"], rank, key, "gronwall", r))
        for r in c.discrete:
            if not r["compliant"]:
                found.append((r["to_step"], rank, key, "discrete", r))
    if not found:
        return None
    step, _, key, check, r = min(found, key=lambda f: (f[0], f[1], f[3] != "gronwall"))
    return {
        "layer": key,
        "step": step,
        "check": check,
        "value": r["value"],
        "bound": r["bound"],
        **({"from_step": r["from_step"]} if check == "discrete" else {}),
        "series": [f[2] for f in sorted({f[:3] for f in found if f[0] == step}, key=lambda f: f[1])],
    }


def _rules(series: EnvelopeSeries, settings: EnvelopeSettings, report: dict[str, Any]) -> None:
    if series.norms is None:
        for check in ("alert rule (000 Eq. 21)", "dead experts (000 §10.3)", "starvation (000 §8.1 level side)"):
            report["skipped"].append(
                {"check": check, "series": "*", "reason": "no per-expert gradient norms in the series"}
            )
        return
    s = settings
    by_series = {POOLED: columns.PooledRows(series.norms), **series.norms}  # with_pooled, a step at a time
    for key, vectors in by_series.items():
        for a in alerts(series.steps, vectors, series.values[key], s.alert_a, s.alert_b, s.alert_n):
            report["alerts"].append({"series": key, **a})
    for layer, norms in series.norms.items():
        for dead in columns.dead_experts_columns(series.steps, norms, s.dead_grad, s.dead_steps):
            report["dead_experts"].append({"layer": layer, **dead})
        for starved in columns.starvation_columns(
            series.steps, norms, s.starve_share, s.starve_steps, s.starve_fraction
        ):
            report["starvation"].append({"layer": layer, **starved})


# --- calibration (`000` Eq. 16, SPEC §7) ---------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Constants fitted on a healthy run: ε = c·Var_t[V], δ = δ*/2."""

    settings: EnvelopeSettings  # the base settings with variant, δ, ε, calibrated, provenance
    delta_max: float  # δ*: the largest δ for which the healthy series is compliant with ε
    temporal_variance: dict[str, float]  # Var_t[V] per series (population)
    epsilon_series: str  # the series whose Var_t set ε
    binding: dict[str, Any] | None  # where the series leaves the envelope just above δ*
    c: float

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "variant": s.variant,
            "delta": s.delta,
            "epsilon": s.epsilon,
            "window": s.window,
            "budget": budget(s.delta, s.epsilon),
            "c": self.c,
            "delta_max": self.delta_max,
            "temporal_variance": self.temporal_variance,
            "epsilon_series": self.epsilon_series,
            "binding": self.binding,
            "eq17_window_min": math.ceil(3 / s.delta),
            "provenance": s.provenance,
        }


def calibrate(
    series: EnvelopeSeries, base: EnvelopeSettings, *, c: float = CALIBRATION_C, breaks: Iterable[int] = ()
) -> Calibration:
    """Fit ε and δ on a healthy series (SPEC §7), under ``base``'s window τ.

    ε = c·max over series of the population temporal variance Var_t[V] (`000` Eq. 16), so the
    most variable layer (or pooled) sets the floor every series must share. Compliance only
    gets easier as δ shrinks (both bounds decrease in δ), so δ* is found by bisection on
    log δ in (0, 1), under the Grönwall windows and the discrete checks together; δ = δ*/2.
    """
    breaks = sorted(breaks)
    finite = _healthy_values(series, c)
    tv = {key: var_grad(values) for key, values in finite.items()}
    key = max(tv, key=lambda k: tv[k])
    epsilon = c * tv[key]
    if not epsilon > 0:
        raise InputError(
            "the healthy series has zero temporal variance, so ε = c·Var_t[V] = 0",
            path=series.origin or None,
            hint="calibrate on a run with real updates",
        )

    def check(delta: float) -> dict[str, SeriesCheck]:
        return {
            k: check_series(series.steps, v, delta, epsilon, base.window, breaks=breaks)
            for k, v in series.values.items()
        }

    def ok(delta: float) -> bool:
        return all(holds(series.steps, v, delta, epsilon, base.window, breaks=breaks) for v in finite.values())

    lo, hi = 1e-12, 1.0 - 1e-12
    if not ok(lo):
        where = first_violation(check(lo)) or {}
        c_min = _epsilon_floor(series.steps, finite, breaks) / tv[key]
        raise InputError(
            f"the healthy series is not compliant for any δ with ε = {c:g}·Var_t[V] "
            f"= {epsilon:.6g}: series {where.get('layer')!r} leaves the envelope at "
            f"step {where.get('step')} ({where.get('check')} check) even as δ → 0",
            path=series.origin or None,
            hint=f"a rise between samples Δ steps apart must stay below ε·Δ, which "
            f"needs c > {c_min:.4g} here (Eq. 16 is not scale-free: Var_t[V] "
            f"has units of V²; see docs/envelope.md)",
        )
    if ok(hi):
        lo = hi
    while hi / lo > 1 + 1e-7:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    binding = first_violation(check(hi)) if hi > lo else None
    delta = lo / 2
    steps = series.steps
    provenance = (
        f"calibrated on {series.origin or 'a healthy run'} ({series.source}, steps "
        f"{steps[0]}–{steps[-1]}, {len(steps)} samples, variant {series.variant}): "
        f"ε = c·Var_t[V], c = {c:g}, population variance over time of series {key!r}; "
        f"δ = δ*/2, δ* = {lo:.6g} under window τ = {base.window}"
    )
    gaps = sorted(b - a for a, b in zip(series.steps, series.steps[1:], strict=False))
    settings = replace(
        base,
        variant=series.variant,
        delta=delta,
        epsilon=epsilon,
        calibrated=True,
        provenance=provenance,
        sampling_interval=gaps[len(gaps) // 2],
    )
    return Calibration(settings, lo, tv, key, binding, c)


def _epsilon_floor(steps: Sequence[int], finite: Mapping[str, Sequence[float]], breaks: Sequence[int]) -> float:
    """The ε the discrete checks need as δ → 0 (bound → V + εΔ): the largest rise per step."""
    rises = [
        (v[j + 1] - v[j]) / (steps[j + 1] - steps[j])
        for v in finite.values()
        for seg in segments(steps, breaks)
        for j in seg[:-1]
    ]
    return max([0.0, *rises])


def _healthy_values(series: EnvelopeSeries, c: float) -> dict[str, list[float]]:
    if not c > 0:
        raise ValueError(f"c must be > 0, got {c}")
    if len(series.steps) < 3:
        raise InputError("calibration needs at least three samples of the healthy run", path=series.origin or None)
    for key, values in series.values.items():
        bad = [series.steps[j] for j, v in enumerate(values) if v is None]
        if bad:
            raise InputError(
                f"the healthy series {key!r} has no finite value at step(s) {bad[:5]}",
                path=series.origin or None,
                hint="a run with non-finite gradient norms is not a healthy reference",
            )
    return {key: [v for v in values if v is not None] for key, values in series.values.items()}


# --- falsifiable constants (issue 13: an envelope nothing can fail certifies nothing) -----------

C_RANGE = (2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0)  # `000` §6.5.2: "typically c ∈ [2, 5]"
LEVEL_SAFETY = 2.0  # starve_share = (lowest share the healthy run showed) / 2


def calibrate_tightest(
    series: EnvelopeSeries, base: EnvelopeSettings, *, breaks: Iterable[int] = (), cs: Sequence[float] = C_RANGE
) -> Calibration:
    """Eq. 16 for every c in ``cs``; keep the fit with the smallest residual budget ε/δ.

    With noisy logged norms the Δ-step check binds: a rise between samples needs ε·Δ, so a
    small c forces δ* → 0 and ε/δ up to the largest possible value (E − 1 for the normalized
    variant) — constants no series can fail. The paper leaves c in [2, 5]; the tightest
    envelope the healthy run still satisfies is the most falsifiable choice.
    """
    fits, errors = [], []
    for c in cs:
        try:
            fits.append(calibrate(series, base, c=c, breaks=breaks))
        except InputError as exc:
            errors.append(exc)
    if not fits:
        raise errors[-1]
    best = min(fits, key=lambda f: budget(f.settings.delta, f.settings.epsilon))
    s = best.settings
    share = healthy_share(series)
    window = s.window
    if window < 3 / s.delta:
        raise InputError(
            f"the fitted δ = {s.delta:.4g} needs a compliance window τ ≥ 3/δ = "
            f"{math.ceil(3 / s.delta)} steps (000 Eq. 17), the policy has {window}",
            path=series.origin or None,
            hint="raise envelope.window and calibrate again",
        )
    provenance = (
        s.provenance + f"; c = {best.c:g} chosen in [{cs[0]:g}, {cs[-1]:g}] for the smallest "
        f"budget ε/δ = {budget(s.delta, s.epsilon):.4g}"
    )
    if share is not None:
        provenance += (
            f"; starve_share = {share:.4g}/{LEVEL_SAFETY:g} (1% quantile of the healthy run's expert shares, halved)"
        )
    starve_share = s.starve_share if share is None else share / LEVEL_SAFETY
    settings = replace(s, calibration_c=best.c, provenance=provenance, starve_share=starve_share)
    return replace(best, settings=settings)


SHARE_QUANTILE = 0.01  # robust: a few zero norms in a healthy log cannot set the share to 0


def healthy_share(series: EnvelopeSeries) -> float | None:
    """A low quantile (1%) of g_e / mean_e g over the healthy run's layers, samples and
    experts — not the minimum, which one zero norm would set to 0 (issue 23 §3)."""
    if not series.norms:
        return None
    shares = []
    for vectors in series.norms.values():
        for g_E in vectors:
            known_E = [g for g in g_E if g is not None]
            if len(known_E) == len(g_E) and sum(known_E) > 0:
                shares += [g * len(known_E) / sum(known_E) for g in known_E]
    if not shares:
        return None
    shares.sort()
    return shares[int(SHARE_QUANTILE * (len(shares) - 1))]


def half_dead(series: EnvelopeSeries) -> EnvelopeSeries:
    """The healthy run's steps with the first half of every layer's experts at zero gradient
    for the whole run (the others as logged) — starvation every useful envelope must reject."""
    if not series.norms:
        raise InputError("a falsifiability check needs per-expert gradient norms", path=series.origin or None)
    norms = {
        layer: [
            [0.0 if e < len(g_E) // 2 else (g if g is not None else 0.0) for e, g in enumerate(g_E)] for g_E in vectors
        ]
        for layer, vectors in series.norms.items()
    }
    return from_norms(
        series.source,
        series.steps,
        norms,
        series.variant,
        origin=f"{series.origin} (half the experts at zero gradient)",
    )


def known_bad(series: EnvelopeSeries) -> EnvelopeSeries:
    """The healthy run's steps with one expert per layer carrying the gradient signal and the
    others at 1e-5 of it (a starved layer) — a series every useful envelope must reject."""
    if not series.norms:
        raise InputError("a falsifiability check needs per-expert gradient norms", path=series.origin or None)
    norms = {}
    for layer, vectors in series.norms.items():
        rows = []
        for g_E in vectors:
            known = [g for g in g_E if g is not None]
            top = max(known) if known else 1.0
            rows.append([top, *([top * 1e-5] * (len(g_E) - 1))])
        norms[layer] = rows
    return from_norms(
        series.source,
        series.steps,
        norms,
        series.variant,
        origin=f"{series.origin} (starved: one expert per layer, others ×1e-5)",
    )


def falsifiability(series: EnvelopeSeries, settings: EnvelopeSettings, breaks: Iterable[int] = ()) -> dict[str, Any]:
    """Does the envelope under ``settings`` reject a starved version of ``series``, and which
    side rejects it? The normalized variance of E non-negative norms is at most E − 1; a budget
    ε/δ at or above half of that is flagged as too loose to be evidence."""
    bad = evaluate(known_bad(series), settings, breaks=breaks)
    fv: Mapping[str, Any] = bad["first_violation"] or {}
    sizes = [len(v[0]) for v in (series.norms or {}).values() if v]
    E = min(sizes) if sizes else None
    b = budget(settings.delta, settings.epsilon)
    out: dict[str, Any] = {
        "known_bad_rejected": not bad["compliant"],
        "caught_by": fv.get("check"),
        "at_step": fv.get("step"),
        "budget": b,
        "variance_cap": None,
        "variance_side_falsifiable": None,
    }
    if settings.variant == "normalized" and E:
        out["variance_cap"] = E - 1
        out["variance_side_falsifiable"] = b < (E - 1) / 2
    return out


# --- a long series (a parsed log of millions of steps): docs/envelope.md, "Long series" ------------


def _compact_series(
    source: str, metrics: MetricsSeries, variant: str, *, findings: tuple[dict[str, Any], ...]
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


def check_series_long(
    steps: Sequence[int],
    values: Sequence[float | None],
    delta: float,
    epsilon: float,
    window: int,
    *,
    breaks: Sequence[int] = (),
    notes: Mapping[int, str] | None = None,
) -> columns.LongCheck:
    """:func:`moeaudit.judge.envelope.check_series` in one pass: the same rows (built by the same
    ``_row``), the same windows and discrete pairs, keeping the ones :class:`_Shown` picks."""
    notes = notes if notes is not None else {}  # (a lazy mapping's truth value would walk it)
    n = len(steps)
    segs = segments(steps, breaks)
    n_windows = _count_windows(steps, segs, window)
    samples, wins, pairs = columns.Shown(n), columns.Shown(n_windows), columns.Shown(n - len(segs))
    ok = True
    i_pair = 0
    index = 0
    for seg in segs:
        lo, hi = seg.start, seg.stop
        v_prev = values[lo]  # every value is read once, in step order
        first = None if v_prev is None else gronwall(v_prev, steps[lo], steps[lo], delta, epsilon)
        row = _row(steps[lo], v_prev, first, index if hi - lo > 1 else None, notes.get(lo))
        ok &= row["compliant"]
        samples.add(lo, row, row["compliant"], row["margin"])
        # Grönwall windows (windows(): anchor i, members i+1 … while within τ, at least one),
        # and the discrete pair (m − 1, m) of discrete_checks at each member m
        i = lo
        while i < hi - 1:
            t_a, v_a = steps[i], v_prev
            m = i + 1
            min_margin: float | None = None
            all_ok = v_a is not None
            while True:
                v = values[m]
                gap, a = steps[m] - steps[m - 1], v_prev
                if a is None or v is None:
                    bound, margin, good = None, None, False
                else:
                    bound = composed_bound(a, delta, epsilon, gap)
                    margin, good = bound - v, _holds(v, bound)
                ok &= good
                if pairs.wants(i_pair, good, margin):
                    r: dict[str, Any] = {
                        "from_step": steps[m - 1],
                        "to_step": steps[m],
                        "gap": gap,
                        "value_from": a,
                        "value": v,
                    }
                    if bound is None:
                        r.update(bound=None, margin=None, compliant=False, reason="non-finite value")
                    else:
                        r.update(bound=bound, margin=margin, compliant=good)
                    pairs.add(i_pair, r, good, margin)
                elif not good:
                    pairs.noncompliant += 1
                i_pair += 1
                bound = None if v_a is None else gronwall(v_a, t_a, steps[m], delta, epsilon)
                if v is None or bound is None:
                    margin, good = None, False
                else:
                    margin, good = bound - v, _holds(v, bound)
                    min_margin = margin if min_margin is None or margin < min_margin else min_margin
                all_ok &= good
                if samples.wants(m, good, margin):
                    why = notes.get(m) or (None if v_a is not None else "anchor is non-finite")
                    samples.add(m, _row(steps[m], v, bound, index, why), good, margin)
                elif not good:
                    samples.noncompliant += 1
                v_prev = v
                if m + 1 < hi and steps[m + 1] - t_a <= window:
                    m += 1
                else:
                    break
            ok &= all_ok
            w = {
                "index": index,
                "start": t_a,
                "end": steps[m],
                "anchor_value": v_a,
                "samples": m - i + 1,
                "stretched": steps[m] - t_a > window,
                "min_margin": min_margin,
                "compliant": all_ok,
            }
            wins.add(index, w, all_ok, min_margin)
            index += 1
            i = m
    s_rows, w_rows, p_rows = samples.rows(), wins.rows(), pairs.rows()
    counts = {
        name: {"evaluated": s.n, "shown": len(rows), "noncompliant": s.noncompliant}
        for name, s, rows in (("samples", samples, s_rows), ("windows", wins, w_rows), ("discrete", pairs, p_rows))
    }
    return columns.LongCheck(s_rows, w_rows, p_rows, ok, counts)


def _count_windows(steps: Sequence[int], segs: Sequence[range], window: int) -> int:
    n = 0
    for seg in segs:
        i, hi = seg.start, seg.stop
        while i < hi - 1:
            m = i + 1
            while m + 1 < hi and steps[m + 1] - steps[i] <= window:
                m += 1
            n, i = n + 1, m
    return n
