"""The fresh runs of ``tests/fresh_runs.py`` are what their recipes claim.

Measured with moeaudit's receipts (occupancy and canary NLL of each checkpoint) and the
training hook's own log, never with its verdicts: these runs exist to test the verdicts.
The runs come from the session fixture ``fresh_runs`` (trained once per session, or reused
from ``$MOEAUDIT_FRESH_RUNS``); each checkpoint is replayed once per module (~0.1 s each).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
import fresh_runs as fresh  # noqa: E402

from moeaudit import canary as canary_mod  # noqa: E402
from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.receipts.state import state_receipts  # noqa: E402
from moeaudit.run import discover  # noqa: E402

pytestmark = pytest.mark.fresh_runs

Receipts = dict[int, dict[str, Any]]  # step → moeaudit.receipts/v1 document
STARVED = 0.1  # an expert share below a tenth of the uniform k/E counts as starved


@pytest.fixture(scope="module")
def receipts(fresh_runs: Mapping[str, Path]) -> dict[str, Receipts]:
    """Every checkpoint's receipts, on one intra-op thread: these replays are tiny, and a
    second thread on a busy 2-core machine makes each one up to 100x slower."""
    out = {}
    with fresh.one_thread():
        for name, run in fresh_runs.items():
            probe = canary_mod.load(run / "canary.safetensors")
            out[name] = {step: state_receipts(ckpt, probe) for step, ckpt in discover(run).checkpoints}
    return out


def _metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _min_share(doc: dict[str, Any], recipe: fresh.Recipe) -> float:
    """The smallest expert share over routed layers, as a fraction of the uniform k/E."""
    return min(layer["occupancy"]["pi_min"] for layer in doc["layers"]) / (recipe.top_k / recipe.experts)


def _falls(values: list[float]) -> bool:
    """The mean of the last tenth is below the mean of the first tenth."""
    n = max(1, len(values) // 10)
    return sum(values[-n:]) / n < sum(values[:n]) / n


def _names(kind: str) -> list[str]:
    return [name for name, r in fresh.RECIPES.items() if r.kind == kind]


def test_recipes_cover_issue_23() -> None:
    """At least 4 healthy variants (seeds, sizes, save intervals, a plain loop, another
    family), 2 collapse variants and an overfit run."""
    healthy = [fresh.RECIPES[n] for n in _names("healthy")]
    assert len(healthy) >= 4 and len(_names("collapse")) >= 2 and _names("overfit")
    assert len({r.seed for r in healthy}) == len(healthy)
    assert len({(r.hidden, r.layers, r.experts) for r in healthy}) >= 2
    assert len({r.save_every for r in healthy}) >= 2
    assert {"torch", "trainer"} <= {r.loop for r in healthy}
    assert {r.family for r in healthy} - {"mixtral"}


def test_layout(fresh_runs: Mapping[str, Path]) -> None:
    """Trainer layout: a checkpoint at every scheduled save, the hook's log and the canary."""
    for name, run in fresh_runs.items():
        r = fresh.RECIPES[name]
        assert discover(run).steps == fresh.save_schedule(r), name
        assert (run / "canary.safetensors").is_file() and (run / "canary_probe.jsonl").is_file()
        steps = [line["step"] for line in _metrics(run)]
        assert steps == list(range(r.log_every, r.steps + 1, r.log_every)), name
        for step in fresh.save_schedule(r):
            ckpt = run / f"checkpoint-{step}"
            assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()
            assert (ckpt / "trainer_state.json").is_file() == (r.loop == "trainer"), name


def test_healthy_runs_have_no_dead_expert(receipts: dict[str, Receipts]) -> None:
    for name in _names("healthy") + _names("stress"):
        for step, doc in receipts[name].items():
            assert all(layer["occupancy"]["dead"] == 0 for layer in doc["layers"]), (name, step)
        nll = [doc["nll"] for doc in receipts[name].values()]
        assert nll[-1] < nll[0], name


@pytest.mark.parametrize("name", _names("collapse"))
def test_collapse_starves_an_expert_while_loss_falls(
    name: str, fresh_runs: Mapping[str, Path], receipts: dict[str, Receipts]
) -> None:
    r, docs = fresh.RECIPES[name], receipts[name]
    last = docs[max(docs)]
    dead = max(layer["occupancy"]["dead"] for layer in last["layers"])
    assert dead > 0 or _min_share(last, r) < STARVED, (name, _min_share(last, r))
    lines = _metrics(fresh_runs[name])
    assert _falls([line["loss"] for line in lines])  # the logged objective (CE + aux term)
    if "ce_loss" in lines[0]:
        assert _falls([line["ce_loss"] for line in lines])
    assert last["nll"] < docs[min(docs)]["nll"]  # held-out cross-entropy falls too


def test_overfit_canary_nll_rises_several_fold(fresh_runs: Mapping[str, Path], receipts: dict[str, Receipts]) -> None:
    for name in _names("overfit"):
        nll = [doc["nll"] for _, doc in sorted(receipts[name].items())]
        assert nll[-1] >= 3 * min(nll[:-1]), nll
        assert _falls([line["loss"] for line in _metrics(fresh_runs[name])])  # it fits its training set


def test_frozen_stretch_repeats_a_checkpoint(fresh_runs: Mapping[str, Path]) -> None:
    """Skipped updates save the same weights under two step names."""
    r = fresh.RECIPES["stress-frozen"]
    run = fresh_runs["stress-frozen"]
    lo, hi = r.frozen
    digests = [Checkpoint(run / f"checkpoint-{s}").digest for s in (lo, hi)]
    assert digests[0] == digests[1]


def test_build_is_deterministic(tmp_path: Path) -> None:
    """The same recipe trains the same bytes: a short Trainer recipe, trained twice here."""
    recipe = replace(fresh.RECIPES["healthy-olmoe"], steps=40, save_every=20)

    def digests(run: Path) -> list[str]:
        files = sorted(p for p in run.rglob("*") if p.suffix in (".safetensors", ".jsonl"))
        return [f"{p.relative_to(run)} {hashlib.sha256(p.read_bytes()).hexdigest()}" for p in files]

    first, second = (digests(fresh.train(recipe, tmp_path / str(i))) for i in (1, 2))
    assert first == second and len(first) == 5  # 2 checkpoints, canary, metrics, probe
