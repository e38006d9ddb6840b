"""A declared stage applies from its step on; rotated checkpoints keep the whole bound log.

Over one small healthy pretraining run trained here (mixtral layout, 4 experts, a plain torch
loop with moeaudit's recorder, checkpoints every 40 steps to 320, a log line every step):

* a ``regime_change`` to post-training declared at step 200 leaves the pair 160 → 200 a
  pretraining pair: its refinement margin (negative, as healthy pretraining's always is) is
  reported, not gated, and ``gate`` says the candidate is a fresh baseline (exit 3) instead of
  HOLD on "repurposing"; the last checkpoint's refinement is judged against the post-training
  stage's own baseline (200), never across the change;
* the same run rotated as ``save_total_limit = 3`` leaves it (only 240, 280, 320 on disk, logs
  from step 1): the envelope is judged over the whole bound log, so the run can PASS, and the
  training-loss sentence compares equal windows on either side of each checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
import fresh_runs as fresh  # noqa: E402

from moeaudit.cache import ReceiptsCache  # noqa: E402
from moeaudit.canary import load  # noqa: E402
from moeaudit.certify import audit_run  # noqa: E402
from moeaudit.cli import cli  # noqa: E402
from moeaudit.policy import Policy  # noqa: E402
from moeaudit.report import gate_table  # noqa: E402

RECIPE = fresh.Recipe("healthy", loop="torch", seed=12, steps=320, save_every=40, aux_coef=0.02)
CHANGE = {"step": 200, "event": "regime_change", "note": "SFT from here", "stage": "post-training"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with fresh.one_thread():
        return fresh.train(RECIPE, tmp_path_factory.mktemp("stages") / "run")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        "MOEAUDIT_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
        "XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("config")),
    }


def _copy(run: Path, dst: Path, steps: list[int], events: list[dict[str, Any]] | None = None) -> Path:
    dst.mkdir(parents=True)
    for s in steps:
        shutil.copytree(run / f"checkpoint-{s}", dst / f"checkpoint-{s}")
    for name in ("metrics.jsonl", "canary.safetensors"):
        shutil.copy(run / name, dst / name)
    if events:
        (dst / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return dst


def _certify(run: Path, env: dict[str, str]) -> dict[str, Any]:
    audit = audit_run(
        run, load(run / "canary.safetensors"), Policy(), cache=ReceiptsCache(Path(env["MOEAUDIT_CACHE_DIR"]))
    )
    return audit.statement["predicate"]


def _check(pred: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pred["checks"] if c["name"] == name)


def test_a_pair_before_a_declared_stage_is_judged_as_the_stage_before(run, env, tmp_path) -> None:
    steps = [s for s in range(40, 201, 40)]
    changed = _copy(run, tmp_path / "changed", steps, [CHANGE])
    pred = _certify(changed, env)
    assert pred["verdict"] == "PASS", pred["verdict_reason"]  # was FAIL: "repurposing … exceeds τ"
    assert pred["run"]["stage"] == "post-training"  # the run's stage as it stands at 200
    refinement = pred["margins"]["refinement"]
    assert refinement["stage"] == "pretraining" and refinement["against_step"] == 40  # the active baseline
    assert refinement["exact"] < -0.3  # healthy pretraining: "repurposing" by the post-training budget
    check = _check(pred, "refinement")
    assert not check["evaluated"] and "pretraining at its base step 40: reported, not gated" in check["reason"]
    assert pred["verdict"] == "PASS", pred["verdict_reason"]
    assert pred["gates"][-1]["status"] == "BASELINE" and pred["gates"][-1]["new_baseline"]

    out = tmp_path / "gate.json"
    result = CliRunner(env=env).invoke(
        cli,
        [
            "gate",
            str(changed / "checkpoint-160"),
            str(changed / "checkpoint-200"),
            "--json",
            str(out),
            "--canary",
            str(run / "canary.safetensors"),
        ],
    )
    assert result.exit_code == 3, result.output + result.stderr  # was HOLD (1): "repurposing … exceeds τ"
    doc = json.loads(out.read_text())
    assert doc["decision"] == "INCONCLUSIVE" and doc["verdict"] == "PASS"
    assert "checkpoint-200 is a fresh baseline (regime_change at step 200" in doc["decision_reason"]
    assert "gate a later checkpoint" in doc["decision_reason"]
    first = " ".join(result.output.split())
    assert "INCONCLUSIVE checkpoint-200 over checkpoint-160: checkpoint-200 is a fresh baseline" in first


def test_a_pair_spanning_the_change_is_compared_with_the_stages_own_baseline(run, env, tmp_path) -> None:
    steps = list(range(40, 321, 40))
    pred = _certify(_copy(run, tmp_path / "whole", steps, [CHANGE]), env)
    refinement = pred["margins"]["refinement"]
    assert "also_against" not in refinement  # never against the pretraining baseline at 40
    assert refinement["stage"] == "post-training" and refinement["against_step"] == 200
    assert _check(pred, "refinement")["evaluated"]
    # the same margin as the post-training stage on its own (its checkpoints from 200)
    alone = _certify(_copy(run, tmp_path / "alone", steps[4:], [{**CHANGE, "step": 0}]), env)
    assert alone["margins"]["refinement"]["exact"] == pytest.approx(refinement["exact"], abs=1e-12)
    # the gates before 200 are judged as pretraining: the same statuses as without the event
    plain = _certify(_copy(run, tmp_path / "plain", steps[:5]), env)
    assert [g["status"] for g in pred["gates"][:4]] == [g["status"] for g in plain["gates"][:4]]
    assert pred["gates"][4]["status"] == "BASELINE" and plain["gates"][4]["status"] == "GREEN"
    # each gate signs the stage that judged it: the one in force at the base of its pair
    assert [(g["step"], g["stage"]) for g in pred["gates"]] == [
        (s, "pretraining" if s <= 200 else "post-training") for s in steps
    ]
    assert {g["stage"] for g in plain["gates"]} == {"pretraining"}
    assert gate_table.stages_line(pred["gates"]) == (
        "judged as: pretraining at step(s) 40–200; post-training at step(s) 240–320"
    )
    assert gate_table.stages_line(plain["gates"]) is None


def _losses(run: Path) -> dict[int, float]:
    return {obj["step"]: obj["loss"] for obj in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_rotated_checkpoints_keep_the_whole_log(run, env, tmp_path) -> None:
    rotated = _copy(run, tmp_path / "rotated", [240, 280, 320])
    pred = _certify(rotated, env)
    envelope = _check(pred, "envelope")
    assert envelope["status"] == "PASS" and "over steps 1–320" in envelope["reason"], envelope["reason"]
    assert pred["verdict"] == "PASS", pred["verdict_reason"]  # was INCONCLUSIVE: 80 logged steps
    assert pred["envelope"]["window"] == {"from": 1, "to": 320}


def test_training_loss_compares_equal_windows_either_side_of_a_checkpoint(run, env, tmp_path) -> None:
    losses = _losses(run)

    def mean(lo: int, hi: int) -> float:
        picked = [v for s, v in losses.items() if lo < s <= hi]
        return sum(picked) / len(picked)

    pred = _certify(_copy(run, tmp_path / "rotated", [240, 280, 320]), env)
    for g in pred["gates"][1:]:
        prev = g["step"] - 40
        sentence = next(c for c in g["claims"]["licensed"] if c.startswith("the logged loss"))
        before, after = mean(prev - 40, prev), mean(prev, g["step"])
        assert f"from {before:.4f} to {after:.4f}" in sentence, (g["step"], sentence)
    warmup_mean = mean(0, 240)  # what the first sentence compared with before: steps 1–240
    assert f"from {warmup_mean:.4f}" not in json.dumps(pred["gates"][1]["claims"])
    assert warmup_mean > mean(200, 240) + 0.1
