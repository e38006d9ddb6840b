"""Verdicts that hold on confident routers, top-1 routing, missing logs and dead experts the
replay can see, and a calibration that fits only healthy runs (docs/policy.md).

Every case is a run trained in this session by tests/fresh_runs.py (``confident-router``,
``top1``, ``killed-expert``, ``domain-shift``), or a copy of one with a file taken away or a
stage declared; nothing here is tuned to the shipped samples."""

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

HELD = "co-active overlap compatibility (C2) held"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("judgement-cache")


@pytest.fixture(scope="module")
def env(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"MOEAUDIT_CACHE_DIR": str(cache), "XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("config"))}


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))


def _audit(run: Path, cache: Path, policy: Policy | None = None, canary: Path | None = None) -> dict[str, Any]:
    probe = load(canary or run / "canary.safetensors")
    return audit_run(run, probe, policy or Policy(), cache=ReceiptsCache(cache)).statement["predicate"]


def _copy(run: Path, dst: Path, *, until: int | None = None, logs: tuple[str, ...] = ("metrics.jsonl",)) -> Path:
    """A copy of ``run`` with its checkpoints up to ``until``, its canary and the ``logs`` named."""
    dst.mkdir(parents=True)
    for s in _steps(run):
        if until is None or s <= until:
            shutil.copytree(run / f"checkpoint-{s}", dst / f"checkpoint-{s}")
    for name in ("canary.safetensors", *logs):
        lines = (run / name).read_bytes().splitlines(keepends=True) if name.endswith(".jsonl") else None
        if lines is None or until is None:
            shutil.copy(run / name, dst / name)
        else:  # the log as it stood at ``until``
            (dst / name).write_bytes(b"".join(x for x in lines if json.loads(x)["step"] <= until))
    return dst


def _check(pred: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pred["checks"] if c["name"] == name)


def _calibrate(env: dict[str, str], run: Path, out: Path) -> Any:
    return CliRunner(env=env).invoke(
        cli, ["calibrate", str(run), "--canary", str(run / "canary.safetensors"), "--out", str(out)]
    )


def _gate(env: dict[str, str], run: Path, out: Path, *extra: str) -> Any:
    """``moeaudit gate`` of the run's first and last checkpoints on its canary, JSON to ``out``."""
    steps = _steps(run)
    return CliRunner(env=env).invoke(
        cli,
        ["gate", str(run / f"checkpoint-{steps[0]}"), str(run / f"checkpoint-{steps[-1]}"), "--json", str(out)]
        + [*extra, "--canary", str(run / "canary.safetensors")],
    )


def _sentences(gate: dict[str, Any]) -> list[str]:
    return gate["claims"]["licensed"]


def _held_is_computed(pred: dict[str, Any]) -> None:
    """The invariant: a gate signs that C2 held only where C2 was computed on every protected
    layer at the gate and its baseline."""
    protected = {str(layer) for layer in pred["protected_layers"]}
    for g in pred["gates"]:
        st = g.get("structural") or g.get("continuity")
        held = [s for s in _sentences(g) if s.startswith(HELD)]
        if held:
            assert st is not None and st["c2_ok"] and "c2_status" not in st, g["step"]
            assert set(st["c2_deltas"]) == protected, (g["step"], st["c2_deltas"])
            assert all(v is not None for v in st["c2_deltas"].values())


# --- a confident router is not a failure -------------------------------------------------------


def test_a_confident_router_is_not_a_failure(fresh_runs, env, cache, tmp_path) -> None:
    """Router rate ×1000 for 30 steps: the co-active partner's ρ underflows to exactly 0 on
    some canary tokens. C2 is the mean over the tokens with a pair weight, those left out are
    counted, every receipt is finite, and the healthy run passes with C2 signed as held over
    the counted tokens."""
    run = fresh_runs["confident-router"]
    pred = _audit(run, cache)
    assert pred["verdict"] == "PASS", pred["verdict_reason"]
    assert [g["status"] for g in pred["gates"]] == ["BASELINE", "GREEN", "GREEN"]
    assert _check(pred, "finite")["status"] == "PASS"
    tokens = 24 * 48  # the fresh canary: 24 windows of 48 tokens
    excluded = {}
    for g in pred["gates"][1:]:
        st = g["structural"]
        assert st["c2_ok"] and "c2_status" not in st
        assert set(st["c2_deltas"]) == {str(layer) for layer in pred["protected_layers"]}
        excluded[g["step"]] = {int(k): v for k, v in st["c2_excluded_tokens"].items()}
        assert st["c2_tokens"] == tokens
        for row in g["receipts"]["per_layer"]:
            assert row["c2"] is not None and row["c2_ci95"] is not None
            assert row.get("c2_excluded_tokens", 0) == excluded[g["step"]].get(row["layer"], 0)
        held = [s for s in _sentences(g) if s.startswith(HELD)]
        assert len(held) == 1
        for layer, n in excluded[g["step"]].items():
            assert f"layer {layer}: {n} of {tokens}" in held[0]
    # the router grew confident after the boost: a sizable minority of tokens, not all
    assert all(0 < n < tokens // 2 for by_layer in excluded.values() for n in by_layer.values())
    assert max(n for by_layer in excluded.values() for n in by_layer.values()) >= 100
    # the baseline, before the boost, left nothing out
    first = pred["gates"][0]["receipts"]["per_layer"]
    assert all("c2_excluded_tokens" not in row for row in first)
    _held_is_computed(pred)
    # and the CI gate promotes the last checkpoint (it held every candidate on a NaN)
    out = tmp_path / "gate.json"
    result = _gate(env, run, out)
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads(out.read_text())["decision"] == "PROMOTE"


def test_held_is_signed_only_for_a_computed_c2_on_every_fresh_run(fresh_runs, cache) -> None:
    """The invariant over every fresh run (healthy, collapsing, overfitting, awkwardly saved,
    top-1, confident): no gate signs that C2 held unless C2 was computed on every protected
    layer there and at its baseline, and no receipt the gates rest on is NaN."""
    for name in fresh_runs:
        pred = _audit(fresh_runs[name], cache)
        _held_is_computed(pred)
        assert not any("overlap.c2" in c["reason"] for c in pred["checks"] if c["name"] == "finite"), name


def test_a_c2_that_was_not_computed_is_never_signed_held(fresh_runs, cache) -> None:
    """k = 2 receipts of the confident run with one protected layer's C2 null at the last
    checkpoint (a receipt that was not finite): "not computed" is said, no C2 is signed as held,
    the structure is not established (never GREEN) and the CI condition names the layer."""
    import copy

    from moeaudit.judge.gates import Checkpointed, evaluate_gates
    from moeaudit.judge.promote import candidate_condition

    run = fresh_runs["confident-router"]
    audit = audit_run(run, load(run / "canary.safetensors"), Policy(), cache=ReceiptsCache(cache))
    pred = audit.statement["predicate"]
    docs = {g["step"]: copy.deepcopy(audit.receipts[f"checkpoint-{g['step']}.json"]) for g in pred["gates"]}
    last, layer = max(docs), pred["protected_layers"][0]
    entry = next(e for e in docs[last]["layers"] if e["layer"] == layer)
    entry["overlap"]["c2"] = None
    points = [Checkpointed(step, doc, "first" if step == min(docs) else None) for step, doc in sorted(docs.items())]
    policy = Policy()
    gates = evaluate_gates(points, pred["protected_layers"], policy.gates, resamples=0)
    g = gates[-1]
    st = g["structural"]
    assert st["c2_status"] == "not computed" and st["c2_not_computed_layers"] == [layer] and not st["ok"]
    assert g["status"] == "YELLOW"
    sentences = _sentences(g)
    assert not any(s.startswith(HELD) for s in sentences)
    assert any(f"not computed on protected layer(s) [{layer}]" in s for s in sentences)
    assert not any(s.startswith("structure preserved") for s in sentences)
    cond = candidate_condition(g, policy.gates)
    assert cond["status"] == "fail" and "C2 not computed" in cond["detail"]
    assert any(f["what"] == f"C2 on protected layer {layer} not computed" for f in cond["failed"])
    assert gates[1]["status"] == "GREEN"  # the untouched gate before it


def test_c2_leaves_out_only_tokens_without_a_pair_weight() -> None:
    """Per token: a pair weight of 0 makes the token undefined (left out), any positive weight
    keeps it; the mean over the kept tokens is the plain mean when every token is kept."""
    import torch

    from moeaudit.receipts.overlap import defined_mean, pair_weighted_defined

    kappa = torch.tensor([[[1.0, 0.5], [0.5, 1.0]], [[1.0, -0.2], [-0.2, 1.0]], [[1.0, 0.9], [0.9, 1.0]]]).double()
    rho = torch.tensor([[0.6, 0.4], [1.0, 0.0], [0.7, 1e-30]]).double()
    value, defined = pair_weighted_defined(kappa, rho[:, :, None] * rho[:, None, :])
    assert defined.tolist() == [True, False, True]
    assert float(defined_mean(value, defined)) == pytest.approx((0.5 + 0.9) / 2)
    everything = torch.tensor([0.25, 0.5, 0.125]).double()
    assert float(defined_mean(everything, torch.ones(3, dtype=torch.bool))) == float(everything.mean())


# --- top-1 routing has no C2 ---------------------------------------------------------------------


def test_top1_routing_names_c2_not_applicable_and_what_was_judged(fresh_runs, env, cache, tmp_path) -> None:
    run = fresh_runs["top1"]
    pred = _audit(run, cache)
    assert pred["verdict"] == "PASS", pred["verdict_reason"]
    assert [g["status"] for g in pred["gates"]] == ["BASELINE", "GREEN", "GREEN"]
    for g in pred["gates"][1:]:
        sentences = _sentences(g)
        assert not any("C2) held" in s for s in sentences)
        st = g["structural"]
        assert st["c2_status"] == "not applicable" and st["c2_deltas"] == {}
        assert set(st["c2_not_applicable"]) == {str(layer) for layer in pred["protected_layers"]}
        c2 = [s for s in sentences if "(C2)" in s]
        assert len(c2) == 1 and "not applicable" in c2[0] and "no co-active pairs" in c2[0]
        assert "structural rule for k = 1" in c2[0]
        assert any(s.startswith("structure preserved") and "occupancy alone" in s for s in sentences)
    _held_is_computed(pred)
    out = tmp_path / "gate.json"
    result = _gate(env, run, out)
    assert result.exit_code == 0, result.output + result.stderr
    detail = json.loads(out.read_text())["conditions"][0]["detail"]
    assert "C2 not applicable" in detail and "C2 held" not in detail


# --- every expert active (E = k): C2 exists and is judged; the boundary does not ------------------


def test_every_expert_active_judges_c2_over_its_pairs(fresh_runs, env, cache, tmp_path) -> None:
    """Two experts, top-2: every token uses both, so there is no selection boundary, but the
    co-active pair exists on every token: C2 is computed on every protected layer, judged like
    any k ≥ 2 run's, and signed as held; the transition and adjacency receipts, which need an
    expert beyond R_k, say why they are absent."""
    run = fresh_runs["every-active"]
    audit = audit_run(run, load(run / "canary.safetensors"), Policy(), cache=ReceiptsCache(cache))
    pred = audit.statement["predicate"]
    assert pred["verdict"] == "PASS", pred["verdict_reason"]
    assert [g["status"] for g in pred["gates"]] == ["BASELINE", "GREEN", "GREEN"]
    protected = {str(layer) for layer in pred["protected_layers"]}
    for g in pred["gates"][1:]:
        st = g["structural"]
        assert "c2_status" not in st and st["c2_ok"] and set(st["c2_deltas"]) == protected
        assert any(s.startswith(HELD) for s in _sentences(g))
        assert not any("not applicable" in s for s in _sentences(g))
    _held_is_computed(pred)
    for step in _steps(run):
        for layer in audit.receipts[f"checkpoint-{step}.json"]["layers"]:
            o, b = layer["overlap"], layer["boundary"]
            assert o["c2"] is not None and o["c2_smooth"] is not None and o["c2_excluded_tokens"] == 0
            assert -1.0 <= o["c2"] <= 1.0 and o["ci95"]["c2"][0] <= o["c2"] <= o["ci95"]["c2"][1]
            assert o["transition_incompatibility"] is None and "E = k" in o["reason"]
            assert b["margin_mean"] is None and "E = k" in b["reason"]
    out = tmp_path / "gate.json"
    result = _gate(env, run, out)
    assert result.exit_code == 0, result.output + result.stderr
    detail = json.loads(out.read_text())["conditions"][0]["detail"]
    assert "C2 held" in detail and "not applicable" not in detail


# --- a canary too small for its intervals ------------------------------------------------------------


def test_canary_check_counts_windows_only_below_the_minimum() -> None:
    from moeaudit.judge.decide import MIN_CANARY_WINDOWS, canary_check

    assert canary_check(None) is None and canary_check(MIN_CANARY_WINDOWS) is None
    check = canary_check(MIN_CANARY_WINDOWS - 1)
    assert check is not None and check["name"] == "canary" and check["status"] == "INCONCLUSIVE"
    assert check["evaluated"] and f"{MIN_CANARY_WINDOWS - 1} window(s)" in check["reason"]


def _cut_canary(run: Path, dst: Path, windows: int) -> Path:
    """A copy of ``run`` audited with the first ``windows`` windows of its canary (no probe log
    names the full one)."""
    from moeaudit import canary as canary_mod

    copy = _copy(run, dst)
    full = load(run / "canary.safetensors")
    cut = canary_mod.Canary(full.tokens_array[:windows], full.domain_ids_array[:windows], full.domains)
    canary_mod.save(cut, copy / "canary.safetensors")
    return copy


@pytest.mark.parametrize("name", ["top1", "every-active"])
def test_a_canary_of_too_few_windows_never_passes(fresh_runs, env, cache, tmp_path, name) -> None:
    """The same run and checkpoints: its canary cut to 7 windows, the verdict is INCONCLUSIVE for
    the canary (never PASS, never FAIL: a small canary is no evidence of damage) and `gate` exits
    3; cut to 8, the canary is no check at all."""
    from moeaudit.judge.decide import MIN_CANARY_WINDOWS

    run = fresh_runs[name]
    small = _cut_canary(run, tmp_path / "small", MIN_CANARY_WINDOWS - 1)
    pred = _audit(small, cache)
    assert pred["verdict"] == "INCONCLUSIVE" and "canary inconclusive" in pred["verdict_reason"]
    assert _check(pred, "canary")["basis"] == "canary-size"
    enough = _audit(_cut_canary(run, tmp_path / "enough", MIN_CANARY_WINDOWS), cache)
    assert not any(c["name"] == "canary" for c in enough["checks"])
    out = tmp_path / "gate.json"
    result = _gate(env, small, out)
    assert result.exit_code == 3, result.output + result.stderr
    doc = json.loads(out.read_text())
    assert doc["decision"] == "INCONCLUSIVE" and any(c["name"] == "canary" for c in doc["conditions"])


# --- a dead expert the replay can see is dead ------------------------------------------------------


def test_a_dead_expert_the_replay_can_see_is_dead(fresh_runs, cache, tmp_path) -> None:
    """Expert 1 of layer 0 zeroed and frozen at step 240, logs that stop before the kill: the
    router still sends it tokens (its share is healthy), but the replay gives it exactly zero
    canary gradient. It is dead at every checkpoint from 240, gated, and named."""
    run = fresh_runs["killed-expert"]
    kill = 240
    copy = _copy(run, tmp_path / "killed", logs=())
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] < kill))
    pred = _audit(copy, cache)
    assert pred["verdict"] == "FAIL", pred["verdict_reason"]
    health = _check(pred, "health")
    assert health["status"] == "FAIL" and "every checkpoint" not in health["reason"]
    for g in pred["gates"]:
        layer0 = next(row for row in g["receipts"]["per_layer"] if row["layer"] == 0)
        if g["step"] < kill:
            assert g["receipts"]["dead"] == 0 and "no_gradient" not in layer0, g["step"]
            assert g["status"] in ("BASELINE", "GREEN"), g["step"]
            continue
        assert g["receipts"]["dead"] == 1 and layer0["dead"] == 1 and layer0["no_gradient"] == [1], g["step"]
        assert g["status"] in ("YELLOW", "RED"), g["step"]
        assert not g["health"]["ok"]
        assert any(f["layer"] == 0 and f["what"] == "dead experts" and f["value"] == 1 for f in g["health"]["failed"])
        named = [s for s in _sentences(g) if "below an absolute health floor" in s]
        assert len(named) == 1 and "layer 0" in named[0] and "expert(s) 1" in named[0] and "starved" in named[0]
        assert not any(s.startswith("structure preserved") for s in _sentences(g))
        assert g["structural"]["layers_with_more_dead"] == [0]
    heat = pred["heatmaps"]["occupancy"]  # the last checkpoint's routing shares
    assert heat["pi"][heat["layers"].index(0)][1] > 0.1  # still routed: not a routing death


# --- missing logs are never a pass ----------------------------------------------------------------


@pytest.fixture(scope="module")
def logs_policy(fresh_runs, env, tmp_path_factory) -> Path:
    """``calibrate`` on the killed run before its kill (a healthy run with logs): a policy
    whose envelope reads metrics.jsonl."""
    run = fresh_runs["killed-expert"]
    tmp = tmp_path_factory.mktemp("logs-policy")
    healthy = _copy(run, tmp / "before-kill", until=200)
    path = tmp / "policy.toml"
    result = _calibrate(env, healthy, path)
    assert result.exit_code == 0, result.output + result.stderr
    return path


def test_a_calibrated_policy_never_turns_missing_logs_into_a_pass(fresh_runs, env, cache, logs_policy, tmp_path):
    """The run shipped without metrics.jsonl: the policy's envelope (source = logs) cannot be
    evaluated, so the built-in rules are, on the replays' per-expert canary gradients — and
    they find the starved expert. The gate holds."""
    policy = load_policy(logs_policy)
    assert policy.envelope.source == "logs"
    run = fresh_runs["killed-expert"]
    copy = _copy(run, tmp_path / "no-logs", logs=())
    pred = _audit(copy, cache, policy)
    envelope = _check(pred, "envelope")
    assert envelope["evaluated"] and envelope["status"] == "FAIL", envelope
    assert "does not apply here" in envelope["reason"] and "metrics.jsonl" in envelope["reason"]
    assert "starved" in envelope["reason"]
    report = pred["envelope"]
    assert report["source"] == "replay" and "metrics.jsonl" in report["fallback"]
    starved = {(s["layer"], s["expert"]) for s in report["starvation"]}
    assert ("0", 1) in starved
    assert pred["verdict"] == "FAIL"
    out = tmp_path / "gate.json"
    result = _gate(env, copy, out, "--policy", str(logs_policy))
    assert result.exit_code == 1, result.output + result.stderr
    gate = json.loads(out.read_text())
    assert gate["decision"] == "HOLD"
    env_cond = next(c for c in gate["conditions"] if c["name"] == "envelope")
    assert env_cond["status"] == "fail"


def test_a_policy_envelope_that_applies_is_not_replaced(fresh_runs, cache, logs_policy) -> None:
    """With its logs present the same policy's own envelope is evaluated: no fallback."""
    pred = _audit(fresh_runs["killed-expert"], cache, load_policy(logs_policy))
    assert "fallback" not in pred["envelope"]
    assert (
        pred["envelope"]["source"] == "logs"
        and pred["envelope"]["calibrated"] == load_policy(logs_policy).envelope.calibrated
    )


def test_a_series_the_rules_cannot_judge_is_inconclusive_never_a_pass(fresh_runs, cache) -> None:
    """A policy whose warm-up covers every logged sample of the run: the series exists but
    nothing of it can be checked — INCONCLUSIVE, not "not evaluated" (which passed)."""
    from dataclasses import replace

    policy = Policy()
    late = replace(policy, envelope=replace(policy.envelope, warmup_steps=10_000))
    run = fresh_runs["top1"]
    assert _audit(run, cache)["verdict"] == "PASS"  # healthy under the built-in warm-up
    pred = _audit(run, cache, late)
    envelope = _check(pred, "envelope")
    assert envelope["evaluated"] and envelope["status"] == "INCONCLUSIVE", envelope
    assert "could not be evaluated" in envelope["reason"] and "warm-up (step 10000)" in envelope["reason"]
    assert pred["verdict"] == "INCONCLUSIVE" and "envelope inconclusive" in pred["verdict_reason"]


def test_a_variance_bound_nothing_could_fail_does_not_hide_a_starved_expert() -> None:
    """A vacuous variance side is not evaluated, but the level rule's finding still fails."""
    from moeaudit.judge.decide import envelope_check

    starved = {"layer": "0", "expert": 1, "step": 320, "share": 0.0, "steps": 100, "fraction": 1.0}
    report: dict[str, Any] = {
        "compliant": False,
        "first_violation": None,
        "source": "replay",
        "series": {"pooled": [], "0": []},
        "sampling": {"vacuous": ["pooled", "0"], "warnings": ["vacuous at this sampling: …"]},
        "rules": {"starvation": {"share": 0.01}},
        "starvation": [starved],
    }
    check = envelope_check(report, None)  # type: ignore[arg-type]
    assert (check["evaluated"], check["status"]) == (True, "FAIL")
    assert "expert 1" in check["reason"] and "starved" in check["reason"]
    report["starvation"] = []
    assert envelope_check(report, None)["status"] is None  # type: ignore[arg-type]


# --- calibrate fits only healthy runs -------------------------------------------------------------


def test_calibrate_refuses_a_run_its_own_certificate_does_not_pass(fresh_runs, env, cache, tmp_path) -> None:
    shift = fresh_runs["domain-shift"]
    sft = _copy(shift, tmp_path / "sft")
    (sft / "events.jsonl").write_text(json.dumps({"stage": "post-training"}) + "\n")
    for run, verdict in ((shift, "INCONCLUSIVE"), (sft, "FAIL")):
        pred = _audit(run, cache)
        assert pred["verdict"] == verdict, (run.name, pred["verdict_reason"])
        assert _check(pred, "health")["status"] == "PASS"  # the health floors alone let it through
        out = tmp_path / f"{run.name}.toml"
        result = _calibrate(env, run, out)
        assert result.exit_code == 4, (run.name, result.output)
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("moeaudit: error:") and "not a healthy run" in last
        assert f"under the built-in policy is {verdict}" in last
        assert not out.exists()
    sft_pred = _audit(sft, cache)
    assert _check(sft_pred, "refinement")["status"] == "FAIL"
    # the domain shift raised the held-out canary NLL by at least a quarter
    nll = [g["receipts"]["nll"] for g in _audit(shift, cache)["gates"]]
    assert nll[-1] > 1.25 * min(nll)


def test_calibrate_accepts_the_confident_router_run_that_now_passes(fresh_runs, env, tmp_path) -> None:
    run = fresh_runs["confident-router"]
    out = tmp_path / "policy.toml"
    result = _calibrate(env, run, out)
    assert result.exit_code == 0, result.output + result.stderr
    assert load_policy(out).gates.calibrated
