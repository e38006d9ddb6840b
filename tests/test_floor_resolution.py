"""A canary too small for its experts: a zero count, a π_min or a load entropy below its floor that
the canary cannot resolve is INCONCLUSIVE, never FAIL; a zero gradient is evidence only for an
expert routed loss-bearing tokens; and on a canary of too few windows a RED gate or a margin's
FAIL is no evidence (moeaudit/judge/health.py, moeaudit/judge/decide.py; docs/decisions.md, "A
canary too small for its experts", "A canary too small for its intervals").

The rules are checked as invariants over runs trained in this session by tests/fresh_runs.py
(a healthy run, a collapsing one, one with an expert zeroed), each certified on its own canary,
on the same canary cut to 8 windows of 6 tokens and to 1 window of 3: whatever each checkpoint's
receipts read, the health floors must count exactly what the canary resolves."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fresh_runs import RECIPES

from moeaudit import canary as canary_mod
from moeaudit.cache import ReceiptsCache
from moeaudit.certify import audit_run
from moeaudit.judge.health import (
    FLOOR_MISS_CHANCE,
    NOT_RESOLVED,
    entropy_resolution,
    floor_resolution,
    silent_experts,
)
from moeaudit.policy import GateSettings, Policy

FLOOR = GateSettings().floor_pi_share


def _doc(experts: int, top_k: int, tokens: int) -> Any:
    """The least of a receipts document the resolution reads: E, k and one layer's counts."""
    counts = [tokens * top_k // experts] * experts
    counts[0] += tokens * top_k - sum(counts)
    return {"checkpoint": {"experts": experts, "top_k": top_k}, "layers": [{"occupancy": {"counts": counts}}]}


def test_the_resolution_is_the_chance_an_expert_at_the_floor_misses_every_token() -> None:
    """(1 − s)^N with s = floor·k/E, and the fewest tokens that bring it to 5 %: a 128-expert
    top-1 layer on 8 × 256 tokens misses 20 % of the time and needs 3834 tokens; the default
    canary (64 × 256) resolves every E/k up to 546."""
    res = floor_resolution(_doc(128, 1, 2048), GateSettings())
    assert res is not None and not res.resolved
    assert res.share == pytest.approx(FLOOR / 128, rel=1e-15)
    assert res.chance == pytest.approx((1 - FLOOR / 128) ** 2048, rel=1e-12)
    assert res.chance == pytest.approx(0.2018, abs=1e-4)
    assert res.needed == 3834 and "at least 3834 tokens" in res.sentence()
    assert (1 - res.share) ** res.needed <= FLOOR_MISS_CHANCE < (1 - res.share) ** (res.needed - 1)
    default = 64 * 256
    assert floor_resolution(_doc(546, 1, default), GateSettings()).resolved
    assert not floor_resolution(_doc(547, 1, default), GateSettings()).resolved
    assert floor_resolution(_doc(256, 8, 2048), GateSettings()).resolved  # DeepSeek-V3 on 8 × 256
    # no floor on π_min: resolved against the uniform share k/E instead
    assert floor_resolution(_doc(128, 1, 2048), GateSettings(floor_pi_share=0.0)).share == 1 / 128
    assert floor_resolution(_doc(4, 4, 16), GateSettings()).chance == 0.0  # E = k: every expert, every token


def test_the_chance_matches_top_k_routing_simulated() -> None:
    """Top-k routing of independent tokens, one expert's logit lowered until its share is near the
    floor: the fraction of simulated canaries in which it receives no token is (1 − π)^N within
    the simulation's 4σ."""
    rng = np.random.default_rng(7)
    experts, top_k, tokens, canaries = 16, 2, 96, 4000
    bias = np.zeros(experts)
    bias[0] = -3.2
    logits = rng.gumbel(size=(canaries, tokens, experts)) + bias
    chosen = np.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]
    hit = (chosen == 0).any(axis=-1)  # [canaries, tokens]: expert 0 in R_k
    share = hit.mean()
    missed = (~hit.any(axis=1)).mean()
    expected = (1 - share) ** tokens
    assert 0.3 < share * experts / top_k / FLOOR < 3  # near the floor, the case the rule is about
    assert abs(missed - expected) < 4 * math.sqrt(expected * (1 - expected) / canaries)


def _balanced_entropy(rng: Any, experts: int, top_k: int, tokens: int, canaries: int) -> Any:
    """H_norm of the loads of ``canaries`` simulated canaries of a balanced top-k router."""
    chosen = np.argpartition(-rng.gumbel(size=(canaries, tokens, experts)), top_k - 1, axis=-1)[..., :top_k]
    counts = np.stack([(chosen == e).sum(axis=(1, 2)) for e in range(experts)], axis=1)
    p = counts / counts.sum(axis=1, keepdims=True)
    return -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0.0)).sum(axis=1) / math.log(experts)


def test_the_entropy_resolution_is_miller_madows_bias_against_half_the_headroom() -> None:
    """A balanced router's load entropy on n = N·k slots reads about (E − 1)/(2n ln E) below 1
    (and at most ln n / ln E when n < E): simulated top-k routing agrees within 15 %; the floor is
    resolved where that deficit is at most half its headroom — 17 tokens for 8 experts top-2 at a
    floor of 0.9, where a balanced router still reads below the floor under 10 % of the time."""
    g = GateSettings(floor_entropy_norm=0.9)
    res = entropy_resolution(_doc(8, 2, 3), g)
    assert res is not None and not res.resolved
    assert res.deficit == pytest.approx(7 / (2 * 6 * math.log(8)), rel=1e-15) and res.needed == 17
    assert "at least 17 tokens" in res.sentence()
    assert entropy_resolution(_doc(8, 2, 17), g).resolved and not entropy_resolution(_doc(8, 2, 16), g).resolved
    tiny = entropy_resolution(_doc(64, 1, 5), g)  # n < E: the most 5 slots can read is ln 5 / ln 64
    assert tiny.deficit == pytest.approx(max(63 / (10 * math.log(64)), 1 - math.log(5) / math.log(64)))
    assert entropy_resolution(_doc(4, 4, 2), g).deficit == 0.0  # E = k: exactly uniform
    assert entropy_resolution(_doc(256, 8, 64 * 256), GateSettings()).resolved  # DeepSeek-V3, default canary
    rng = np.random.default_rng(11)
    for experts, top_k, tokens in ((8, 2, 17), (8, 2, 50), (16, 2, 40), (64, 8, 60), (128, 1, 1000)):
        h = _balanced_entropy(rng, experts, top_k, tokens, 2000)
        r = entropy_resolution(_doc(experts, top_k, tokens), g)
        assert 1 - h.mean() == pytest.approx(r.deficit, rel=0.15), (experts, top_k, tokens)
    at_needed = _balanced_entropy(rng, 8, 2, 17, 4000)
    assert (at_needed < 0.9).mean() < 0.10
    assert (_balanced_entropy(rng, 8, 2, 3, 500) < 0.9).all()  # 3 tokens: a balanced router always "fails"


def test_a_zero_gradient_is_evidence_only_beyond_the_windows_last_tokens() -> None:
    """The last token of each window predicts nothing, so what it routes to gets no gradient: an
    expert with no gradient is silent only when routed more tokens than the canary has windows."""
    entry: Any = {"occupancy": {"counts": [10, 4, 5]}, "gradients": {"grad_norms": [1.0, 0.0, 0.0]}}
    assert silent_experts(entry) == [1, 2]  # no windows given: as before
    assert silent_experts(entry, windows=4) == [2]  # expert 1's 4 tokens may all be last tokens
    assert silent_experts(entry, windows=5) == []


def test_on_too_few_windows_a_red_gate_or_a_margins_fail_is_no_evidence() -> None:
    """A canary of 7 windows: RED gates and a refinement FAIL read INCONCLUSIVE (gate: not HOLD);
    a health floor's FAIL (read on tokens) and non-finite weights still FAIL; 8 windows: as ever."""
    from moeaudit.judge.decide import Evidence, decide

    def gate(step: int, status: str, ok: bool = True) -> Any:
        return {
            "step": step,
            "status": status,
            "health": {"ok": ok, "problems": [] if ok else ["layer 0: x"]},
            "receipts": {"checkpoint": f"c{step}"},
            "structural": {},
        }

    refinement: Any = {"exact": -0.5, "ci95": [-0.7, -0.3], "tau": 1.0}
    for windows, red_fails in ((7, False), (8, True)):
        ev = Evidence(
            "post-training",
            [gate(0, "BASELINE"), gate(1, "RED")],
            {"refinement": refinement},
            None,
            "no series",
            canary_windows=windows,
        )
        d = decide(ev)
        checks = {c["name"]: c for c in d["checks"]}
        if red_fails:
            assert d["verdict"] == "FAIL" and d["promotion"] == "HOLD" and "canary" not in checks
            assert checks["refinement"]["status"] == "FAIL"
        else:
            assert d["verdict"] == "INCONCLUSIVE" and d["promotion"] == "INCONCLUSIVE", d["verdict_reason"]
            assert "on intervals over too few canary windows" in d["verdict_reason"]
            assert (
                checks["refinement"]["status"] == "INCONCLUSIVE"
                and "7 canary window(s)" in checks["refinement"]["reason"]
            )
    ev = Evidence(
        "pretraining", [gate(0, "BASELINE", ok=False), gate(1, "GREEN")], {}, None, "no series", canary_windows=7
    )
    assert decide(ev)["verdict"] == "FAIL"  # a health floor read on tokens stands
    ev = Evidence(
        "pretraining",
        [gate(0, "BASELINE"), gate(1, "GREEN")],
        {},
        None,
        "no series",
        nonfinite=("c1: weight",),
        canary_windows=7,
    )
    assert decide(ev)["verdict"] == "FAIL"


# --- invariants over fresh runs ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resolution-cache")


def _tiny(run: Path, dst: Path, windows: int = 8, length: int = 6) -> Path:
    """A copy of ``run`` whose canary is the first ``windows`` windows, ``length`` tokens each."""
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("canary_probe.jsonl"))
    full = canary_mod.load(run / "canary.safetensors")
    cut = canary_mod.Canary(full.tokens_array[:windows, :length], full.domain_ids_array[:windows], full.domains)
    (dst / "canary.safetensors").unlink()
    canary_mod.save(cut, dst / "canary.safetensors")
    return dst


def _audit(run: Path, cache: Path) -> dict[str, Any]:
    probe = canary_mod.load(run / "canary.safetensors")
    return audit_run(run, probe, Policy(), cache=ReceiptsCache(cache)).statement["predicate"]


def _expected_readings(
    gate: dict[str, Any], E: int, k: int, resolved: bool, entropy_resolved: bool
) -> tuple[set[int], set[int], set[int]]:
    """(layers that must fail a dead/π_min floor, that must fail the H_norm floor, that must be
    unresolved) at one gate, from its receipts alone."""
    dead_max = int(GateSettings().floor_dead_fraction * E)
    fail, fail_h, open_ = set(), set(), set()
    for row in gate["receipts"]["per_layer"]:
        silent = len(row.get("no_gradient") or [])
        zero = row["dead"] - silent
        below_pi = row["pi_min"] * E / k < FLOOR
        if silent > dead_max or (resolved and (row["dead"] > dead_max or below_pi)):
            fail.add(row["layer"])
        if not resolved and ((zero and silent <= dead_max and row["dead"] > dead_max) or below_pi):
            open_.add(row["layer"])
        if row["entropy_norm"] < GateSettings().floor_entropy_norm:
            (fail_h if entropy_resolved else open_).add(row["layer"])
    return fail, fail_h, open_


def _pi_or_dead(sentence: str) -> bool:
    return sentence != NOT_RESOLVED and "H_norm" not in sentence


def _layer(sentence: str) -> int:
    return int(sentence.split(":")[0].removeprefix("layer "))


@pytest.mark.fresh_runs
@pytest.mark.parametrize("name", ["healthy-loop", "collapse-loop", "killed-expert"])
def test_floors_count_exactly_what_the_canary_resolves(fresh_runs, cache, tmp_path, name) -> None:
    run = fresh_runs[name]
    E, k = RECIPES[name].experts, RECIPES[name].top_k
    full = canary_mod.load(run / "canary.safetensors").tokens_array.shape
    for windows, length in ((full[0], full[1]), (8, 6), (1, 3)):
        cut = (windows, length) != full
        canary_run = _tiny(run, tmp_path / f"cut-{windows}x{length}", windows, length) if cut else run
        tokens = _doc(E, k, windows * length)
        resolved = floor_resolution(tokens, GateSettings()).resolved
        entropy_resolved = entropy_resolution(tokens, GateSettings()).resolved
        assert resolved == (not cut) and (entropy_resolved or length == 3), (windows, length)
        if (E, k) == (8, 2):  # 3 tokens cannot show a balanced router above the entropy floor
            assert entropy_resolved == (length > 3)
        pred = _audit(canary_run, cache)
        any_failed = any_open = False
        for g in pred["gates"]:
            fail, fail_h, open_ = _expected_readings(g, E, k, resolved, entropy_resolved)
            floor_failures = {f["layer"] for f in g["health"]["failed"] if f["what"] != "H_norm"}
            assert floor_failures == fail, (name, windows, g["step"], g["health"])
            assert {f["layer"] for f in g["health"]["failed"] if f["what"] == "H_norm"} == fail_h, (name, windows)
            unresolved = g["health"].get("unresolved", [])
            assert {_layer(s) for s in unresolved if s != NOT_RESOLVED} == open_, (name, windows, g["step"])
            # a canary that does not resolve the floors clears no reading of them either
            assert (NOT_RESOLVED in unresolved) == (not resolved and not any(_pi_or_dead(s) for s in unresolved))
            assert ("resolution" in g["health"]) == bool(open_ or not resolved)
            if cut:  # a layer counts more dead than its baseline only on exact evidence
                silent = {row["layer"] for row in g["receipts"]["per_layer"] if row.get("no_gradient")}
                more = (g.get("structural") or g.get("continuity") or {}).get("layers_with_more_dead") or []
                assert set(more) <= silent, (name, g["step"], more)
            any_failed |= bool(g["health"]["failed"])
            any_open |= bool(open_) or not resolved
        health = next(c for c in pred["checks"] if c["name"] == "health")
        expected = "FAIL" if any_failed else "INCONCLUSIVE" if any_open else "PASS"
        assert health["status"] == expected, (name, windows, health["reason"])
        if expected == "INCONCLUSIVE":
            assert health["basis"] == "canary-resolution" and "tokens resolves" in health["reason"]
            assert pred["verdict"] != "PASS"
        if windows < 8:  # a RED or a margin's FAIL on one window's intervals is no evidence
            assert "RED at" not in pred["verdict_reason"] or "too few canary windows" in pred["verdict_reason"]
            assert all(c["status"] != "FAIL" for c in pred["checks"] if c["name"] in ("refinement", "handoff"))
        if name == "healthy-loop" and windows == 1:  # its REDs on one window's intervals: not a FAIL
            assert pred["verdict"] == "INCONCLUSIVE" and "too few canary windows" in pred["verdict_reason"]
        if name == "collapse-loop" and windows == 8:
            assert any_open  # π_min ≈ 0.001 of the tokens: 48 tokens see none of that expert
        if name == "killed-expert" and not cut:  # the zeroed expert is exact evidence
            assert health["status"] == "FAIL" and all(
                not g["health"]["ok"] for g in pred["gates"] if g["step"] >= 240
            ), health["reason"]


def test_gates_promotion_on_too_few_windows_is_inconclusive_not_hold() -> None:
    """`gate`'s own reading (judge.promote): a RED or YELLOW candidate holds, except on a canary
    of too few windows, where only a FAIL holds and the candidate's condition is inconclusive
    unless a health floor (read on tokens) failed there."""
    from moeaudit.judge.decide import canary_check
    from moeaudit.judge.promote import candidate_condition, decision

    few = [canary_check(7)]
    for colour in ("RED", "YELLOW"):
        gates: Any = [{"status": "BASELINE"}, {"status": colour}]
        assert decision("INCONCLUSIVE", gates) == "HOLD"
        assert decision("INCONCLUSIVE", gates, few) == "INCONCLUSIVE"
        assert decision("FAIL", gates, few) == "HOLD"
    gate: Any = {"status": "RED", "step": 5, "health": {"ok": True, "problems": [], "failed": []}}
    assert candidate_condition(gate, GateSettings())["status"] == "fail"
    assert candidate_condition(gate, GateSettings(), few=True)["status"] == "inconclusive"
    floor = {"layer": 0, "what": "H_norm", "value": 0.1, "threshold": 0.6}
    gate["health"] = {"ok": False, "problems": ["layer 0: H_norm 0.100 (floor 0.6)"], "failed": [floor]}
    assert candidate_condition(gate, GateSettings(), few=True)["status"] == "fail"


@pytest.mark.fresh_runs
def test_gate_on_a_one_window_canary_exits_3_not_hold(fresh_runs, tmp_path) -> None:
    """The CLI on a fresh healthy run whose canary is cut to 1 window of 3 tokens: its candidate
    is RED on that window's intervals, which is no evidence, so `gate` exits 3 (it held, exit 1)."""
    import json

    from click.testing import CliRunner

    from moeaudit.cli import cli

    run = _tiny(fresh_runs["healthy-loop"], tmp_path / "cut", 1, 3)
    steps = sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))
    out = tmp_path / "gate.json"
    env = {"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    result = CliRunner(env=env).invoke(
        cli,
        ["gate", str(run / f"checkpoint-{steps[-2]}"), str(run / f"checkpoint-{steps[-1]}")]
        + ["--canary", str(run / "canary.safetensors"), "--json", str(out)],
    )
    assert result.exit_code == 3, result.output + result.stderr
    doc = json.loads(out.read_text())
    cand = doc["conditions"][0]
    assert doc["decision"] == "INCONCLUSIVE" and cand["name"] == "candidate gate"
    assert cand["detail"].startswith("RED") and cand["status"] == "inconclusive"
