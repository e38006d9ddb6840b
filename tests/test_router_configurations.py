"""Verdicts on the router configurations users have, as invariants over runs trained here.

Every run is trained in seconds by tests/edge_runs.py (moeaudit's own decoder, 120 steps, saves
at 40/80/120): top-1 routing, few experts (E = 3 and E = k = 2 at top-2), many experts with
sparse counts (E = 32 top-4, E = 64 top-8), a Qwen2-MoE shared expert, DeepSeek-V3's sigmoid
router with its selection bias; each healthy, and damaged from step 80 on (anti-balance
collapse, the selection bias forced onto k experts, or an expert zeroed). Each is certified end
to end (``moeaudit certify`` in process) on its ordinary canary and on degenerate ones: windows
of 2 tokens, one domain, one repeated token.

The invariants: a healthy run never FAILs (PASS, or INCONCLUSIVE with the reason that holds); a
damaged one never PASSes, and where it is INCONCLUSIVE the reason names the damage or the canary
that cannot see it; the certificate is valid JSON with no NaN/Inf (and matches its schema: the
conftest validates every document written), the HTML page and the receipts are written.
"""

from __future__ import annotations

import base64
import json
import math
import os
from pathlib import Path
from typing import Any

import edge_runs
import numpy as np
import pytest
import schema_check
from click.testing import CliRunner

from moeaudit import canary as canary_mod
from moeaudit.canary_units import canary_units, distinct_contexts, distinct_windows
from moeaudit.cli import cli

HEALTHY = ("top1", "e3k2", "e2k2", "e32k4", "qwen2-shared", "qwen2-top1-shared", "deepseek")
DAMAGED = (
    "top1-collapse",
    "top1-kill",
    "e3k2-collapse",
    "e4k2-kill",
    "e2k2-kill",
    "e32k4-collapse",
    "e64k8-kill",
    "qwen2-shared-collapse",
    "deepseek-force",
    "deepseek-kill",
)
pytestmark = pytest.mark.slow  # 17 runs trained (seconds each, cached in $MOEAUDIT_FRESH_RUNS), 58 certificates

# what a reason names when it names the damage: an occupancy quantity, a floor, a starved expert
DAMAGE_WORDS = ("π_min", "entropy ratio", "H_norm", "dead", "starved", "more dead")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get(edge_runs.ENV)
    path = Path(cache) if cache else tmp_path_factory.mktemp("edge-runs")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def canaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("edge-canaries")
    paths = {}
    for kind in edge_runs.CANARIES:
        paths[kind] = out / f"{kind}.safetensors"
        canary_mod.save(edge_runs.canary(kind), paths[kind])
    return paths


@pytest.fixture(scope="module")
def certify(root: Path, canaries: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    env = {
        "MOEAUDIT_CACHE_DIR": str(tmp_path_factory.mktemp("edge-cache")),
        "XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("edge-config")),
    }
    outs = tmp_path_factory.mktemp("edge-certs")
    done: dict[tuple[str, str], dict[str, Any]] = {}

    def run(name: str, kind: str = "ordinary") -> dict[str, Any]:
        """``moeaudit certify`` of run ``name`` on canary ``kind``: the signed predicate, with
        the receipts it wrote under ``_receipts``; every output file checked on the way."""
        if (name, kind) not in done:
            out, validated = outs / f"{name}-{kind}", schema_check.SEEN[schema_check.PREDICATE]
            result = CliRunner(env=env).invoke(
                cli, ["certify", str(edge_runs.cached(name, root)), "--canary", str(canaries[kind]), "--out", str(out)]
            )
            assert result.exit_code == 0, (name, kind, result.output, result.exception)
            assert schema_check.SEEN[schema_check.PREDICATE] > validated  # the certificate matched its schema
            done[(name, kind)] = _outputs(out)
        return done[(name, kind)]

    return run


def _no_constant(token: str) -> Any:
    raise AssertionError(f"non-finite number {token} in a written document")


def _outputs(out: Path) -> dict[str, Any]:
    """The certificate (strict JSON: a NaN or Infinity fails), its page and its receipts."""
    envelope = json.loads((out / "certificate.json").read_text(encoding="utf-8"), parse_constant=_no_constant)
    statement = json.loads(base64.b64decode(envelope["payload"]), parse_constant=_no_constant)
    html = (out / "certificate.html").read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and statement["predicate"]["verdict"] in html
    receipts = {
        p.stem: json.loads(p.read_text(encoding="utf-8"), parse_constant=_no_constant)
        for p in sorted((out / "receipts").glob("checkpoint-*.json"))
    }
    assert sorted(receipts) == ["checkpoint-120", "checkpoint-40", "checkpoint-80"]
    return {**statement["predicate"], "_receipts": receipts}


def _check(pred: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in pred["checks"] if c["name"] == name), None)


def _layers(pred: dict[str, Any]) -> list[dict[str, Any]]:
    return [layer for doc in pred["_receipts"].values() for layer in doc["layers"]]


def _names_damage(pred: dict[str, Any]) -> bool:
    """The verdict's reason, or the reason of a check it names, says what narrowed or died, or
    that the canary cannot resolve it."""
    texts = [pred["verdictReason"]] + [c["reason"] for c in pred["checks"] if c["status"] != "PASS"]
    return any(w in t for t in texts for w in DAMAGE_WORDS)


# --- every configuration, every canary ---------------------------------------------------------


@pytest.mark.parametrize("kind", edge_runs.CANARIES)
@pytest.mark.parametrize("name", HEALTHY)
def test_a_healthy_run_never_fails(certify: Any, name: str, kind: str) -> None:
    """PASS, or INCONCLUSIVE for a reason that holds: a canary too small for E (the floors'
    resolution), too few distinct windows, one repeated token. The one documented FAIL: a
    one-domain canary on which a domain-specialised DeepSeek expert sits below the π_min floor
    (docs/decisions.md, "A canary of one domain")."""
    pred = certify(name, kind)
    if (name, kind) == ("deepseek", "one-domain"):
        assert pred["verdict"] == "FAIL" and pred["verdictReason"] == "health failed"
        assert _check(pred, "health")["reason"].endswith(
            "checkpoint-40: layer 1: π_min is 0.042 of the uniform share k/E (floor 0.1)"
        )
        return
    assert pred["verdict"] in ("PASS", "INCONCLUSIVE"), (name, kind, pred["verdictReason"])
    assert all(g["status"] in ("BASELINE", "GREEN") for g in pred["gates"]), (name, kind, pred["verdictReason"])
    if pred["verdict"] == "INCONCLUSIVE":
        open_checks = {c["name"] for c in pred["checks"] if c["evaluated"] and c["status"] != "PASS"}
        assert open_checks and open_checks <= {"health", "canary"}, (name, kind, pred["verdictReason"])
        health = _check(pred, "health")
        assert health["status"] == "PASS" or health["basis"] == "canary-resolution"
    for layer in _layers(pred):  # a one-expert load is +0.0 nats, never -0.0
        assert math.copysign(1.0, layer["occupancy"]["entropy"]) > 0
        assert math.copysign(1.0, layer["occupancy"]["active_sets"]["entropy"]) > 0
    assert "-0.000" not in json.dumps(pred["checks"], ensure_ascii=False)


@pytest.mark.parametrize("kind", ("ordinary", "short", "one-token"))
@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_run_never_passes(certify: Any, name: str, kind: str) -> None:
    """Collapsed, forced or with an expert zeroed: FAIL, or INCONCLUSIVE with a reason that names
    the damage (or the canary's resolution of it); never PASS. On the ordinary canary every
    damage is seen: FAIL, except an E = 3 top-2 collapse of 40 steps (π_min ratio 0.19, YELLOW;
    its entropy floor cannot fire, ln 2 / ln 3 = 0.63 > 0.6), INCONCLUSIVE naming both ratios.
    A zeroed expert is exact evidence at any canary size (no gradient where tokens are routed)."""
    pred = certify(name, kind)
    assert pred["verdict"] != "PASS", (name, kind)
    if pred["verdict"] == "INCONCLUSIVE":
        assert _names_damage(pred), (name, kind, pred["verdictReason"])
    if kind == "ordinary":
        want = "INCONCLUSIVE" if name == "e3k2-collapse" else "FAIL"
        assert pred["verdict"] == want, (name, pred["verdictReason"])
    if name.endswith("-kill") and kind != "one-token":  # one state routes to other experts
        assert pred["verdict"] == "FAIL" and "starved: expert(s) 1" in _check(pred, "health")["reason"]


def test_a_partial_collapse_is_named_in_the_verdict(certify: Any) -> None:
    """The verdict's reason for a YELLOW or RED gate says what made it bad, not only the step."""
    pred = certify("e3k2-collapse")
    assert pred["verdictReason"].startswith("YELLOW at step(s) 120 (120: π_min ratio 0.19 (L0,1); entropy ratio 0.")
    red = certify("e32k4-collapse")
    assert red["verdictReason"].startswith("RED at step(s) 120 (120: π_min ratio 0.00 (L1)")


# --- what each configuration's receipts say ------------------------------------------------------


def test_top1_has_no_pairs_and_no_gate_judges_them(certify: Any) -> None:
    """k = 1: C2 is null with the reason on every layer of every checkpoint; every gate's C2
    condition is "not applicable" (occupancy alone decides) and no claim says C2 held."""
    for name in ("top1", "top1-collapse", "qwen2-top1-shared"):
        pred = certify(name)
        for layer in _layers(pred):
            assert layer["overlap"]["c2"] is None and layer["overlap"]["reason"] == "no co-active pairs (top-1 routing)"
            assert layer["overlap"]["c2_smooth"] is not None  # K' = 2 candidates still
            assert layer["boundary"]["margin_mean"] is not None  # s_(1) − s_(2)
        for g in pred["gates"][1:]:
            assert g["structural"]["c2Status"] == "not applicable"
            assert not any("C2) held" in s for s in g["claims"]["licensed"])
    assert certify("top1")["verdict"] == "PASS"


def test_few_experts_saturate_the_candidates(certify: Any) -> None:
    """K' = min(E, 2k) = E: the candidates are every expert, so no gate probability is left out
    — exactly 0, never the −2e-9 of 1 − Σρ in float; E = k + 1: the one expert outside R_k is the
    adjacent competitor, so adjacency specificity is 0 by definition; E = k: no expert beyond
    R_k, so transition and adjacency are null with the reason, and there is no boundary."""
    for layer in _layers(certify("e3k2")):
        o = layer["overlap"]
        assert o["c2_smooth_candidates"] == 3 and o["c2_smooth_truncation_mass"] == 0.0
        assert o["adjacency_specificity"] == 0.0 and o["c2"] is not None
    for layer in _layers(certify("e2k2")):
        o = layer["overlap"]
        assert o["c2_smooth_truncation_mass"] == 0.0 and o["transition_incompatibility"] is None
        assert o["adjacency_specificity"] is None and "E = k" in o["reason"]
        assert layer["boundary"]["margin_mean"] is None and layer["occupancy"]["entropy_norm"] == 1.0
    for layer in _layers(certify("top1")):  # K' = 2 < E = 4: a mass is left out, and it is ≥ 0
        assert 0.0 < layer["overlap"]["c2_smooth_truncation_mass"] < 1.0


def test_many_experts_on_a_small_canary(certify: Any) -> None:
    """E = 32 top-4 and E = 64 top-8 on 12 × 16 tokens: the early checkpoint's empty experts are
    below what the canary resolves (an expert at the floor misses all 190 contexts 9 % of the
    time), so health is INCONCLUSIVE with the resolution named, never FAIL; the collapse and the
    zeroed expert FAIL on what the canary does resolve (the entropy floor, no gradient)."""
    for name in ("e32k4",):
        health = _check(certify(name), "health")
        assert health["status"] == "INCONCLUSIVE" and health["basis"] == "canary-resolution"
        assert "distinct token contexts" in health["reason"] and "resolves the floors" in health["reason"]
    assert "H_norm 0.468 (floor 0.6)" in _check(certify("e32k4-collapse"), "health")["reason"]
    assert _check(certify("e64k8-kill"), "health")["status"] == "FAIL"


def test_shared_and_sigmoid_routers(certify: Any) -> None:
    """The shared expert's gradient is reported beside the routed ones; DeepSeek-V3's selection
    bias forced onto experts 0 and 1 leaves the other six dead on every layer."""
    for layer in _layers(certify("qwen2-shared")) + _layers(certify("qwen2-top1-shared")):
        assert layer["gradients"]["shared_grad_norm"] > 0
    forced = certify("deepseek-force")["_receipts"]["checkpoint-120"]["layers"]
    assert all(layer["occupancy"]["counts"][2:] == [0] * 6 for layer in forced)


# --- degenerate canaries --------------------------------------------------------------------------


def test_a_canary_of_one_repeated_token_is_one_context(certify: Any) -> None:
    """12 windows of one token: every position reaches the router as the same state (attention over
    identical values), so the canary is one window and one context. The floors are unresolved and
    the canary check INCONCLUSIVE, where before a healthy top-1 run FAILed on "3 dead experts";
    an expert zeroed is still seen (routed tokens, no gradient)."""
    pred = certify("top1", "one-token")
    for doc in pred["_receipts"].values():
        assert doc["canary"]["distinct_windows"] == 1 and doc["canary"]["distinct_contexts"] == 1
    assert pred["verdict"] == "INCONCLUSIVE"
    assert _check(pred, "canary")["reason"].startswith("the canary has 1 window(s) of distinct content")
    assert _check(pred, "health")["basis"] == "canary-resolution"
    assert certify("e4k2-kill", "one-token")["verdict"] == "FAIL"


def test_short_and_one_domain_canaries(certify: Any) -> None:
    """Windows of 2 tokens and a one-domain canary are certified like any other: no routing JS
    divergence between domains where there is one domain, an NLL by its one domain."""
    one = certify("qwen2-shared", "one-domain")
    for doc in one["_receipts"].values():
        assert list(doc["nll_by_domain"]) == ["code"]
        assert all("js_divergence" not in layer["occupancy"] for layer in doc["layers"])
    short = certify("qwen2-shared", "short")
    assert all(doc["canary"]["window_len"] == 2 for doc in short["_receipts"].values())


def test_canary_units_count_repeats_only() -> None:
    """A repeated window or context counts once; a repeated-id prefix is one context whatever its
    length, but what follows it is not (``a a b`` ≠ ``a b``); a canary of distinct content
    records nothing."""
    c = canary_mod.Canary(
        np.array([[5, 5, 6], [5, 6, 7], [5, 5, 6], [9, 9, 9]], dtype=np.int32), np.zeros(4, np.int32), ("d",)
    )
    assert distinct_windows(c) == 3
    # [5], [5 5] → one; [5 5 6]; [5 6]; [5 6 7]; [9], [9 9], [9 9 9] → one
    assert distinct_contexts(c) == 5
    assert canary_units(c) == {"distinct_windows": 3, "distinct_contexts": 5}
    plain = canary_mod.Canary(np.array([[1, 2], [3, 4]], dtype=np.int32), np.zeros(2, np.int32), ("d",))
    assert canary_units(plain) == {}


def test_the_gate_reads_a_repeated_canary_as_inconclusive(
    root: Path, canaries: dict[str, Path], tmp_path: Path
) -> None:
    """`moeaudit gate` first → last of the healthy top-1 run on the one-token canary: one distinct
    window, unresolved floors, so neither PROMOTE nor HOLD (exit 3); on its ordinary canary it
    promotes. The gate documents it wrote were validated against their schema."""
    run = edge_runs.cached("top1", root)
    env = {"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    for kind, code, decision in (("one-token", 3, "INCONCLUSIVE"), ("ordinary", 0, "PROMOTE")):
        out = tmp_path / f"gate-{kind}.json"
        result = CliRunner(env=env).invoke(
            cli,
            ["gate", str(run / "checkpoint-40"), str(run / "checkpoint-120"), "--canary", str(canaries[kind])]
            + ["--json", str(out)],
        )
        assert result.exit_code == code, (kind, result.output)
        assert json.loads(out.read_text())["decision"] == decision
    assert schema_check.SEEN[schema_check.GATE] >= 2


def test_a_zero_gradient_is_evidence_where_a_loss_bearing_token_was_routed() -> None:
    """With ``loss_bearing_counts`` the receipts say which experts were routed a token the loss
    reads: such an expert without a gradient is silent however few its tokens; one routed only
    windows' last tokens is not. Without the field, the windows bound holds as before."""
    from moeaudit.judge.health import silent_experts

    occupancy = {"counts": [30, 6, 5, 7], "loss_bearing_counts": [25, 3, 0, 7]}
    entry: Any = {"occupancy": occupancy, "gradients": {"grad_norms": [1.0, 0.0, 0.0, 1.0]}}
    assert silent_experts(entry, windows=12) == [1]
    del occupancy["loss_bearing_counts"]
    assert silent_experts(entry, windows=12) == []


def test_a_canary_that_does_not_resolve_the_floors_clears_none() -> None:
    """Every reading above the floors on a canary too small to resolve them: unresolved (the
    health check INCONCLUSIVE), not clear; the same readings on a canary that resolves them: ok."""
    from moeaudit.judge.health import NOT_RESOLVED, health
    from moeaudit.policy import GateSettings

    def doc(tokens: int) -> Any:
        counts = [tokens // 2, tokens // 4, tokens // 8, tokens // 8]
        occ = {"counts": counts, "pi_min": min(counts) / tokens, "entropy_norm": 0.95}
        return {
            "checkpoint": {"experts": 4, "top_k": 1},
            "canary": {"windows": 12, "window_len": tokens // 12},
            "layers": [{"layer": 0, "occupancy": occ}],
        }

    small, large = health(doc(24), GateSettings()), health(doc(240), GateSettings())
    assert small["ok"] and small["unresolved"] == [NOT_RESOLVED] and "resolves the floors" in small["resolution"]
    assert large["ok"] and "unresolved" not in large
