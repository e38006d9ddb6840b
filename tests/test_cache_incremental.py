"""Receipts cache (issue 6): re-certifying an unchanged run replays nothing, adding one
checkpoint replays only that checkpoint, and cached results equal freshly computed ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moeaudit import canary as canary_mod
from moeaudit.cache import ReceiptsCache
from moeaudit.certify import audit_run
from moeaudit.judge.policy import Policy
from moeaudit.samples.build import build_samples


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    build_samples(out, "tiny", runs=("healthy",))
    return out


def _certify(run: Path, canary: canary_mod.Canary, cache: ReceiptsCache) -> tuple[dict, list[str]]:
    said: list[str] = []
    audit = audit_run(run, canary, Policy(), say=said.append, cache=cache)
    replayed = [m.removeprefix("replaying ") for m in said if m.startswith("replaying ")]
    return audit.statement["predicate"], replayed


def _stable(pred: dict) -> dict:
    return {k: v for k, v in pred.items() if k not in ("issued_at", "environment")}


def test_adding_a_checkpoint_replays_only_it(tiny: Path, tmp_path: Path) -> None:
    canary = canary_mod.load(tiny / "canary.safetensors")
    full = sorted((tiny / "healthy").glob("checkpoint-*"), key=lambda p: int(p.name[11:]))
    assert len(full) == 2
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tiny / "healthy" / "metrics.jsonl", run / "metrics.jsonl")
    shutil.copytree(full[0], run / full[0].name)
    cache = ReceiptsCache(tmp_path / "cache")

    _, replayed = _certify(run, canary, cache)
    assert replayed == [full[0].name]
    _, replayed = _certify(run, canary, cache)
    assert replayed == []  # unchanged run: nothing replayed

    shutil.copytree(full[1], run / full[1].name)  # the trainer saved one more checkpoint
    incremental, replayed = _certify(run, canary, cache)
    assert replayed == [full[1].name]  # the baseline's states came from the cache

    fresh, replayed = _certify(run, canary, ReceiptsCache(tmp_path / "other", enabled=False))
    assert replayed == [p.name for p in full]
    assert _stable(incremental) == _stable(fresh)  # cached states give the same certificate
