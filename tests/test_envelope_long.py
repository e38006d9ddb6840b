"""The envelope over a long log (envelope_columns, check_series_long): the one-pass checks and the
windowed level rules give exactly the numbers of the per-sample reference functions
(``check_series``, ``dead_experts``, ``starvation``, ``alerts`` over ``with_pooled``), the
compact series built from a parsed log equals the one built from plain lists, the report of a
long series shows a bounded, deterministic subset of rows while its verdict stays over every
sample, and the memory kept per logged sample is bounded (tracemalloc)."""

from __future__ import annotations

import json
import math
import random
import sys
import tracemalloc
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from moeaudit.judge import envelope as env
from moeaudit.judge import envelope_columns as columns
from moeaudit.metrics import POOLED, parse_metrics, read_metrics, with_pooled
from moeaudit.policy import EnvelopeSettings


def random_steps(rng: random.Random, n: int) -> list[int]:
    steps, t = [], rng.randint(0, 5)
    for _ in range(n):
        steps.append(t)
        t += rng.choice([1, 1, 1, 2, 3, 7, 40])  # some gaps longer than τ: stretched windows
    return steps


def random_values(rng: random.Random, n: int, nulls: float) -> list[float | None]:
    v, out = rng.uniform(0, 1e-3), []
    for _ in range(n):
        v = max(0.0, 0.95 * v + rng.gauss(0, 3e-4) + (2e-3 if rng.random() < 0.05 else 0))
        out.append(None if rng.random() < nulls else v)
    return out


def random_norms(rng: random.Random, n: int, experts: int, nulls: float) -> list[list[float | None]]:
    rows: list[list[float | None]] = []
    dead = rng.randrange(experts)
    for j in range(n):
        row: list[float | None] = []
        for e in range(experts):
            r = rng.random()
            if r < nulls:
                row.append(None)
            elif e == dead and (j // 7) % 3 != 0:
                row.append(rng.choice([0.0, 1e-8, 5e-7]))  # runs of a dead / starved expert
            elif r < 0.03:
                row.append(0.0)
            else:
                row.append(float(rng.uniform(1e-3, 3e-3)))
        if rng.random() < 0.02:
            row = [0.0] * experts  # an all-zero layer: no share, no normalized V
        rows.append(row)
    return rows


CASES = [(seed, n) for seed in range(12) for n in (1, 2, 3, 17, 150)]


@pytest.mark.parametrize(("seed", "n"), CASES)
def test_the_one_pass_check_equals_check_series(seed: int, n: int) -> None:
    rng = random.Random(seed)
    steps = random_steps(rng, n)
    values = random_values(rng, n, nulls=rng.choice([0.0, 0.05, 0.5]))
    span = range(steps[0], steps[-1] + 2)
    breaks = sorted(rng.sample(span, k=min(len(span), rng.randint(0, 3))))
    notes = {j: "why" for j, v in enumerate(values) if v is None and rng.random() < 0.5}
    delta, eps, tau = rng.choice([0.05, 0.3]), rng.choice([1e-5, 1e-4, 0.0]), rng.choice([1, 5, 30])
    old = env.check_series(steps, values, delta, eps, tau, breaks=breaks, notes=notes)
    new = env.check_series_long(steps, values, delta, eps, tau, breaks=breaks, notes=notes)
    assert new.samples == old.samples
    assert new.windows == old.windows
    assert new.discrete == old.discrete
    assert new.compliant == old.compliant
    assert not new.thinned
    assert env.first_violation({"x": new}) == env.first_violation({"x": old})


@pytest.mark.parametrize("seed", range(8))
def test_a_thinned_check_keeps_a_subset_and_judges_every_sample(seed: int, monkeypatch: Any) -> None:
    monkeypatch.setattr(columns, "SHOW_CAP", 9)
    monkeypatch.setattr(columns, "NONCOMPLIANT_CAP", 4)
    monkeypatch.setattr(columns, "WORST", 3)
    rng = random.Random(100 + seed)
    n = 400
    steps = random_steps(rng, n)
    values = random_values(rng, n, nulls=0.02)
    if seed % 2:
        values[rng.randrange(n)] = 1.0  # a spike: non-compliant
    delta, eps, tau = 0.05, rng.choice([1e-5, 1e-3]), 20
    breaks = [steps[n // 2]]
    old = env.check_series(steps, values, delta, eps, tau, breaks=breaks)
    new = env.check_series_long(steps, values, delta, eps, tau, breaks=breaks)
    assert new.compliant == old.compliant
    assert new.thinned
    for name, full, shown, key in (
        ("samples", old.samples, new.samples, lambda r: r["step"]),
        ("windows", old.windows, new.windows, lambda r: r["index"]),
        ("discrete", old.discrete, new.discrete, lambda r: r["to_step"]),
    ):
        by = {key(r): r for r in full}
        assert all(by[key(r)] == r for r in shown), name  # every shown row is the full row
        assert [key(r) for r in shown] == sorted(key(r) for r in shown)
        counts = new.counts[name]
        assert counts["evaluated"] == len(full)
        assert counts["shown"] == len(shown) < len(full)
        bad = [r for r in full if not r["compliant"]]
        assert counts["noncompliant"] == len(bad)
        assert [r for r in shown if not r["compliant"]][:4] == bad[:4]  # the first ones, always
        stride = -(-len(full) // 9)
        assert all(key(full[i]) in {key(r) for r in shown} for i in range(0, len(full), stride))
        assert full[-1] in shown
        margins = sorted(m for r in full if (m := r.get("margin", r.get("min_margin"))) is not None)
        shown_margins = sorted(m for r in shown if (m := r.get("margin", r.get("min_margin"))) is not None)
        assert shown_margins[:3] == margins[:3]  # the worst margins are shown
    assert env.first_violation({"x": new}) == env.first_violation({"x": old})


@pytest.mark.parametrize("seed", range(10))
def test_windowed_level_rules_equal_the_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(200 + seed)
    n, experts = rng.choice([1, 2, 60, 300]), rng.choice([1, 2, 8])
    steps = random_steps(rng, n)
    norms = random_norms(rng, n, experts, nulls=rng.choice([0.0, 0.02]))
    text = "".join(
        json.dumps({"step": t, "loss": 1.0, "expert_grad_norms": {"0": norms[j]}}) + "\n" for j, t in enumerate(steps)
    )
    rows = parse_metrics(text).norms["0"]  # the typed layer (Rows) a parsed log holds
    # the array form a long parsed log takes, on double layers (these norms) and float32 ones
    f32 = [[None if g is None else array("f", [g])[0] for g in row] for row in norms]
    text32 = "".join(
        json.dumps({"step": t, "loss": 1.0, "expert_grad_norms": {"0": f32[j]}}) + "\n" for j, t in enumerate(steps)
    )
    views = {"d": columns.compact(rows), "f": columns.compact(parse_metrics(text32).norms["0"])}
    for share, window, fraction in ((0.5, 1, 0.5), (0.05, 10, 0.5), (0.3, 25, 1.0), (0.01, 200, 0.1)):
        ref = env.starvation(steps, norms, share, window, fraction)
        assert columns.starvation_columns(steps, norms, share, window, fraction) == ref
        assert columns.starvation_columns(steps, rows, share, window, fraction) == ref
        for code, view in views.items():
            assert view is not None and view._rows._a.typecode == code
            want = ref if code == "d" else env.starvation(steps, f32, share, window, fraction)
            for block in (columns.BLOCK, 7, 64):  # one block, and windows reaching back across blocks
                monkeypatch.setattr(columns, "BLOCK", block)
                assert columns._starvation_arrays(steps, view, share, window, fraction) == want, block
    for grad, count in ((1e-6, 1), (1e-6, 20), (1e-4, 5)):
        ref = env.dead_experts(steps, norms, grad, count)
        assert columns.dead_experts_columns(steps, norms, grad, count) == ref
        assert columns.dead_experts_columns(steps, rows, grad, count) == ref


def _log(rng: random.Random, n: int, layers: int, experts: int, nulls: float) -> tuple[str, list[int], dict]:
    steps = random_steps(rng, n)
    norms = {str(k): random_norms(rng, n, experts, nulls) for k in range(layers)}
    text = "".join(
        json.dumps({"step": t, "loss": 1.0, "expert_grad_norms": {k: v[j] for k, v in norms.items()}}) + "\n"
        for j, t in enumerate(steps)
    )
    return text, steps, norms


def _reference_report(series: env.EnvelopeSeries, s: EnvelopeSettings) -> dict[str, Any]:
    """The parts of ``evaluate`` computed with the per-sample reference functions."""
    checks = {
        k: env.check_series(series.steps, v, s.delta, s.epsilon, s.window, notes=series.notes.get(k))
        for k, v in series.values.items()
    }
    plain = {k: [list(r) for r in v] for k, v in (series.norms or {}).items()}
    return {
        "series": {k: c.samples for k, c in checks.items()},
        "windows": [{"series": k, **w} for k, c in checks.items() for w in c.windows],
        "discrete": [{"series": k, **r} for k, c in checks.items() for r in c.discrete],
        "variance": all(c.compliant for c in checks.values()),
        "alerts": [
            {"series": k, **a}
            for k, vs in with_pooled(plain).items()
            for a in env.alerts(series.steps, vs, series.values[k], s.alert_a, s.alert_b, s.alert_n)
        ],
        "dead_experts": [
            {"layer": k, **d} for k, vs in plain.items() for d in env.dead_experts(series.steps, vs, s.dead_grad, 3)
        ],
        "starvation": [
            {"layer": k, **r}
            for k, vs in plain.items()
            for r in env.starvation(series.steps, vs, s.starve_share, s.starve_steps, s.starve_fraction)
        ],
    }


@pytest.mark.parametrize(
    ("seed", "variant", "arrays"), [(s, v, s % 2 == 1) for s in range(6) for v in ("raw", "normalized")]
)
def test_a_parsed_log_stays_compact_and_evaluates_as_plain_lists(
    seed: int, variant: str, arrays: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if arrays:  # the level rule's array form, on views of a parsed log, in blocks shorter than a window
        monkeypatch.setattr(columns, "VECTOR_FROM", 1)
        monkeypatch.setattr(columns, "BLOCK", 16)
    rng = random.Random(300 + seed)
    text, steps, norms = _log(rng, rng.choice([3, 40, 250]), rng.choice([1, 3]), rng.choice([2, 4]), nulls=0.01)
    parsed = parse_metrics(text)
    compact = env.from_metrics(parsed, variant)
    found = [f.to_json() for f in parsed.findings]
    plain = env.from_norms("logs", steps, norms, variant, origin="metrics.jsonl", findings=found)
    assert isinstance(compact.values, columns.LazyValues)
    assert dict(compact.values) == plain.values
    assert dict(compact.notes) == plain.notes
    assert dict(compact.norms or {}) == plain.norms
    # alert b = 0 so the rule fires on a noisy series; the starvation window inside the series
    s = replace(
        EnvelopeSettings(),
        variant=variant,
        dead_steps=3,
        starve_steps=10,
        starve_share=0.2,
        alert_a=1.0,
        alert_b=0.0 if variant == "raw" else 1e-9,
        alert_n=2,
    )
    mid = steps[len(steps) // 3]
    for a, b in (
        (compact, plain),
        (compact.since(mid), plain.since(mid)),
        (compact.between(mid, steps[-2], include_start=False), plain.between(mid, steps[-2], include_start=False)),
        (compact.at(steps[::2]), plain.at(steps[::2])),
    ):
        if len(b.steps) < 2:
            continue
        assert list(a.steps) == list(b.steps)
        got, want = env.evaluate(a, s), env.evaluate(b, s)
        assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
        ref = _reference_report(b, s)
        for key, value in ref.items():
            if key == "variance":  # the variance bound's result, under either name
                key = "variance_within_bound" if "variance_within_bound" in got else "variance_compliant"
            assert got[key] == value, key
        calibrated = replace(s, calibrated=True, sampling_interval=4)  # block means (resample)
        assert json.dumps(env.evaluate(a, calibrated), sort_keys=True) == json.dumps(
            env.evaluate(b, calibrated), sort_keys=True
        )


def test_the_report_of_a_long_series_is_bounded_and_says_what_it_shows(monkeypatch: Any) -> None:
    monkeypatch.setattr(columns, "SHOW_CAP", 50)
    rng = random.Random(7)
    text, steps, _ = _log(rng, 600, 2, 4, nulls=0.0)
    series = env.from_metrics(parse_metrics(text), "raw")
    s = replace(EnvelopeSettings(), starve_steps=10**6)
    report = env.evaluate(series, s)
    full = _reference_report(series, s)
    assert report.get("variance_within_bound", report.get("variance_compliant")) == full["variance"]
    shown = report["shown"]
    assert set(shown) == {POOLED, "0", "1"}
    for key in shown:
        assert shown[key]["samples"]["evaluated"] == len(steps)
        assert shown[key]["samples"]["shown"] == len(report["series"][key]) < len(steps)
        assert shown[key]["discrete"]["evaluated"] == len(steps) - 1
        nc = sum(not r["compliant"] for r in full["series"][key])
        assert shown[key]["samples"]["noncompliant"] == nc
    assert "shown" not in env.evaluate(series.since(steps[-40]), s)  # short: every row, no summary
    from moeaudit.report import export

    stmt = {"predicate": {"envelope": report, "checks": [{"name": "envelope", "evaluated": True, "status": "PASS"}]}}
    windows = sum(
        len(c.windows)
        for c in (env.check_series(steps, v, s.delta, s.epsilon, s.window) for v in series.values.values())
    )
    assert f"over {windows} window(s)" in export.envelope(stmt).summary  # every window, not the rows shown
    from moeaudit.report import html

    view = html.envelope_view(report, [])
    assert "every one of the 600 samples per series is judged" in view["counts"]
    assert view["panels"][0]["samples"] == 600
    assert "judged" not in html.envelope_view(env.evaluate(series.since(steps[-40]), s), [])["counts"]


def _write_log(path: Path, n: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for step in range(1, n + 1):
            norms = {str(k): [rng.uniform(1e-3, 3e-3) for _ in range(8)] for k in range(8)}
            f.write(json.dumps({"step": step, "loss": 2.0, "expert_grad_norms": norms}) + "\n")


def test_the_envelope_of_a_parsed_log_costs_little_memory_per_sample(tmp_path: Path, monkeypatch: Any) -> None:
    """Peak memory of building and evaluating the envelope of an 8 × 8 log grows by under 150 B
    per logged step (the series per step before was ~14 kB): measured between 1500 and 3000
    lines, with as many rows shown at both (50), so the bounded rows cancel out."""
    monkeypatch.setattr(columns, "SHOW_CAP", 50)
    peaks = {}
    for n in (1500, 3000):
        log = tmp_path / f"m{n}.jsonl"
        _write_log(log, n)
        metrics = read_metrics(log)
        tracemalloc.start()
        report = env.evaluate(env.from_metrics(metrics, "raw"), EnvelopeSettings())
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert report["shown"][POOLED]["samples"]["evaluated"] == n
        assert len(report["series"][POOLED]) <= columns.SHOW_CAP + columns.NONCOMPLIANT_CAP + columns.WORST
        del report, metrics
    per_step = (peaks[3000] - peaks[1500]) / 1500
    print(f"envelope memory: {per_step:.1f} B per logged step")
    assert per_step < 150, per_step
    assert math.isfinite(per_step)


def test_the_command_line_counts_every_sample_of_a_thinned_series(tmp_path: Path, monkeypatch: Any) -> None:
    from click.testing import CliRunner

    from moeaudit.cli import cli

    monkeypatch.setattr(columns, "SHOW_CAP", 50)
    log = tmp_path / "metrics.jsonl"
    _write_log(log, 617)
    out = tmp_path / "envelope.json"
    done = CliRunner().invoke(cli, ["envelope", str(log), "--json", str(out)], terminal_width=200)
    assert done.exit_code in (0, 1), done.output
    report = json.loads(out.read_text())
    assert report["shown"][POOLED]["samples"] == {
        "evaluated": 617,
        "shown": len(report["series"][POOLED]),
        "noncompliant": 0,
    }
    assert len(report["series"][POOLED]) < 617
    table = [line for line in done.output.splitlines() if "all layers pooled" in line]
    assert table and "617" in table[0]  # the sample count is of every sample, not of the rows shown


def test_a_layers_total_is_added_left_to_right_on_every_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The level rule's share g_e·E/Σg divides by Σg added left to right from 0.0, in the loop and
    in the array form alike; Python 3.12's ``sum`` compensates, which would move the last bit."""
    import numpy  # noqa: F401 - loaded, as in a process that replays

    from moeaudit.metrics import layer_total

    g_E = [1.0] + [1e-16] * 8
    assert layer_total(g_E) == 1.0  # each 1e-16 is below half an ulp of 1.0
    assert math.fsum(g_E) == 1.0000000000000009
    steps = list(range(1, 5001))
    norms = [[1.0] + [1e-16] * 8 for _ in steps]
    text = "".join(
        json.dumps({"step": t, "loss": 1.0, "expert_grad_norms": {"0": norms[j]}}) + "\n" for j, t in enumerate(steps)
    )
    parsed = parse_metrics(text)
    share = 9 / layer_total(norms[0]) * 1.0  # expert 0's share, exactly as the rule computes it
    for threshold in (share, math.nextafter(share, math.inf)):  # x < threshold flips exactly here
        ref = env.starvation(steps, norms, threshold, 100, 1.0)
        assert [w["expert"] for w in ref] == ([*range(1, 9)] if threshold == share else [*range(9)])
        # 5000 samples of a parsed log (its steps a typed column): the array form where numpy is
        # loaded, the loop where it is not (never imported for this rule alone)
        assert len(parsed.steps) >= columns.VECTOR_FROM and parsed.steps._a.typecode == "I"
        for loaded in (True, False):
            with monkeypatch.context() as m:
                if not loaded:
                    m.delitem(sys.modules, "numpy")
                    m.setattr(columns, "_starvation_arrays", None)  # the loop must not reach it
                assert columns.starvation_columns(parsed.steps, parsed.norms["0"], threshold, 100, 1.0) == ref
