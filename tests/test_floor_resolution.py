"""A canary too small for its experts: a zero count or a π_min below its floor that the canary
cannot resolve is INCONCLUSIVE, never FAIL (moeaudit/judge/health.py; docs/decisions.md, "A
canary too small for its experts").

The rule is checked as invariants over runs trained in this session by tests/fresh_runs.py
(a healthy run, a collapsing one, one with an expert zeroed), each certified on its own canary
and on the same canary cut to 8 windows of 6 tokens: whatever each checkpoint's receipts read,
the health floors must count exactly what the canary resolves."""

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
from moeaudit.judge.health import FLOOR_MISS_CHANCE, floor_resolution
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


def _expected_readings(gate: dict[str, Any], E: int, k: int, resolved: bool) -> tuple[set[int], set[int]]:
    """(layers that must fail a dead/π_min floor, layers that must be unresolved) at one gate,
    from its receipts alone."""
    dead_max = int(GateSettings().floor_dead_fraction * E)
    fail, open_ = set(), set()
    for row in gate["receipts"]["per_layer"]:
        silent = len(row.get("no_gradient") or [])
        zero = row["dead"] - silent
        below_pi = row["pi_min"] * E / k < FLOOR
        if silent > dead_max or (resolved and (row["dead"] > dead_max or below_pi)):
            fail.add(row["layer"])
        if not resolved and ((zero and silent <= dead_max and row["dead"] > dead_max) or below_pi):
            open_.add(row["layer"])
    return fail, open_


def _layer(sentence: str) -> int:
    return int(sentence.split(":")[0].removeprefix("layer "))


@pytest.mark.fresh_runs
@pytest.mark.parametrize("name", ["healthy-loop", "collapse-loop", "killed-expert"])
def test_floors_count_exactly_what_the_canary_resolves(fresh_runs, cache, tmp_path, name) -> None:
    run = fresh_runs[name]
    for canary_run, resolved in ((run, True), (_tiny(run, tmp_path / "tiny"), False)):
        pred = _audit(canary_run, cache)
        E, k = RECIPES[name].experts, RECIPES[name].top_k
        any_failed = any_open = False
        for g in pred["gates"]:
            fail, open_ = _expected_readings(g, E, k, resolved)
            floor_failures = {f["layer"] for f in g["health"]["failed"] if f["what"] != "H_norm"}
            assert floor_failures == fail, (name, resolved, g["step"], g["health"])
            assert {_layer(s) for s in g["health"].get("unresolved", [])} == open_, (name, resolved, g["step"])
            assert ("resolution" in g["health"]) == bool(open_)
            if not resolved:  # a layer counts more dead than its baseline only on exact evidence
                silent = {row["layer"] for row in g["receipts"]["per_layer"] if row.get("no_gradient")}
                more = (g.get("structural") or g.get("continuity") or {}).get("layers_with_more_dead") or []
                assert set(more) <= silent, (name, g["step"], more)
            any_failed |= bool(g["health"]["failed"])
            any_open |= bool(open_)
        health = next(c for c in pred["checks"] if c["name"] == "health")
        expected = "FAIL" if any_failed else "INCONCLUSIVE" if any_open else "PASS"
        assert health["status"] == expected, (name, resolved, health["reason"])
        if expected == "INCONCLUSIVE":
            assert health["basis"] == "canary-resolution" and "tokens resolves the floors" in health["reason"]
            assert pred["verdict"] != "PASS"
        if name == "collapse-loop" and not resolved:
            assert any_open  # π_min ≈ 0.001 of the tokens: 48 tokens see none of that expert
        if name == "killed-expert":  # the zeroed expert is exact evidence at any canary size
            assert health["status"] == "FAIL" and all(
                not g["health"]["ok"] for g in pred["gates"] if g["step"] >= 240
            ), health["reason"]
