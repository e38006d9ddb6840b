"""The envelope of a long parsed log, as the commands run it (docs/envelope.md, "Long series";
docs/benchmarks.md §10): V of a sample is computed once for the checks and the alert rule, the
level rule's array form gives the loop's (and the reference's) results on logs built to sit on
its thresholds, and which command may import numpy for it, by the size of the log."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from moeaudit.judge import envelope as env
from moeaudit.judge import envelope_columns as columns
from moeaudit.metrics import layer_total, parse_metrics, variance
from moeaudit.policy import EnvelopeSettings

ROOT = Path(__file__).resolve().parents[1]


def _text(steps: list[int], layers: dict[str, list[list[float | None]]]) -> str:
    return "".join(
        json.dumps({"step": t, "loss": 1.0, "expert_grad_norms": {k: v[j] for k, v in layers.items()}}) + "\n"
        for j, t in enumerate(steps)
    )


def _noisy_log(rng: random.Random, n: int) -> tuple[list[int], dict[str, list[list[float | None]]]]:
    steps, t = [], 1
    for _ in range(n):
        steps.append(t)
        t += rng.choice([1, 1, 2, 5])
    layers: dict[str, list[list[float | None]]] = {}
    for k in range(3):
        rows: list[list[float | None]] = []
        for j in range(n):
            tiny = (j // 9) % 3 == 1  # stretches under the alert's a: the rule fires
            row: list[float | None] = [rng.uniform(0, 9e-5) if tiny else rng.uniform(1e-3, 3e-3) for _ in range(4)]
            if rng.random() < 0.02:
                row[rng.randrange(4)] = None
            elif rng.random() < 0.02:
                row = [0.0] * 4
            rows.append(row)
        layers[str(k)] = rows
    return steps, layers


@pytest.mark.parametrize(("variant", "calibrated"), [(v, c) for v in ("raw", "normalized") for c in (False, True)])
def test_v_of_a_long_logs_sample_is_computed_once(variant: str, calibrated: bool, monkeypatch: Any) -> None:
    """The checks (or the block means of calibrated constants) and the alert rule read one V per
    sample and series; before, the alert rule computed it again (and so did every shown row's
    note). The report is the one the plain series (V computed once, stored) gives."""
    rng = random.Random(7 if calibrated else 8)
    steps, layers = _noisy_log(rng, 600)
    parsed = parse_metrics(_text(steps, layers))
    s = replace(
        EnvelopeSettings(),
        variant=variant,
        alert_a=1e-4,
        alert_b=0.0 if variant == "raw" else 1e-9,
        calibrated=calibrated,
        sampling_interval=6 if calibrated else 250,
        starve_steps=20,
        starve_share=0.3,
    )
    plain = env.from_norms(
        "logs", steps, layers, variant, origin=parsed.path, findings=[f.to_json() for f in parsed.findings]
    )
    want = json.dumps(env.evaluate(plain, s), sort_keys=True)
    calls = 0
    real = columns.variance

    def counted(g_E: Any, v: str) -> Any:
        nonlocal calls
        calls += 1
        return real(g_E, v)

    monkeypatch.setattr(columns, "variance", counted)
    compact = env.from_metrics(parsed, variant)
    report = env.evaluate(compact, s)
    series = len(layers) + 1  # and pooled
    assert calls == series * len(steps)
    assert report["alerts"] and (calibrated or report["shown"])  # the rule fired; rows were thinned
    assert json.dumps(report, sort_keys=True) == want
    # a window that starts and ends inside the log (views of it), the same
    calls = 0
    part = compact.between(steps[50], steps[-40], include_start=False)
    got = env.evaluate(part, s)
    assert calls == series * len(part.steps)
    monkeypatch.setattr(columns, "variance", real)
    want_part = plain.between(steps[50], steps[-40], include_start=False)
    assert json.dumps(got, sort_keys=True) == json.dumps(env.evaluate(want_part, s), sort_keys=True)


def test_a_column_read_out_of_order_feeds_each_sample_once_in_step_order() -> None:
    rows = [[float(j + 1), 2.0 * (j + 1), 0.5] for j in range(12)]
    fed: list[tuple[int, float | None]] = []
    column = columns.VarianceColumn(rows, "raw", lambda j, g_E, v: fed.append((j, v)))
    got = [column[j] for j in (3, 3, 1, 4, 9)] + [column[11]]  # a skip, a repeat, a step back
    column.finish()
    assert [j for j, _ in fed] == list(range(12))
    assert fed == [(j, variance(rows[j], "raw")[0]) for j in range(12)]
    assert got == [fed[j][1] for j in (3, 3, 1, 4, 9, 11)]


def _tie_log(rng: random.Random, n: int, double: bool) -> tuple[list[int], list[list[float | None]], float]:
    """Norms from a few templates whose shares g·E/Σg repeat exactly, gaps that put samples on
    the window's edge (t − max_steps: out; t − max_steps + 1: in), nulls and all-zero rows; the
    threshold is one template's share exactly (x < share is False there)."""
    steps, t = [], rng.randint(0, 3)
    for _ in range(n):
        steps.append(t)
        t += rng.choice([1, 1, 1, 2, 4, 8])  # 8 = max_steps below: an edge exactly
    base = 0.1 if double else 1.0  # 0.1·2^k is not a float32: the layer is kept in double
    templates = [[base] * 8, [base / 4] + [base] * 7, [base / 16] + [base] * 7, [base] * 7 + [base / 4]]
    rows: list[list[float | None]] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.02:
            rows.append([None] + [base] * 7)
        elif r < 0.04:
            rows.append([0.0] * 8)
        else:
            rows.append(list(rng.choice(templates)))
    t1 = templates[1]
    share = t1[0] * 8 / layer_total(t1)  # exactly as the rule computes the share
    return steps, rows, share


@pytest.mark.parametrize("seed", range(8))
def test_the_level_rules_array_form_equals_the_loop_on_its_thresholds(seed: int, monkeypatch: Any) -> None:
    import numpy  # noqa: F401 - the array form runs where numpy is loaded

    rng = random.Random(900 + seed)
    steps, rows, tie = _tie_log(rng, 400, double=seed % 2 == 1)
    parsed = parse_metrics(_text(steps, {"0": rows}))
    view = columns.compact(parsed.norms["0"])
    assert view is not None and view._rows._a.typecode == ("d" if seed % 2 else "f")
    fired = 0
    for share in (tie, math.nextafter(tie, math.inf), math.nextafter(tie, 0.0)):
        for fraction in (0.5, 1 / 3, 0.25, 1.0):
            ref = env.starvation(steps, rows, share, 8, fraction)
            fired += len(ref)
            with monkeypatch.context() as m:  # the loop, numpy not loaded
                m.delitem(sys.modules, "numpy")
                m.setattr(columns, "_starvation_arrays", None)
                assert columns.starvation_columns(parsed.steps, parsed.norms["0"], share, 8, fraction) == ref
            with monkeypatch.context() as m:
                m.setattr(columns, "VECTOR_FROM", 1)
                for block in (columns.BLOCK, 8, 13):  # windows reaching back across blocks
                    m.setattr(columns, "BLOCK", block)
                    got = columns.starvation_columns(parsed.steps, parsed.norms["0"], share, 8, fraction)
                    assert got == ref, (share, fraction, block)
    assert fired  # the thresholds were met, not only missed


CHILD = r"""
import json, sys
from dataclasses import replace
from moeaudit.judge import envelope as env, envelope_columns as columns
from moeaudit.metrics import read_metrics
from moeaudit.policy import EnvelopeSettings
log, how, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
parsed = read_metrics(log)
if how == "command":  # `moeaudit envelope LOG --json OUT` as the command line runs it
    from moeaudit.cli import cli
    out = log + ".json"
    try:
        cli.main(["envelope", log, "--json", out, "--force"], prog_name="moeaudit", standalone_mode=False)
    except SystemExit as exc:
        assert exc.code in (0, 1, None), exc.code
    report = json.loads(open(out).read())
elif how == "evaluate":
    report = env.evaluate(env.from_metrics(parsed, "raw"), EnvelopeSettings(), numpy_rows=rows)
else:
    from types import SimpleNamespace
    from moeaudit.policy import load_policy
    from moeaudit.series import envelope_evidence
    columns.CERTIFY_NUMPY_ROWS = rows
    logs = SimpleNamespace(metrics=log, probe=None, parsed={"metrics": parsed})
    report, why = envelope_evidence(logs, {}, load_policy(None), "pretrain", None, start=0, end=parsed.steps[-1])
print(json.dumps({"numpy": "numpy" in sys.modules, "starvation": report["starvation"]}))
"""


def test_numpy_is_imported_for_the_level_rule_only_where_the_budget_allows(tmp_path: Path) -> None:
    n = columns.VECTOR_FROM + 10
    rng = random.Random(3)
    rows = [[rng.uniform(1e-3, 3e-3), 1e-7 if j % 3 else 2e-3] for j in range(n)]  # expert 1 starved
    log = tmp_path / "metrics.jsonl"
    log.write_text(_text(list(range(1, n + 1)), {"0": rows}))
    env_vars = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def child(how: str, rows: int, log: Path = log) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(log), how, str(rows)],
            cwd=ROOT,
            env=env_vars,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    results = {
        ("evaluate", 0): False,  # no budget for it: the loop
        ("evaluate", columns.ENVELOPE_NUMPY_ROWS): True,  # `moeaudit envelope`
        ("evaluate", n): True,
        ("evaluate", n - 1): False,
        ("certify", n): True,  # certify's envelope part, up to CERTIFY_NUMPY_ROWS samples
        ("certify", n - 1): False,
    }
    seen = []
    for (how, limit), imported in results.items():
        got = child(how, limit)
        assert got["numpy"] is imported, (how, limit)
        seen.append(got["starvation"])
    assert seen[0] and all(s == seen[0] for s in seen)  # the same finding either way
    got = child("command", 0)
    assert got["numpy"] is True and got["starvation"] == seen[0]  # `moeaudit envelope`: any size
    short = tmp_path / "short.jsonl"  # under VECTOR_FROM steps: the loop, nothing imported
    short.write_text(_text(list(range(1, 501)), {"0": rows[:500]}))
    got = child("command", 0, short)
    assert got["numpy"] is False and got["starvation"]
    assert columns.ENVELOPE_NUMPY_ROWS >= 1_000_000 > columns.CERTIFY_NUMPY_ROWS >= columns.VECTOR_FROM


def _alerts_as_before(steps: Any, norms: Any, values: Any, a: float, b: float, n: int) -> list[dict[str, Any]]:
    """Eq. 21 as ``alerts`` computed it before it was fed a sample at a time (a list of the run)."""
    out: list[dict[str, Any]] = []
    run: list[int] = []
    for j, (g_E, v) in enumerate(zip(norms, values, strict=True)):
        known = [g for g in g_E if g is not None]
        if v is not None and len(known) == len(g_E) and max(known) < a and v > b:
            run.append(j)
            if len(run) == n:
                out.append(
                    {
                        "step": steps[j],
                        "since": steps[run[0]],
                        "until": steps[j],
                        "samples": n,
                        "max_grad": max(known),
                        "value": v,
                    }
                )
            elif len(run) > n:
                out[-1]["until"], out[-1]["samples"] = steps[j], len(run)
        else:
            run = []
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_alert_stream_equals_the_rule_as_it_was(seed: int) -> None:
    rng = random.Random(50 + seed)
    steps, layers = _noisy_log(rng, 300)
    series = env.from_norms("logs", steps, layers, "raw")
    for key in layers:
        for n in (1, 2, 3, 9):
            got = env.alerts(steps, layers[key], series.values[key], 1e-4, 0.0, n)
            assert got == _alerts_as_before(steps, layers[key], series.values[key], 1e-4, 0.0, n)
            assert n == 9 or any(r["samples"] > n for r in got)  # runs longer than n: "until" moves on
