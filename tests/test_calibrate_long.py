"""Calibration on a long log (moeaudit/judge/envelope_calibrate.py; docs/benchmarks.md §10): the fit
reads V computed once into typed arrays, bisects δ re-checking only the samples that failed,
builds its starved copies and block means in typed rows, and keeps 1% of the expert shares for
their quantile — and every number it returns equals the plain-list reference it replaced: the
same δ*, ε, binding violation, starvation share, block means and starved series, on parsed logs
and on plain lists alike. Its memory per logged step is bounded (tracemalloc)."""

from __future__ import annotations

import json
import math
import random
import tracemalloc
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from moeaudit.calibrate import _fit_envelope
from moeaudit.judge import envelope as env
from moeaudit.metrics import parse_metrics, read_metrics
from moeaudit.policy import EnvelopeSettings, Policy


def smooth_log(rng: random.Random, n: int, layers: int, experts: int, period: float) -> str:
    """A healthy-looking log: every expert's norm a slow oscillation around its own level, as
    float32 (what the hook logs), so a variance bound fits at the native sampling."""
    import numpy as np

    base = [[rng.uniform(1e-3, 3e-3) for _ in range(experts)] for _ in range(layers)]
    phase = [[rng.uniform(0, 2 * math.pi) for _ in range(experts)] for _ in range(layers)]
    lines = []
    for step in range(1, n + 1):
        norms = {
            str(k): np.asarray(
                [base[k][e] * (1 + 0.3 * math.sin(2 * math.pi * step / period + phase[k][e])) for e in range(experts)],
                dtype=np.float32,
            ).tolist()
            for k in range(layers)
        }
        lines.append(json.dumps({"step": step, "loss": 3.0, "expert_grad_norms": norms}))
    return "\n".join(lines) + "\n"


def _plain(parsed: Any) -> env.EnvelopeSeries:
    steps = list(parsed.steps)
    norms = {k: [list(row) for row in rows] for k, rows in parsed.norms.items()}
    return env.from_norms("logs", steps, norms, "normalized", origin=parsed.path)


def _share_reference(series: env.EnvelopeSeries) -> float | None:
    """healthy_share as it was: every share in one sorted list."""
    shares = []
    for vectors in (series.norms or {}).values():
        for g_E in vectors:
            known = [g for g in g_E if g is not None]
            if len(known) == len(g_E) and sum(known) > 0:
                shares += [g * len(known) / sum(known) for g in known]
    shares.sort()
    return shares[int(env.SHARE_QUANTILE * (len(shares) - 1))] if shares else None


def _delta_max_reference(series: env.EnvelopeSeries, epsilon: float, window: int) -> float:
    """The bisection as it was: every sample of every series checked at every step."""
    values = [[v for v in vs if v is not None] for vs in series.values.values()]
    steps = list(series.steps)

    def ok(delta: float) -> bool:
        return all(env.holds(steps, v, delta, epsilon, window) for v in values)

    lo, hi = 1e-12, 1.0 - 1e-12
    assert ok(lo)
    if ok(hi):
        return hi
    while hi / lo > 1 + 1e-7:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _values(series: env.EnvelopeSeries) -> dict[str, list[float | None]]:
    return {k: list(v) for k, v in series.values.items()}


@pytest.mark.parametrize("seed", range(4))
def test_the_fit_of_a_parsed_log_equals_the_plain_list_reference(seed: int) -> None:
    rng = random.Random(900 + seed)
    parsed = parse_metrics(smooth_log(rng, rng.choice([300, 500]), rng.choice([1, 3]), rng.choice([4, 6]), 400.0))
    compact, plain = env.from_metrics(parsed, "normalized"), _plain(parsed)
    base = replace(EnvelopeSettings(), variant="normalized")

    assert env.healthy_share(compact) == env.healthy_share(plain) == _share_reference(plain)
    for starve in (env.known_bad, env.half_dead):
        assert _values(starve(compact)) == _values(starve(plain))
    for k in (2, 5):
        a, b = env.resample(compact, k), env.resample(plain, k)
        assert list(a.steps) == list(b.steps) and _values(a) == _values(b)
        assert {key: list(rows) for key, rows in (a.norms or {}).items()} == {
            key: [tuple(r) for r in rows] for key, rows in (b.norms or {}).items()
        }

    fits = [env.calibrate_tightest(s, base) for s in (compact, plain)]
    assert fits[0].to_json() == fits[1].to_json()
    fit = fits[0]
    assert fit.delta_max == _delta_max_reference(plain, fit.settings.epsilon, base.window)
    assert fit.binding is not None  # a fit below δ = 1: the series leaves the envelope just above δ*
    for c in env.C_RANGE:  # each c's own bisection, with and without the binding pass
        one = env.calibrate(compact, base, c=c)
        assert one.delta_max == _delta_max_reference(plain, one.settings.epsilon, base.window)
        assert one.to_json() == env.calibrate(plain, base, c=c).to_json()
    policy = Policy()
    got = [
        _fit_envelope(s, policy, "normalized", [], Path("run"), since=0, stage="pretraining", model="m")
        for s in (compact, plain)
    ]
    assert got[0][0] == got[1][0] and got[0][1] == got[1][1] and got[0][2] == got[1][2]


def _write(path: Path, n: int) -> None:
    path.write_text(smooth_log(random.Random(5), n, 8, 8, 400.0))


def test_calibrating_on_a_long_log_costs_little_memory_per_step(tmp_path: Path) -> None:
    """The envelope fit of calibrate on an 8 × 8 log (V once, the bisection, both starved copies
    evaluated, the share quantile) grows its peak by under 1.5 kB per logged step, measured
    between 1500 and 3000 lines (before: ~7 kB, the per-sample checks and the starved copies as
    Python lists)."""
    peaks = {}
    policy = Policy()
    for n in (1500, 3000):
        log = tmp_path / f"m{n}.jsonl"
        _write(log, n)
        series = env.from_metrics(read_metrics(log), "normalized")
        tracemalloc.start()
        settings, _, check = _fit_envelope(
            series, policy, "normalized", [], log, since=0, stage="pretraining", model="m"
        )
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert settings.calibrated and check["known_bad_rejected"]
    per_step = (peaks[3000] - peaks[1500]) / 1500
    print(f"calibrate's envelope fit: {per_step:.0f} B per logged step")
    assert 0 < per_step < 1500, per_step


def _failing_reference(steps: list[int], v: list[float], delta: float, epsilon: float, window: int) -> list[int]:
    """Every sample where a discrete pair or a Grönwall bound fails, with the scalar bounds."""
    from moeaudit.judge.envelope_checks import _holds, composed_bound, gronwall, windows

    bad = []
    for anchor, members in windows(steps, window):
        for m in members:
            pair = _holds(v[m], composed_bound(v[m - 1], delta, epsilon, steps[m] - steps[m - 1]))
            if not (pair and _holds(v[m], gronwall(v[anchor], steps[anchor], steps[m], delta, epsilon))):
                bad.append(m)
    return bad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_vectorised_bisection_decides_every_sample_as_the_scalar_bounds(seed: int) -> None:
    """The bisection forms its bounds with numpy and decides samples near the threshold with the
    scalar (libm) bounds: at every δ the failing samples are exactly the scalar checks' — on
    random series, on samples placed exactly at, one ulp above and one ulp below their bound, and
    on non-finite values, and across chunk boundaries."""
    from moeaudit.judge import envelope_calibrate as ec
    from moeaudit.judge.envelope_checks import composed_bound, gronwall

    rng = random.Random(seed)
    n, window, epsilon = 3000, 40, 2e-4
    steps = sorted(rng.sample(range(1, 20 * n), n))
    v = [rng.uniform(0.01, 0.02) for _ in range(n)]
    delta0 = 10 ** rng.uniform(-4, -1)
    for m in range(1, n, 7):  # exactly at a bound and one ulp either side, at δ0
        pair = composed_bound(v[m - 1], delta0, epsilon, steps[m] - steps[m - 1])
        v[m] = math.nextafter(pair, (m % 3 - 1) * math.inf) if m % 3 != 1 else pair
    for m in range(5, n, 11):
        anchor = next(a for a, members in env.windows(steps, window) if m in members)
        v[m] = gronwall(v[anchor], steps[anchor], steps[m], delta0, epsilon) * (1 + env.RTOL)
    v[n // 2] = math.inf
    fit = ec._Inequalities(steps, {"0": v}, [], window, epsilon)
    old_chunk = ec.CHUNK
    try:
        ec.CHUNK = 257  # several chunks, ends not aligned with windows
        for delta in [
            delta0,
            delta0 * (1 + 1e-15),
            delta0 / 3,
            0.5,
            1e-9,
            *(10 ** rng.uniform(-6, 0) for _ in range(8)),
        ]:
            want = _failing_reference(steps, v, delta, epsilon, window)
            got = list(fit.failing(delta, fit.every).get("0", []))
            assert got == want, delta
            assert fit.holds(delta) == (not want)
            if want:  # and again from the failing samples alone, as the bisection re-checks them
                assert list(fit.failing(delta, {"0": array("q", want)})["0"]) == want
    finally:
        ec.CHUNK = old_chunk
