"""Verdicts that hold on runs nobody tuned for.

Every rule is tested as an invariant over runs trained in this session by tests/fresh_runs.py
(HF Trainer and plain torch loops; mixtral, olmoe, qwen2_moe; several seeds, sizes and save
intervals; healthy, collapsing, overfitting and awkwardly saved runs) and over the shipped
samples. No threshold is read off any one of them (docs/policy.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from moeaudit.cache import ReceiptsCache
from moeaudit.canary import load
from moeaudit.certify import audit_run
from moeaudit.cli import cli
from moeaudit.policy import Policy, load_policy

pytestmark = pytest.mark.fresh_runs

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
SEVERITY = {"PASS": 0, "INCONCLUSIVE": 1, "FAIL": 2}
STATUS = {"BASELINE": 0, "GREEN": 0, "YELLOW": 1, "RED": 2}
LOGS = ("metrics.jsonl", "canary_probe.jsonl", "events.jsonl", "canary.safetensors")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fresh-cache")


@pytest.fixture(scope="module")
def env(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"MOEAUDIT_CACHE_DIR": str(cache), "XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("config"))}


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))


def _canary(run: Path) -> Path:
    own = run / "canary.safetensors"
    return own if own.is_file() else SAMPLES / "canary.safetensors"


def _policy(run: Path) -> Policy:
    return load_policy(SAMPLES / "policy.toml") if run.parent == SAMPLES else Policy()


def _audit(
    run: Path, cache: Path, policy: Policy | None = None, canary: Path | None = None, **kw: Any
) -> dict[str, Any]:
    audit = audit_run(run, load(canary or _canary(run)), policy or Policy(), cache=ReceiptsCache(cache), **kw)
    return audit.statement["predicate"]


def _truncated(run: Path, until: int, dst: Path, events: list[dict[str, Any]] | None = None) -> Path:
    """A physical copy of ``run`` holding only its checkpoints up to ``until`` (and its logs)."""
    out = dst / f"{run.name}-{until}"
    out.mkdir(parents=True)
    for s in _steps(run):
        if s <= until:
            shutil.copytree(run / f"checkpoint-{s}", out / f"checkpoint-{s}")
    for name in LOGS:
        if (run / name).is_file():
            shutil.copy(run / name, out / name)
    if events is not None:
        (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return out


def _gate(env: dict[str, str], run: Path, b: int, c: int, tmp: Path) -> tuple[int, dict[str, Any]]:
    out = tmp / f"gate-{run.name}-{b}-{c}.json"
    args = [
        "gate",
        str(run / f"checkpoint-{b}"),
        str(run / f"checkpoint-{c}"),
        "--json",
        str(out),
        "--canary",
        str(_canary(run)),
    ]
    if run.parent == SAMPLES:
        args += ["--policy", str(SAMPLES / "policy.toml")]
    result = CliRunner(env=env).invoke(cli, args)
    assert result.exit_code in (0, 1, 3), result.output + result.stderr
    return result.exit_code, json.loads(out.read_text())


def _all_runs(fresh_runs: Any) -> list[Path]:
    return [fresh_runs[name] for name in fresh_runs] + [
        SAMPLES / r
        for r in ("healthy", "collapse", "frozen-drift", "sft-refine", "sft-repurpose", "resume", "deepseek")
    ]


# --- §1 the CI gate never promotes what certify would mark RED ----------------------------------


def test_gate_is_certify_of_the_run_truncated_at_the_candidate(fresh_runs, env, cache, tmp_path) -> None:
    """For every candidate c of every run and the bases b = first and previous checkpoint:
    gate(b, c) decides on exactly the gates certify gives the run truncated at c (a physical
    copy), and PROMOTE implies c is GREEN/BASELINE there with a non-FAIL verdict."""
    decisions = set()
    for run in _all_runs(fresh_runs):
        steps = _steps(run)
        for i, c in enumerate(steps[1:], 1):
            pred = _audit(_truncated(run, c, tmp_path), cache, _policy(run), _canary(run))
            for b in sorted({steps[0], steps[i - 1]}):
                code, result = _gate(env, run, b, c, tmp_path)
                where = (run.name, b, c)
                assert [(g["step"], g["status"]) for g in result["gates"]] == [
                    (g["step"], g["status"]) for g in pred["gates"]
                ], where
                assert result["verdict"] == pred["verdict"], where
                assert code == {"PROMOTE": 0, "HOLD": 1, "INCONCLUSIVE": 3}[result["decision"]], where
                if result["decision"] == "PROMOTE":
                    assert pred["gates"][-1]["status"] in ("GREEN", "BASELINE"), where
                    assert pred["verdict"] != "FAIL", where
                if pred["verdict"] == "FAIL" or pred["gates"][-1]["status"] in ("YELLOW", "RED"):
                    assert result["decision"] == "HOLD", where
                decisions.add(result["decision"])
    assert decisions >= {"PROMOTE", "HOLD"}


def test_the_base_named_changes_no_decision_within_a_run(fresh_runs, env, tmp_path) -> None:
    """Every pair (b, c), b < c, of a run with eight checkpoints: the decision for c is the same
    whichever earlier checkpoint is named as the base (the run's history decides, not the pair)."""
    run = fresh_runs["collapse-loop"]
    steps = _steps(run)
    assert len(steps) >= 8
    for c in steps[1:]:
        decided = {_gate(env, run, b, c, tmp_path)[1]["decision"] for b in steps if b < c}
        assert len(decided) == 1, (c, decided)


def test_a_rollback_is_held(fresh_runs, env, tmp_path) -> None:
    run = fresh_runs["healthy-a"]
    steps = _steps(run)
    code, result = _gate(env, run, steps[-1], steps[1], tmp_path)
    assert code == 1 and result["decision"] == "HOLD"
    assert "rollback" in result["verdict_reason"]
    assert result["conditions"][0]["value"] == steps[1] and result["conditions"][0]["threshold"] == steps[-1]


def test_a_rule_the_log_cannot_fire_is_inconclusive_never_a_pass(fresh_runs, cache, tmp_path) -> None:
    """Logs spanning fewer steps than the starvation window: the level rule cannot fire, so the
    envelope is INCONCLUSIVE (and so is the verdict), never 'compliant'."""
    run = fresh_runs["healthy-loop"]  # saves every 50 steps; starve_steps is 100
    pred = _audit(_truncated(run, 50, tmp_path), cache)
    assert len(pred["gates"]) == 1  # one checkpoint: nothing compared either
    two = _truncated(run, 100, tmp_path / "b")
    policy = Policy()
    from dataclasses import replace

    long_window = replace(policy, envelope=replace(policy.envelope, starve_steps=1000))
    pred = _audit(two, cache, long_window)
    check = next(c for c in pred["checks"] if c["name"] == "envelope")
    assert check["status"] == "INCONCLUSIVE" and "starvation" in check["reason"]
    assert pred["verdict"] == "INCONCLUSIVE", pred["verdict_reason"]


# --- §2 healthy runs pass under the defaults and under their own calibration ---------------------


@pytest.fixture(scope="module")
def calibrations(fresh_runs, env, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("policies")
    policies = {}
    for name, run in fresh_runs.of_kind("healthy").items():
        path = out / f"{name}.toml"
        result = CliRunner(env=env).invoke(
            cli, ["calibrate", str(run), "--canary", str(_canary(run)), "--out", str(path)]
        )
        assert result.exit_code == 0, (name, result.output + result.stderr)
        policies[name] = path
    return policies


def test_healthy_runs_pass_under_defaults_and_their_own_calibration(fresh_runs, cache, calibrations) -> None:
    healthy = {**fresh_runs.of_kind("healthy"), **fresh_runs.of_kind("stress")}
    for name, run in healthy.items():
        pred = _audit(run, cache)
        assert pred["verdict"] == "PASS", (name, pred["verdict_reason"])
    fitted = 0
    for name, path in calibrations.items():
        policy = load_policy(path)
        pred = _audit(fresh_runs[name], cache, policy)
        assert pred["verdict"] == "PASS", (name, pred["verdict_reason"])
        envelope = next(c for c in pred["checks"] if c["name"] == "envelope")
        assert envelope["status"] == "PASS", name
        if policy.envelope.calibrated:  # the variance bound was fitted: it is gated, and holds
            fitted += 1
            assert "compliant on every window" in envelope["reason"], name
        else:  # no falsifiable variance fit on this run: only the level check was fitted
            assert "not fitted" in policy.envelope.provenance and "reported, not gated" in envelope["reason"]
    assert fitted >= 2  # most healthy runs admit a falsifiable variance bound


def test_collapse_and_overfit_fail_under_defaults_and_every_calibration(fresh_runs, cache, calibrations) -> None:
    bad = {**fresh_runs.of_kind("collapse"), **fresh_runs.of_kind("overfit")}
    assert len(bad) >= 3
    for name, run in bad.items():
        assert _audit(run, cache)["verdict"] == "FAIL", name
        for healthy, path in calibrations.items():
            pred = _audit(run, cache, load_policy(path))
            assert pred["verdict"] == "FAIL", (name, healthy, pred["verdict_reason"])


def test_the_calibrated_policy_says_what_it_fitted(calibrations) -> None:
    text = next(iter(calibrations.values())).read_text()
    for key in (
        "gates.tol_c2_rel",
        "gates.pi_min_ratio_floor",
        "gates.entropy_ratio_floor",
        "envelope.epsilon",
        "envelope.delta",
        "envelope.starve_share",
    ):
        assert f"#   {key} = " in text
    assert "gate tolerances fitted on checkpoints" in text and "kept (not fitted)" in text
    policy = load_policy(next(iter(calibrations.values())))
    assert policy.gates.calibrated and policy.envelope.calibrated
    assert policy.gates.tol_c2_rel >= Policy().gates.tol_c2_rel


# --- §3 calibrate refuses constants that cannot fail ---------------------------------------------


def test_calibrating_on_a_collapse_run_is_refused(fresh_runs, env, tmp_path) -> None:
    for name, run in fresh_runs.of_kind("collapse").items():
        out = tmp_path / f"{name}.toml"
        result = CliRunner(env=env).invoke(
            cli, ["calibrate", str(run), "--canary", str(_canary(run)), "--out", str(out)]
        )
        assert result.exit_code == 4, (name, result.output)
        last = result.stderr.strip().splitlines()[-1]  # progress lines above it, then one error line
        assert last.startswith("moeaudit: error:") and "not a healthy run" in last
        assert not out.exists()


def _with_norms(run: Path, dst: Path, edit: Any) -> Path:
    """A copy of ``run`` whose metrics.jsonl has each line's expert_grad_norms passed through
    ``edit(step, layer, norms) -> norms``."""
    out = _truncated(run, _steps(run)[-1], dst)
    lines = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        obj = json.loads(line)
        obj["expert_grad_norms"] = {k: edit(obj["step"], k, v) for k, v in obj["expert_grad_norms"].items()}
        lines.append(json.dumps(obj))
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return out


def test_one_zero_norm_cannot_switch_starvation_off(fresh_runs, env, cache, tmp_path) -> None:
    """§3: a healthy log with one zero gradient norm calibrates to a positive starvation share,
    and under that policy half of every layer's experts dead for the whole run FAILs (§3), as
    does an expert starved on 90% of steps in stretches shorter than the window (§4)."""
    run = fresh_runs["healthy-loop"]  # 8 experts, a log line every step
    one_zero = _with_norms(run, tmp_path / "zero", lambda t, k, v: [0.0, *v[1:]] if t == 200 and k == "0" else v)
    path = tmp_path / "policy.toml"
    result = CliRunner(env=env).invoke(
        cli, ["calibrate", str(one_zero), "--canary", str(_canary(run)), "--out", str(path)]
    )
    assert result.exit_code == 0, result.output + result.stderr
    policy = load_policy(path)
    assert policy.envelope.starve_share > 0.05
    half_dead = _with_norms(run, tmp_path / "dead", lambda t, k, v: [0.0] * 4 + v[4:])
    intermittent = _with_norms(
        run, tmp_path / "flaky", lambda t, k, v: ([0.0, *v[1:]] if t % 10 else v) if k == "1" else v
    )
    for bad in (half_dead, intermittent):
        pred = _audit(bad, cache, policy, _canary(run))
        envelope = next(c for c in pred["checks"] if c["name"] == "envelope")
        assert envelope["status"] == "FAIL" and "starved" in envelope["reason"], bad.name
        assert pred["verdict"] == "FAIL"
        # and under the built-in defaults too: starvation is scale-free
        assert _audit(bad, cache, None, _canary(run))["verdict"] == "FAIL", bad.name


# --- §5 events written by the audited party cannot improve a verdict -----------------------------


def test_declared_events_never_improve_a_verdict(fresh_runs, cache, tmp_path) -> None:
    """Resumes at every checkpoint, at every other one, or only at the worst: each gate is at
    least as severe as without events, and so is the verdict."""
    for name in ("collapse-a", "collapse-loop", "overfit", "healthy-b"):
        run = fresh_runs[name]
        steps = _steps(run)
        plain = _audit(run, cache)
        for k, chosen in enumerate((steps[1:], steps[1::2], steps[-1:])):
            events = [{"step": s, "event": "resume", "note": "declared"} for s in chosen]
            pred = _audit(_truncated(run, steps[-1], tmp_path / f"{name}-{k}", events), cache)
            assert SEVERITY[pred["verdict"]] >= SEVERITY[plain["verdict"]], (name, chosen)
            for g, g0 in zip(pred["gates"], plain["gates"], strict=True):
                assert STATUS[g["status"]] >= STATUS[g0["status"]], (name, chosen, g["step"])
            listed = pred["run"]["events"]
            assert [e["step"] for e in listed] == chosen
            assert all(e["source"].startswith("events.jsonl:") for e in listed)


# --- §6 signed sentences true on unseen runs -----------------------------------------------------


def test_overfit_is_red_at_once_when_structure_and_scalar_are_both_bad(fresh_runs, cache) -> None:
    pred = _audit(fresh_runs["overfit"], cache)
    first_bad = next(g for g in pred["gates"] if g["status"] != "GREEN" and g["status"] != "BASELINE")
    assert first_bad["status"] == "RED" and first_bad["scalar"] == "worsening"
    assert not first_bad["structural"]["c2_ok"]
    nll = [g["receipts"]["nll"] for g in pred["gates"]]
    assert nll[-1] >= 3 * min(nll)


def test_overfitting_between_two_checkpoints_still_fails(fresh_runs, cache, tmp_path) -> None:
    """The overfit run saved only before (150) and after (300) memorising: the one gate that
    sees it is RED (C2 fell on a protected layer while the held-out NLL rose 5×)."""
    run = fresh_runs["overfit"]
    out = tmp_path / "sparse"
    out.mkdir()
    for s in (50, 100, 150, 300):
        shutil.copytree(run / f"checkpoint-{s}", out / f"checkpoint-{s}")
    shutil.copy(run / "metrics.jsonl", out / "metrics.jsonl")
    pred = _audit(out, cache, canary=_canary(run))
    last = pred["gates"][-1]
    assert last["scalar"] == "worsening" and last["status"] == "RED" and pred["verdict"] == "FAIL"
    assert any("held-out canary NLL worsened during pretraining" in c for c in last["claims"]["licensed"])


def test_no_change_is_never_signed_as_fell_or_rose(fresh_runs, cache) -> None:
    seen = 0
    for name in fresh_runs:
        for g in _audit(fresh_runs[name], cache)["gates"][1:]:
            sentences = g["claims"]["licensed"]
            scalar = [s for s in sentences if s.startswith("canary NLL")]
            assert len(scalar) == 1, (name, g["step"])
            if g["scalar"] == "no change":
                seen += 1
                assert "fell" not in scalar[0] and "rose" not in scalar[0]
                assert "no change beyond tolerance and bootstrap noise" in scalar[0]
            ci = g["nll_change"]["ci95"]
            if ci is not None and ci[0] < 0 < ci[1]:
                assert g["scalar"] == "no change"
    assert seen


def test_training_loss_is_named_as_logged(fresh_runs, cache) -> None:
    pred = _audit(fresh_runs["healthy-a"], cache)
    logged = json.loads((fresh_runs["healthy-a"] / "metrics.jsonl").read_text().splitlines()[0])
    sentences = [s for g in pred["gates"][1:] for s in g["claims"]["licensed"] if "logged" in s]
    assert sentences
    for key in ("loss", "lm_loss"):
        named = [s for s in sentences if s.startswith(f"the logged {key} ")]
        assert bool(named) == (key in logged), key


def test_below_a_health_floor_is_never_green(fresh_runs, cache) -> None:
    for name in fresh_runs:
        for g in _audit(fresh_runs[name], cache)["gates"]:
            if not g["health"]["ok"]:
                assert g["status"] != "GREEN", (name, g["step"])
                assert not any("stayed within the occupancy floors" in s for s in g["claims"]["licensed"])


def test_one_checkpoint_under_two_names_is_one_checkpoint_of_evidence(fresh_runs, cache, tmp_path) -> None:
    run = fresh_runs["stress-frozen"]  # updates skipped in (200, 250]: two names, one digest
    pred = _audit(run, cache)
    dup = next(g for g in pred["gates"] if g["step"] == 250)
    assert dup["duplicate_of"] == 200
    assert any(c["name"] == "distinct" and "step 250 = step 200" in c["reason"] for c in pred["checks"])
    # a baseline and its copy: baseline-only evidence, INCONCLUSIVE, never PASS
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(run / "checkpoint-200", copy / "checkpoint-200")
    shutil.copytree(run / "checkpoint-200", copy / "checkpoint-300")
    pred = _audit(copy, cache, canary=_canary(run))
    assert pred["verdict"] == "INCONCLUSIVE", pred["verdict_reason"]
    assert next(c for c in pred["checks"] if c["name"] == "comparison")["status"] == "INCONCLUSIVE"


# --- §8 exit codes and JSON a script can trust ---------------------------------------------------


def test_gate_json_names_the_value_and_threshold_that_failed(fresh_runs, env, cache, tmp_path) -> None:
    run = fresh_runs["overfit"]
    steps = _steps(run)
    red = next(g["step"] for g in _audit(run, cache)["gates"] if g["status"] == "RED")
    code, result = _gate(env, run, steps[0], red, tmp_path)
    assert code == 1 and result["decision"] == "HOLD"
    cand = result["conditions"][0]
    assert cand["status"] == "fail" and cand["failed"]
    for f in cand["failed"]:
        assert f["value"] is not None and f["threshold"] is not None and "what" in f
    first = cand["failed"][0]
    assert (cand["value"], cand["threshold"]) == (first["value"], first["threshold"])
    assert not cand["detail"].startswith(("GREEN: GREEN", "RED: RED"))
    text = json.dumps(result)
    assert "GREEN: GREEN" not in text and "RED: RED" not in text


def test_an_inconclusive_gate_exits_3_and_fails_the_junit_decision(env, tmp_path) -> None:
    """One sample checkpoint under two step names: baseline-only evidence, so the run verdict
    is INCONCLUSIVE and the gate exits 3 (README.md, "Exit codes"); JUnit counts its decision as a failure,
    never 0 failures, and the same document with PROMOTE as 0 failures."""
    from moeaudit.report.ci import junit_xml

    run = tmp_path / "copy"
    for step in (250, 500):
        shutil.copytree(SAMPLES / "healthy" / "checkpoint-250", run / f"checkpoint-{step}")
    code, result = _gate(env, run, 250, 500, tmp_path)
    assert code == 3
    assert (result["decision"], result["verdict"]) == ("INCONCLUSIVE", "INCONCLUSIVE")
    xml = junit_xml(result)
    assert 'failures="1"' in xml and 'type="inconclusive"' in xml
    promoted = junit_xml({**result, "decision": "PROMOTE"})
    assert 'failures="0"' in promoted
