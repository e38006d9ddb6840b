"""The envelope's rules evaluated online, one logged step at a time, raise the
events ``moeaudit envelope`` reports on the written metrics.jsonl — at the step they fire."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeaudit.cli import cli
from moeaudit.integrations.online import EnvelopeEvent, OnlineEnvelope, events_of_report
from moeaudit.policy import load_policy

CALIBRATED = """[envelope]
variant = "normalized"
calibrated = true
provenance = "test"
delta = 0.05
epsilon = 0.02
window = 60
sampling_interval = 5
starve_steps = 40
dead_steps = 30
"""


def _stream(steps: int = 240, seed: int = 0):
    """Two layers of 4 experts: a burst of tiny norms (alert, Eq. 21), an expert starved for a
    stretch, one dead for longer than dead_steps, a null norm, and a variance jump."""
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        norms: dict[str, list[float | None]] = {}
        for layer in ("0", "1"):
            g: list[float | None] = [1.0 + 0.3 * rng.random() for _ in range(4)]
            if layer == "0" and 20 <= step <= 26:
                g = [1e-5 * (1 + e + rng.random()) for e in range(4)]
            if layer == "1" and 60 <= step <= 140:
                g[2] = 0.004 * rng.random()
            if layer == "0" and 100 <= step <= 230:
                g[3] = 1e-7
            if layer == "1" and step == 150:
                g[0] = None
            if layer == "0" and 200 <= step <= 204:
                g[1] = 9.0
            norms[layer] = g
        yield step, norms


def _run(tmp_path: Path, policy_text: str | None, every: int = 1) -> tuple[list[EnvelopeEvent], dict]:
    policy = None
    if policy_text is not None:
        policy = tmp_path / "policy.toml"
        policy.write_text(policy_text)
    settings = load_policy(policy).envelope
    online = OnlineEnvelope(settings, every=every)
    fired_at: list[tuple[int, EnvelopeEvent]] = []
    log = tmp_path / "metrics.jsonl"
    with log.open("w") as f:
        for step, norms in _stream():
            if step % every:
                continue
            f.write(json.dumps({"step": step, "loss": 1.0, "expert_grad_norms": norms}) + "\n")
            fired_at += [(step, e) for e in online.push(step, norms)]
    assert all(e.step <= step for step, e in fired_at)  # raised no later than the step it names
    args = ["envelope", str(log), "--json", str(tmp_path / "report.json")]
    result = CliRunner().invoke(cli, args + (["--policy", str(policy)] if policy else []))
    assert result.exit_code in (0, 1), result.output
    report = json.loads((tmp_path / "report.json").read_text())
    return online.events, report


def _keys(events: list[EnvelopeEvent]) -> list[tuple]:
    return sorted((e.kind, e.series, e.step, e.expert or -1, e.check or "") for e in events)


def test_builtin_policy_rules_match_the_cli(tmp_path: Path) -> None:
    online, report = _run(tmp_path, None)
    assert _keys(online) == _keys(events_of_report(report, calibrated=False))
    kinds = {e.kind for e in online}
    assert kinds == {"alert", "dead_expert", "starvation"}  # no variance events: uncalibrated
    dead = [e for e in online if e.kind == "dead_expert"]
    assert [(e.series, e.expert, e.step) for e in dead] == [("0", 3, 200)]  # > 100 steps below 1e-6


@pytest.mark.parametrize("every", [1, 2])
def test_calibrated_policy_events_match_the_cli(tmp_path: Path, every: int) -> None:
    """Block means of sampling_interval = 5 steps, Grönwall windows, Δ-step pairs, a null norm."""
    online, report = _run(tmp_path, CALIBRATED, every)
    assert report["sampling"].get("resampled") is not None
    want = events_of_report(report, calibrated=True)
    # the last block of the run is judged by the batch code, online only when the next opens
    last = report["window"]["to"]
    assert _keys(online) == _keys([e for e in want if not (e.kind == "variance_bound" and e.step == last)])
    assert {e.kind for e in online} >= {"alert", "starvation", "dead_expert", "variance_bound"}
    assert {e.check for e in online if e.kind == "variance_bound"} == {"gronwall", "discrete"}


def test_warmup_samples_are_not_judged(tmp_path: Path) -> None:
    policy = CALIBRATED + "warmup_steps = 30\n"
    online, report = _run(tmp_path, policy)
    assert all(e.step >= 30 for e in online)
    assert not any(e.kind == "alert" for e in online)  # the burst at 20-26 is warm-up
    last = report["window"]["to"]
    want = [e for e in events_of_report(report) if not (e.kind == "variance_bound" and e.step == last)]
    assert _keys(online) == _keys(want)


def test_resume_primes_the_rules_from_the_kept_log(tmp_path: Path) -> None:
    """After a resume the online rules continue from the log's lines up to the resume step: an
    expert already reported starved is not reported again, and the windows go on."""
    pytest.importorskip("transformers")
    from hfmodels import tiny_model

    from moeaudit.integrations.core import RunRecorder

    lines = [json.dumps({"step": s, "loss": 1.0, "expert_grad_norms": n}) for s, n in _stream()]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    fresh = OnlineEnvelope(load_policy(None).envelope)
    for step, norms in _stream():
        if step <= 150:
            fresh.push(step, norms)
    recorder = RunRecorder(tmp_path, tiny_model("mixtral"), canary=None, every=1, probe=False, resume_step=150)
    assert recorder.monitor is not None and recorder.monitor.events == []
    for step, norms in _stream():
        if step > 150:
            assert recorder.monitor.push(step, norms) == fresh.push(step, norms)
    recorder.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1] == 150
