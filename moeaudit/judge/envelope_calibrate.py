"""Envelope constants fitted on a healthy run (`000` Eq. 16; docs/envelope.md): ε = c·Var_t[V], δ = δ*/2,
the tightest c in `000`'s range, the starvation share, and whether the fitted envelope rejects a
starved version of the run (falsifiability). See ``docs/envelope.md``."""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from moeaudit.errors import InputError
from moeaudit.judge.envelope_checks import (
    RTOL,
    _holds,
    budget,
    check_series_long,
    composed_bound,
    gronwall,
    segments,
    windows,
)
from moeaudit.judge.envelope_columns import LongCheck
from moeaudit.judge.envelope_report import evaluate, first_violation
from moeaudit.judge.envelope_series import EnvelopeSeries, from_rows
from moeaudit.metrics import Rows, var_grad
from moeaudit.policy import EnvelopeSettings
from moeaudit.records import EnvelopeReport, Violation

CALIBRATION_C = 3.0  # `000` Eq. 16 safety margin
# Relative band around ``_holds``' threshold inside which the fit decides a sample with the scalar
# (libm) bounds: numpy's ``exp`` may differ from libm's in its last bits (≈1e-16), never by 1e-12.
EXACT_BAND = 1e-12
CHUNK = 1 << 16  # samples a bisection pass forms its bounds for at once


# --- calibration (`000` Eq. 16) ----------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Constants fitted on a healthy run: ε = c·Var_t[V], δ = δ*/2."""

    settings: EnvelopeSettings  # the base settings with variant, δ, ε, calibrated, provenance
    delta_max: float  # δ*: the largest δ for which the healthy series is compliant with ε
    temporal_variance: dict[str, float]  # Var_t[V] per series (population)
    epsilon_series: str  # the series whose Var_t set ε
    binding: Violation | None  # where the series leaves the envelope just above δ*
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
    series: EnvelopeSeries,
    base: EnvelopeSettings,
    *,
    c: float = CALIBRATION_C,
    breaks: Iterable[int] = (),
    finite: Mapping[str, Sequence[float]] | None = None,
    binding: bool = True,
) -> Calibration:
    """Fit ε and δ on a healthy series (docs/envelope.md), under ``base``'s window τ.

    ε = c·max over series of the population temporal variance Var_t[V] (`000` Eq. 16), so the
    most variable layer (or pooled) sets the floor every series must share. Compliance only
    gets easier as δ shrinks (both bounds decrease in δ), so δ* is found by bisection on
    log δ in (0, 1), under the Grönwall windows and the discrete checks together; δ = δ*/2.
    ``finite``: :func:`healthy_values` of ``series``, when the caller has it already (V of a
    long log is computed once, not once per c); ``binding=False`` leaves out where the series
    leaves the envelope just above δ* (one more pass over every sample).
    """
    if not c > 0:
        raise ValueError(f"c must be > 0, got {c}")
    breaks = sorted(breaks)
    finite = healthy_values(series) if finite is None else finite
    tv = {key: var_grad(values) for key, values in finite.items()}
    key = max(tv, key=lambda k: tv[k])
    epsilon = c * tv[key]
    if not epsilon > 0:
        raise InputError(
            "the healthy series has zero temporal variance, so ε = c·Var_t[V] = 0",
            path=series.origin or None,
            hint="calibrate on a run with real updates",
        )

    def check(delta: float) -> dict[str, LongCheck]:  # every value is finite: V as computed once
        return {
            k: check_series_long(series.steps, v, delta, epsilon, base.window, breaks=breaks) for k, v in finite.items()
        }

    fit = _Inequalities(series.steps, finite, breaks, base.window, epsilon)
    lo, hi = 1e-12, 1.0 - 1e-12
    if not fit.holds(lo):
        where: Mapping[str, object] = first_violation(check(lo)) or {}
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
    open_ = fit.failing(hi, fit.every)
    if not open_:
        lo = hi
    while hi / lo > 1 + 1e-7:
        mid = math.sqrt(lo * hi)
        failing = fit.failing(mid, open_)
        lo, hi, open_ = (mid, hi, open_) if not failing else (lo, mid, failing)
    where_above = first_violation(check(hi)) if binding and hi > lo else None
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
    return Calibration(settings, lo, tv, key, where_above, c)


class _Inequalities:
    """What :func:`~moeaudit.judge.envelope_checks.holds` checks of a healthy series, per sample:
    every sample m after a segment's first has the discrete pair (m − 1, m) and the Grönwall
    bound from its window's anchor. Compliance is monotone in δ (both bounds fall as δ grows), so
    an inequality that holds at a δ where the series fails holds at every smaller δ: the
    bisection re-checks only the samples that failed at its upper end — the same answers as
    ``holds``, in a few passes over a long log instead of one per bisection step."""

    def __init__(
        self,
        steps: Sequence[int],
        finite: Mapping[str, Sequence[float]],
        breaks: Sequence[int],
        window: int,
        epsilon: float,
    ):
        import numpy as np

        t = array("q", steps)
        self.epsilon = epsilon
        anchor = array("q", bytes(8 * len(t)))  # the anchor of each sample's window
        members = array("q")
        for seg in segments(t, breaks):
            for a, ms in windows(t[seg.start : seg.stop], window):
                for m in ms:
                    anchor[seg.start + m] = seg.start + a
                    members.append(seg.start + m)
        self._t, self._anchor = np.frombuffer(t, dtype=np.int64), np.frombuffer(anchor, dtype=np.int64)
        self._v = {  # healthy_values' arrays are read in place
            key: np.frombuffer(values, dtype=np.float64)
            if isinstance(values, array) and values.typecode == "d"
            else np.asarray(values, dtype=np.float64)
            for key, values in finite.items()
        }
        self.every = {key: members for key in finite}

    def failing(
        self, delta: float, samples: Mapping[str, Sequence[int]], *, first: bool = False
    ) -> dict[str, array[int]]:
        """The samples among ``samples`` (per series) where an inequality fails at ``delta``.

        Both bounds are formed for every sample at once (numpy); a sample whose slack against
        ``_holds``'s threshold is within :data:`EXACT_BAND` of its size — where numpy's and libm's
        last bits of ``exp`` could decide differently — is decided by the scalar bounds, so the
        answer is exactly :func:`~moeaudit.judge.envelope_checks.holds`' on every CPU."""
        import numpy as np

        out: dict[str, array[int]] = {}
        for key, ms in samples.items():
            m_all = np.frombuffer(ms, dtype=np.int64) if isinstance(ms, array) else np.asarray(ms, dtype=np.int64)
            hits = array("q")
            for lo in range(0, len(m_all), CHUNK):  # temporaries of CHUNK samples, whatever the log's length
                m = m_all[lo : lo + CHUNK]
                hits.extend(m[self._failing(self._v[key], m, delta)].tolist())
                if first and hits:
                    return {key: hits[:1]}
            if hits:
                out[key] = hits
        return out

    def _failing(self, v: Any, m: Any, delta: float) -> Any:
        """Which of the samples ``m`` (int64 indices) of V ``v`` fail an inequality at ``delta``."""
        import numpy as np

        t, anchor, eps = self._t, self._anchor, self.epsilon
        vm, a, t_m = v[m], anchor[m], t[m]
        x = (t_m - t[m - 1]) * math.log1p(-delta)  # composed_bound, operation for operation
        pair = np.exp(x) * v[m - 1] + eps * -np.expm1(x) / delta
        win = v[a] * np.exp(-delta * (t_m - t[a])) + eps / delta  # gronwall
        bad = np.zeros(len(m), dtype=bool)
        near = np.zeros(len(m), dtype=bool)
        for bound in (pair, win):
            slack = bound - vm + RTOL * np.abs(bound)  # _holds: slack ≥ 0
            band = EXACT_BAND * (np.abs(bound) + np.abs(vm))
            bad |= slack < -band
            near |= ~(np.abs(slack) > band)  # and where a value is not finite
        for j in np.flatnonzero(near & ~bad):
            i, ai, vi = int(m[j]), int(a[j]), float(vm[j])
            bad[j] = not (
                _holds(vi, composed_bound(float(v[i - 1]), delta, eps, int(t[i] - t[i - 1])))
                and _holds(vi, gronwall(float(v[ai]), int(t[ai]), int(t[i]), delta, eps))
            )
        return bad

    def holds(self, delta: float) -> bool:
        return not self.failing(delta, self.every, first=True)


def _epsilon_floor(steps: Sequence[int], finite: Mapping[str, Sequence[float]], breaks: Sequence[int]) -> float:
    """The ε the discrete checks need as δ → 0 (bound → V + εΔ): the largest rise per step."""
    rises = [
        (v[j + 1] - v[j]) / (steps[j + 1] - steps[j])
        for v in finite.values()
        for seg in segments(steps, breaks)
        for j in seg[:-1]
    ]
    return max([0.0, *rises])


def healthy_values(series: EnvelopeSeries) -> dict[str, array[float]]:
    """V of every series of a healthy run, each computed once and kept as 8 bytes a sample (a
    long log's V is otherwise computed when read, and the fit reads it hundreds of times)."""
    if len(series.steps) < 3:
        raise InputError("calibration needs at least three samples of the healthy run", path=series.origin or None)
    out: dict[str, array[float]] = {}
    for key, values in series.values.items():
        kept = array("d")
        bad: list[int] = []
        for j, v in enumerate(values):
            if v is None:
                bad.append(j)
                if len(bad) == 5:
                    break
            else:
                kept.append(v)
        if bad:
            raise InputError(
                f"the healthy series {key!r} has no finite value at step(s) {[series.steps[j] for j in bad]}",
                path=series.origin or None,
                hint="a run with non-finite gradient norms is not a healthy reference",
            )
        out[key] = kept
    return out


# --- falsifiable constants (docs/decisions.md, "Falsifiable envelope constants") ----------------

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
    finite = healthy_values(series)
    for c in cs:
        try:
            fits.append(calibrate(series, base, c=c, breaks=breaks, finite=finite, binding=False))
        except InputError as exc:
            errors.append(exc)
    if not fits:
        raise errors[-1]
    best = min(fits, key=lambda f: budget(f.settings.delta, f.settings.epsilon))
    best = calibrate(series, base, c=best.c, breaks=breaks, finite=finite)  # the same fit, with its binding
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
    experts — not the minimum, which one zero norm would set to 0 (docs/decisions.md, "calibrate fits the gates too,
    and refuses what cannot fail")."""
    if not series.norms:
        return None
    # The quantile is the k-th smallest share, k = int(q·(n − 1)), n known only at the end; n is
    # at most every sample's every expert, so the smallest int(q·(that − 1)) + 1 shares, kept in
    # a max-heap, hold it — 1% of the shares instead of all of them (a long log has 10⁷–10⁸).
    most = sum(len(vectors) * (len(vectors[0]) if len(vectors) else 0) for vectors in series.norms.values())
    cap = int(SHARE_QUANTILE * (most - 1)) + 1
    lowest: list[float] = []  # negated: lowest[0] is minus the largest share kept
    n = 0
    for vectors in series.norms.values():
        for g_E in vectors:
            known_E = [g for g in g_E if g is not None]
            if len(known_E) == len(g_E) and sum(known_E) > 0:
                total = sum(known_E)
                for g in known_E:
                    x = g * len(known_E) / total
                    n += 1
                    if len(lowest) < cap:
                        heapq.heappush(lowest, -x)
                    elif x < -lowest[0]:
                        heapq.heapreplace(lowest, -x)
    if not n:
        return None
    return sorted(-x for x in lowest)[int(SHARE_QUANTILE * (n - 1))]


def _width(vectors: Sequence[Sequence[float | None]]) -> int:
    return len(vectors[0]) if len(vectors) else 0


def half_dead(series: EnvelopeSeries) -> EnvelopeSeries:
    """The healthy run's steps with the first half of every layer's experts at zero gradient
    for the whole run (the others as logged) — starvation every useful envelope must reject."""
    if not series.norms:
        raise InputError("a falsifiability check needs per-expert gradient norms", path=series.origin or None)
    norms = {}
    for layer, vectors in series.norms.items():
        rows = Rows(_width(vectors))
        for g_E in vectors:
            rows.append(tuple(0.0 if e < len(g_E) // 2 else (g if g is not None else 0.0) for e, g in enumerate(g_E)))
        norms[layer] = rows
    return from_rows(
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
        rows = Rows(_width(vectors))
        for g_E in vectors:
            known = [g for g in g_E if g is not None]
            top = max(known) if known else 1.0
            rows.append((top, *([top * 1e-5] * (len(g_E) - 1))))
        norms[layer] = rows
    return from_rows(
        series.source,
        series.steps,
        norms,
        series.variant,
        origin=f"{series.origin} (starved: one expert per layer, others ×1e-5)",
    )


def falsifiability(
    series: EnvelopeSeries,
    settings: EnvelopeSettings,
    breaks: Iterable[int] = (),
    known_bad_report: EnvelopeReport | None = None,
) -> dict[str, Any]:
    """Does the envelope under ``settings`` reject a starved version of ``series``, and which
    side rejects it? The normalized variance of E non-negative norms is at most E − 1; a budget
    ε/δ at or above half of that is flagged as too loose to be evidence."""
    bad = known_bad_report or evaluate(known_bad(series), settings, breaks=breaks)  # the caller's, if it has one
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
