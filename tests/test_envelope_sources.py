"""Training logs vs checkpoint replays, window by window (docs/envelope.md, "Logs vs replays, window by
window"): a synthetic run whose
agree/disagree flags are known exactly, the composition law behind the comparison, and the
sample runs (healthy agrees everywhere; collapse leaves at layer 1 on both sources)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from moeaudit.cli import cli
from moeaudit.judge.envelope import composed_bound, from_metrics, from_records
from moeaudit.judge.envelope_compare import VIEWS, calibrate_sources, compare
from moeaudit.metrics import read_metrics
from moeaudit.policy import EnvelopeSettings

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"
# budget ε/δ = 0.2; Δ = 10: bound = 0.5987·V + 0.0803; Δ = 100: bound = 0.0059·V + 0.1988
SETTINGS = EnvelopeSettings(variant="normalized", delta=0.05, epsilon=0.01, alert_b=0.5)
SAME = {view: SETTINGS for view in VIEWS}

# V of the logs every 10 steps, and of the replays at the checkpoints 0, 100, …, 450.
LOGS = {
    **{t: 0.05 for t in range(0, 210, 10)},
    150: 0.5,  # w1: a spike between checkpoints
    210: 0.1,
    220: 0.13,
    **{t: 0.15 for t in range(230, 310, 10)},  # w2: a rise the logs allow
    **{t: 0.5 for t in range(310, 410, 10)},  # w3: a jump both sources see
    410: 0.3,
    420: 0.2,
    430: 0.1,
    440: 0.05,
}  # w4: no log at 450
REPLAY = {0: 0.05, 100: 0.05, 200: 0.05, 300: 0.3, 400: 0.35, 450: 0.05}


def write_metrics(path: Path, values: dict[int, float]) -> Path:
    """Two experts with norms 1 ± a: var_grad_norm = a² exactly as written."""
    with open(path, "w", encoding="utf-8") as f:
        for step, v in sorted(values.items()):
            a = math.sqrt(v)
            f.write(json.dumps({"step": step, "loss": 1.0, "expert_grad_norms": {"0": [1 - a, 1 + a]}}) + "\n")
    return path


@pytest.fixture
def synthetic(tmp_path: Path):
    logs = from_metrics(read_metrics(write_metrics(tmp_path / "metrics.jsonl", LOGS)), "normalized")
    replay = from_records("replay", [(t, {"0": v}, v) for t, v in REPLAY.items()], "normalized")
    return logs, replay


def by_window(doc: dict, series: str = "0") -> list[dict]:
    return [w for w in doc["windows"] if w["series"] == series]


def test_synthetic_flags_are_exactly_the_constructed_ones(synthetic) -> None:
    doc = compare(*synthetic, SAME)
    rows = by_window(doc)
    assert [(w["start"], w["end"]) for w in rows] == [(0, 100), (100, 200), (200, 300), (300, 400), (400, 450)]
    verdicts = [(w["replay"]["compliant"], w["logs"]["compliant"], w["logs_endpoints"]["compliant"]) for w in rows]
    assert verdicts == [
        (True, True, True),
        (True, False, True),
        (False, True, True),
        (False, False, False),
        (True, True, None),
    ]
    assert [w["agree"] for w in rows] == [True, False, False, True, True]
    assert [w["agree_endpoints"] for w in rows] == [True, True, False, True, None]
    spike = rows[1]["logs"]
    assert (spike["pairs"], spike["violations"], spike["first_violation"]) == (10, 1, 150)
    assert spike["worst"]["to_step"] == 150
    assert rows[4]["logs_endpoints"]["reason"] == "no logged sample at step 450"
    # V at both endpoints from both sources, side by side
    assert rows[2]["replay"]["value_from"] == 0.05 and rows[2]["replay"]["value"] == 0.3
    assert rows[2]["logs_endpoints"]["value_from"] == pytest.approx(0.05)
    assert rows[2]["logs_endpoints"]["value"] == pytest.approx(0.15)
    assert rows[2]["replay"]["bound"] == pytest.approx(composed_bound(0.05, 0.05, 0.01, 100))


def test_agreement_rates_count_only_comparable_windows(synthetic) -> None:
    a = compare(*synthetic, SAME)["agreement"]
    assert a["by_series"]["0"]["logs"] == {"compared": 5, "agree": 3, "rate": 0.6}
    assert a["by_series"]["0"]["logs_endpoints"] == {"compared": 4, "agree": 3, "rate": 0.75}
    assert a["logs"] == {"compared": 10, "agree": 6, "rate": 0.6}  # pooled = layer 0 here


def test_a_window_with_a_break_in_it_is_not_compared(synthetic) -> None:
    doc = compare(*synthetic, SAME, breaks=[250])
    assert {(w["start"], w["end"]) for w in doc["windows"]} == {(0, 100), (100, 200), (300, 400), (400, 450)}
    assert doc["skipped"] == [
        {"window": 2, "start": 200, "end": 300, "reason": "resume / regime change at step 250 in the window"}
    ]


def test_each_view_is_judged_under_its_own_constants(synthetic) -> None:
    strict = EnvelopeSettings(variant="normalized", delta=0.5, epsilon=0.01, alert_b=0.5)  # ε/δ .02
    doc = compare(*synthetic, {**SAME, "replay": strict})
    assert [w["replay"]["compliant"] for w in by_window(doc)] == [False] * 4 + [False]
    assert doc["constants"]["replay"]["budget"] == pytest.approx(0.02)
    assert doc["constants"]["logs"]["budget"] == pytest.approx(0.2)


def test_logs_endpoints_are_calibrated_at_the_checkpoint_steps() -> None:
    wavy = [0.1 + 0.05 * math.sin(j / 5) for j in range(31)]
    logs = from_records("logs", [(10 * j, {"0": v}, v) for j, v in enumerate(wavy)], "normalized")
    replay = from_records(
        "replay",
        [(t, {"0": v}, v) for t, v in zip((0, 100, 200, 300), (0.1, 0.12, 0.09, 0.11), strict=True)],
        "normalized",
    )
    fits = calibrate_sources(SETTINGS, logs=logs, replay=replay)
    assert set(fits) == set(VIEWS)
    assert fits["logs_endpoints"].provenance.startswith("logs at the checkpoint steps only; ")
    assert "4 samples" in fits["logs_endpoints"].provenance
    assert "31 samples" in fits["logs"].provenance
    assert fits["logs_endpoints"].epsilon == pytest.approx(3 * statistics.pvariance(wavy[::10]))


def test_the_probe_is_judged_at_the_checkpoints_beside_the_replays(synthetic) -> None:
    """The hook's canary probe: one more endpoint check per window, under its own constants,
    and the largest relative difference of V from the replay's at the shared steps."""
    logs, replay = synthetic
    probe_v = {**REPLAY, 300: 0.3 * (1 + 2e-7), 400: 0.1}  # 400: the probe sees a drop
    probe = from_records("probe", [(t, {"0": v}, v) for t, v in probe_v.items()], "normalized")
    doc = compare(logs, replay, {**SAME, "probe": SETTINGS}, probe=probe)
    rows = by_window(doc)
    assert [w["probe"]["compliant"] for w in rows] == [True, True, False, True, True]
    assert [w["agree_probe"] for w in rows] == [True, True, True, False, True]
    assert rows[3]["probe"]["value"] == 0.1 and rows[3]["replay"]["value"] == 0.35
    assert doc["agreement"]["by_series"]["0"]["probe"] == {"compared": 5, "agree": 4, "rate": 0.8}
    assert set(doc["constants"]) == {*VIEWS, "probe"}
    worst = doc["probe_vs_replay"]
    assert worst["steps"] == sorted(REPLAY)
    assert worst["by_series"]["0"] == pytest.approx(abs(0.1 - 0.35) / 0.35)
    assert "probe" not in compare(logs, replay, SAME)["agreement"]  # no probe, no probe view
    fits = calibrate_sources(SETTINGS, logs=logs, replay=replay, probe=probe)
    assert set(fits) == {*VIEWS, "probe"} and "6 samples" in fits["probe"].provenance


@given(st.lists(st.floats(0.0, 1.0), min_size=11, max_size=11))
def test_every_logged_step_complying_implies_the_endpoints_comply(values: list[float]) -> None:
    """The composition law: the logs can fail at the endpoints only if some logged pair fails."""
    logs = from_records("logs", [(10 * j, {"0": v}, v) for j, v in enumerate(values)], "normalized")
    replay = from_records("replay", [(0, {"0": 0.1}, 0.1), (100, {"0": 0.1}, 0.1)], "normalized")
    w = by_window(compare(logs, replay, SAME))[0]
    if w["logs"]["compliant"]:
        assert w["logs_endpoints"]["compliant"]


# --- the sample runs ------------------------------------------------------------------------------

samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """One cache per module: each sample checkpoint is replayed once, then read back."""
    root = tmp_path_factory.mktemp("sources")
    return {"MOEAUDIT_CACHE_DIR": str(root / "cache"), "XDG_CONFIG_HOME": str(root / "config")}


@pytest.fixture(scope="module")
def reports(tmp_path_factory, env) -> dict[str, dict]:
    out, docs = tmp_path_factory.mktemp("reports"), {}
    for run in ("healthy", "collapse"):
        path = out / f"{run}.json"
        result = CliRunner(env=env).invoke(
            cli,
            [
                "envelope",
                str(SAMPLES / run),
                "--compare",
                "--calibrate-on",
                str(SAMPLES / "healthy"),
                "--json",
                str(path),
            ],
        )
        assert result.exit_code == (0 if run == "healthy" else 1), result.output + result.stderr
        docs[run] = json.loads(path.read_text())
    return docs


@samples
def test_healthy_complies_in_every_window_on_both_sources(reports) -> None:
    doc = reports["healthy"]
    c = doc["comparison"]
    assert doc["source"] == "logs" and c["report"]["source"] == "replay"
    assert doc["compliant"] and c["report"]["compliant"]
    assert {(w["start"], w["end"]) for w in c["windows"]} == {
        (250, 500),
        (500, 750),
        (750, 1000),
        (1000, 1250),
        (1250, 1500),
    }
    assert len(c["windows"]) == 5 * 5  # pooled + 4 layers
    assert all(
        w["replay"]["compliant"] and w["logs"]["compliant"] and w["logs_endpoints"]["compliant"] for w in c["windows"]
    )
    assert c["agreement"]["logs"] == {"compared": 25, "agree": 25, "rate": 1.0}
    assert c["agreement"]["logs_endpoints"] == {"compared": 25, "agree": 25, "rate": 1.0}
    assert c["calibrated_on"] == str(SAMPLES / "healthy") and "note" not in c


@samples
@pytest.mark.parametrize("run", ["healthy", "collapse"])
def test_the_canary_probe_logged_in_training_agrees_with_the_replays(reports, run) -> None:
    """Same weights, same canary, other code (the trainer's autograd, one thread): V within
    1e-5 relative at every checkpoint, and the same verdict in every window."""
    c = reports[run]["comparison"]
    assert c["agreement"]["probe"] == {"compared": 25, "agree": 25, "rate": 1.0}
    assert c["probe_vs_replay"]["steps"] == [250, 500, 750, 1000, 1250, 1500]
    assert c["probe_vs_replay"]["max_rel_diff"] < 1e-5
    assert c["probe_report"]["source"] == "probe"
    assert c["probe_report"]["compliant"] is (run == "healthy")
    assert "(probe, steps 250" in c["constants"]["probe"]["provenance"]


@samples
def test_a_probe_of_another_canary_is_not_compared(env, tmp_path) -> None:
    run = tmp_path / "healthy"
    shutil.copytree(SAMPLES / "healthy", run)
    lines = [json.loads(x) for x in (run / "canary_probe.jsonl").read_text().splitlines()]
    (run / "canary_probe.jsonl").write_text("".join(json.dumps({**x, "canary": "0" * 64}) + "\n" for x in lines))
    out = tmp_path / "r.json"
    result = CliRunner(env=env).invoke(
        cli,
        [
            "envelope",
            str(run),
            "--compare",
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--policy",
            str(SAMPLES / "policy.toml"),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output + result.stderr
    c = json.loads(out.read_text())["comparison"]
    assert "probe" not in c["agreement"] and "probe_report" not in c
    (skip,) = [s for s in c["skipped"] if s.get("series") == "probe"]
    assert "the probe logged canary 000000000000" in skip["reason"]


@samples
def test_collapse_leaves_at_layer_1_on_both_sources_in_every_window(reports) -> None:
    c = reports["collapse"]["comparison"]
    layer1 = by_window(c, "1")
    left = [
        (w["start"], w["end"])
        for w in layer1
        if not w["replay"]["compliant"] and not w["logs"]["compliant"] and not w["logs_endpoints"]["compliant"]
    ]
    assert left == [(250, 500), (500, 750), (750, 1000), (1000, 1250), (1250, 1500)]
    first = layer1[0]
    assert first["replay"]["value"] > first["replay"]["bound"]
    assert first["logs_endpoints"]["value"] > first["logs_endpoints"]["bound"]
    assert c["agreement"]["by_series"]["1"]["logs"]["rate"] == 1.0
    # each view under constants fitted on healthy from the same source and sampling
    k = c["constants"]
    assert k["logs"]["delta"] != k["replay"]["delta"] != k["logs_endpoints"]["delta"]
    assert "logs at the checkpoint steps only" in k["logs_endpoints"]["provenance"]


@samples
def test_compare_only_adds_to_the_envelope_report(reports, env, tmp_path) -> None:
    docs = {}
    for name, extra in (("plain", []), ("compare", ["--compare"])):
        path = tmp_path / f"{name}.json"
        result = CliRunner(env=env).invoke(cli, ["envelope", str(SAMPLES / "healthy"), *extra, "--json", str(path)])
        assert result.exit_code == 0, result.output + result.stderr
        docs[name] = json.loads(path.read_text())
    plain, both = docs["plain"], docs["compare"]
    assert {k: v for k, v in both.items() if k != "comparison"} == plain
    c = both["comparison"]
    assert c["calibrated_on"] is None and "--calibrate-on" in c["note"]
    assert c["constants"]["replay"] == c["constants"]["logs"]  # the policy's, for every view


@samples
def test_a_bare_probe_log_is_read_as_the_probe_source(env, tmp_path) -> None:
    out = tmp_path / "p.json"
    result = CliRunner(env=env).invoke(
        cli,
        [
            "envelope",
            str(SAMPLES / "healthy" / "canary_probe.jsonl"),
            "--policy",
            str(SAMPLES / "policy.toml"),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code in (0, 1), result.output + result.stderr
    doc = json.loads(out.read_text())
    assert doc["source"] == "probe"
    assert [r["step"] for r in doc["series"]["pooled"]][-1] == 1500


@samples
def test_a_probe_is_not_compared_when_the_calibration_run_has_none(env, tmp_path) -> None:
    healthy = tmp_path / "healthy"
    shutil.copytree(SAMPLES / "healthy", healthy)
    (healthy / "canary_probe.jsonl").unlink()
    out = tmp_path / "r.json"
    result = CliRunner(env=env).invoke(
        cli,
        [
            "envelope",
            str(SAMPLES / "collapse"),
            "--compare",
            "--calibrate-on",
            str(healthy),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 1, result.output + result.stderr
    c = json.loads(out.read_text())["comparison"]
    assert "probe" not in c["agreement"] and "probe" not in c["constants"]
    (skip,) = [s for s in c["skipped"] if s.get("series") == "probe"]
    assert "has no canary_probe.jsonl" in skip["reason"]
    assert c["agreement"]["logs_endpoints"]["compared"] == 25
