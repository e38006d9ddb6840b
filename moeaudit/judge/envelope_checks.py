"""The bounds of the Gradient Starvation Envelope and the checks of one series (`000` §6, Eq. 11,
12, 18; docs/envelope.md): the Grönwall windows and the Δ-fold discrete condition, on a short series
(:func:`check_series`) and in one streamed pass on a long one (:func:`check_series_long`).

The window rule and the conditions are stated in :mod:`moeaudit.judge.envelope`; see
``docs/envelope.md``."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from moeaudit.judge import envelope_columns as columns
from moeaudit.records import EnvelopeSample, PairCheck, ShownRows, WindowCheck

RTOL = 1e-9  # floating-point slack on "margin ≥ 0", relative to the bound


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
) -> list[PairCheck]:
    """The composed Eq. 11 condition for every consecutive pair of samples."""
    out = []
    for j in range(len(steps) - 1):
        gap, v0, v1 = steps[j + 1] - steps[j], values[j], values[j + 1]
        bound = None if v0 is None or v1 is None else composed_bound(v0, delta, epsilon, gap)
        out.append(pair_row(steps[j], steps[j + 1], gap, v0, v1, bound))
    return out


def pair_row(
    from_step: int, to_step: int, gap: int, value_from: float | None, value: float | None, bound: float | None
) -> PairCheck:
    """One discrete pair; ``bound`` None: a value is non-finite (the pair is not compliant)."""
    finite = value is not None and bound is not None
    row: PairCheck = {
        "from_step": from_step,
        "to_step": to_step,
        "gap": gap,
        "value_from": value_from,
        "value": value,
        "bound": bound if finite else None,
        "margin": bound - value if value is not None and bound is not None else None,
        "compliant": _holds(value, bound) if value is not None and bound is not None else False,
    }
    if not finite:
        row["reason"] = "non-finite value"
    return row


@dataclass(frozen=True)
class SeriesCheck:
    """One series checked: the per-sample log (`000` §8.4), its windows and its discrete pairs."""

    samples: list[EnvelopeSample]
    windows: list[WindowCheck]
    discrete: list[PairCheck]

    @property
    def compliant(self) -> bool:
        rows: list[EnvelopeSample | WindowCheck | PairCheck] = [*self.samples, *self.windows, *self.discrete]
        return all(r["compliant"] for r in rows)


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
    samples: list[EnvelopeSample] = []
    wins: list[WindowCheck] = []
    discrete: list[PairCheck] = []
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


def _row(step: int, value: float | None, bound: float | None, window: int | None, why: str | None) -> EnvelopeSample:
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


def _min_margin(rows: list[EnvelopeSample]) -> float | None:
    margins = [r["margin"] for r in rows if r["margin"] is not None]
    return min(margins) if margins else None


# --- a long series (a parsed log of millions of steps): docs/envelope.md, "Long series" ------------


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
    samples = columns.Shown[EnvelopeSample](n)
    wins = columns.Shown[WindowCheck](n_windows)
    pairs = columns.Shown[PairCheck](n - len(segs))
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
                    pairs.add(i_pair, pair_row(steps[m - 1], steps[m], gap, a, v, bound), good, margin)
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
            w: WindowCheck = {
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
    counts: ShownRows = {
        "samples": samples.count(s_rows),
        "windows": wins.count(w_rows),
        "discrete": pairs.count(p_rows),
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
