"""Healthy from-scratch runs of one's own PASS under the defaults, whatever the seed.

Sixteen tiny runs trained here (8 seeds × mixtral and qwen2_moe, 8 experts, top-2, a plain
torch loop with moeaudit's recorder), each saved early — the first checkpoint at step 20, when
the router and the experts are still near their random initialisation — and then every 20
steps to 160. Against such a first checkpoint the π_min ratio of a healthy run dips below 0.5
within the canary's noise, and C2 falls as the experts specialise away from their random start
while the canary NLL falls 4.2 → 1.4 nats. Before the rules of docs/policy.md ("occupancy
held", "atlas motion") 13 of these 16 runs were YELLOW or RED somewhere (4 FAIL, RED from C2
alone); now all PASS. The same schedule with an anti-balancing loss still FAILs (a control: the
rules did not go blind). Training and certifying all 18 runs takes about 50 s of CPU on one
thread (2 min wall on a loaded 2-core machine): marked slow.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
import fresh_runs as fresh  # noqa: E402

from moeaudit.cache import ReceiptsCache  # noqa: E402
from moeaudit.canary import load  # noqa: E402
from moeaudit.certify import audit_run  # noqa: E402
from moeaudit.policy import Policy  # noqa: E402

pytestmark = pytest.mark.slow

EARLY = fresh.Recipe("healthy", loop="torch", experts=8, steps=160, save_every=20, aux_coef=0.02)
SEEDS = range(8)
FAMILIES = ("mixtral", "qwen2_moe")


def _train(root: Path, name: str, recipe: fresh.Recipe) -> Path:
    return fresh.train(recipe, root / name)


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """name → the predicate certify signs for it, under the built-in defaults."""
    root = tmp_path_factory.mktemp("early-seeds")
    recipes = {f"{fam}-{seed}": replace(EARLY, family=fam, seed=seed) for fam in FAMILIES for seed in SEEDS}
    recipes |= {
        f"collapse-{fam}": replace(EARLY, kind="collapse", family=fam, seed=100, aux_coef=-0.05) for fam in FAMILIES
    }
    out = {}
    with fresh.one_thread():
        for name, recipe in recipes.items():
            run = _train(root, name, recipe)
            audit = audit_run(run, load(run / "canary.safetensors"), Policy(), cache=ReceiptsCache(enabled=False))
            out[name] = audit.statement["predicate"]
    return out


def test_healthy_runs_saved_early_pass_under_the_defaults(certified: dict[str, dict[str, Any]]) -> None:
    healthy = {name: p for name, p in certified.items() if not name.startswith("collapse")}
    assert len(healthy) == len(SEEDS) * len(FAMILIES) >= 16
    for name, pred in healthy.items():
        assert pred["verdict"] == "PASS", (name, pred["verdict_reason"])
        assert pred["gates"][0]["step"] == 20 and len(pred["gates"]) == 8
        nll = [g["receipts"]["nll"] for g in pred["gates"]]
        assert nll[0] > 4.0 and nll[-1] < 1.6, (name, nll)  # a near-random start, then learning


def test_the_early_dips_are_there_and_within_noise(certified: dict[str, dict[str, Any]]) -> None:
    """Not vacuous: healthy gates whose point π_min ratio is below the 0.5 floor, each with a
    ratio range over the two bootstrap intervals reaching above it; and GREEN gates whose C2
    fell against the near-random first checkpoint while occupancy held and the canary NLL
    improved (atlas motion), said so in the claims and in the terminal's "why"."""
    from moeaudit.report.gate_table import why

    dips, motion = [], []
    for name, pred in certified.items():
        if name.startswith("collapse"):
            continue
        for g in pred["gates"][1:]:
            st = g["structural"]
            assert g["status"] == "GREEN"
            if st["pi_min_ratio"] < 0.5:
                dips.append((name, g["step"]))
                assert st["ratio_ci95"]["pi_min"][1] >= 0.5 and not st["below_floor"]
            if not st["c2_ok"]:
                motion.append((name, g["step"]))
                assert any(c.startswith("atlas motion during pretraining") for c in g["claims"]["licensed"])
                assert "C2 fell" in why(g) and "atlas motion" in why(g)
                assert not any(c.startswith("structure preserved") for c in g["claims"]["licensed"])
    assert len(dips) >= 3 and len({n for n, _ in dips}) >= 2, dips
    assert len(motion) >= 10 and len({n for n, _ in motion}) >= 4, motion


def test_anti_balanced_runs_saved_early_still_fail(certified: dict[str, dict[str, Any]]) -> None:
    for fam in FAMILIES:
        pred = certified[f"collapse-{fam}"]
        assert pred["verdict"] == "FAIL", (fam, pred["verdict_reason"])
        bad = [g for g in pred["gates"][1:] if g["status"] in ("YELLOW", "RED")]
        assert bad and all(not g["structural"]["occupancy_ok"] for g in bad)
        assert all("π_min ratio" in g["structural"]["below_floor"] for g in bad)


def test_the_terminal_row_names_the_failing_quantity(certified: dict[str, dict[str, Any]]) -> None:
    """π_min is not a column of the gate table: a gate that is YELLOW/RED on it says so in its row."""
    from rich.console import Console

    from moeaudit.report import terminal
    from moeaudit.report.gate_table import why

    pred = certified["collapse-mixtral"]
    buf = io.StringIO()
    saved = terminal.out
    terminal.out = Console(file=buf, width=200, highlight=False, color_system=None)
    try:
        terminal.print_gates(pred)
    finally:
        terminal.out = saved
    text = " ".join(buf.getvalue().split())
    bad = [g for g in pred["gates"] if g["status"] in ("YELLOW", "RED")]
    assert bad
    for g in bad:
        reason = why(g)
        assert reason.startswith("π_min ratio 0.0") and " ".join(reason.split()) in text, reason
