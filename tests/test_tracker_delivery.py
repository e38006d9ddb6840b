"""The README's plain Trainer snippet (``callbacks=[MoeauditCallback(...)]``, no ``.attach``)
delivers the ``moe/…`` scalars to a ``report_to`` tracker — read back from the TensorBoard
event file — and ``.attach`` on top of it does not log them twice
(:mod:`moeaudit.integrations.ordering`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit.integrations.ordering import handler_of, lead

transformers = pytest.importorskip("transformers")
pytest.importorskip("tensorboard")
from hfmodels import VOCAB, tiny_model  # noqa: E402

STEPS, LOG_EVERY, BATCH, SEQ = 4, 2, 4, 8
LOGGED = [2, 4]


def _train(run: Path, *, attach: bool) -> tuple[Any, Any]:
    from moeaudit.integrations.transformers import MoeauditCallback

    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=0.0,
        report_to=["tensorboard"],
        logging_steps=LOG_EVERY,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    callback = MoeauditCallback()
    trainer = transformers.Trainer(
        model=tiny_model("mixtral"),
        args=args,
        train_dataset=[{"input_ids": r, "labels": r} for r in tokens],
        callbacks=[callback],  # the README's snippet: after the report_to integrations
    )
    if attach:
        callback.attach(trainer)
    trainer.train()
    return trainer, callback


def _events(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event of the run's TensorBoard file, by tag (``train/`` prefix dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(run.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag.removeprefix("train/"): [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_plain_snippet_delivers_moe_scalars_to_tensorboard(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="moeaudit"):
        trainer, callback = _train(run, attach=False)
    events = _events(run)
    moe = {tag: ev for tag, ev in events.items() if tag.startswith("moe/")}
    layers = trainer.model.config.num_hidden_layers
    assert {f"moe/layer_{i}/pi_min" for i in range(layers)} <= set(moe)
    history = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for tag, ev in moe.items():
        assert [s for s, _ in ev] == LOGGED, tag  # once per logged step
        for step, value in ev:  # the value the Trainer's own log holds (float32 in the file)
            assert value == pytest.approx(history[step][tag], rel=1e-6, abs=1e-30), tag
    assert trainer.callback_handler.callbacks[0] is callback
    assert not [r for r in caplog.records if "report_to" in r.getMessage()]


def test_attach_on_the_plain_snippet_logs_each_scalar_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer, callback = _train(run, attach=True)
    moe = {tag: ev for tag, ev in _events(run).items() if tag.startswith("moe/")}
    assert moe
    assert all([s for s, _ in ev] == LOGGED for ev in moe.values())
    assert sum(c is callback for c in trainer.callback_handler.callbacks) == 1


class _Handler:
    """The shape of transformers' ``CallbackHandler.call_event``: iterate ``self.callbacks``."""

    def __init__(self, callbacks: list[Any]):
        self.callbacks = callbacks

    def call_event(self) -> list[str]:
        seen = []
        for c in self.callbacks:
            seen.append(c.on_event())
        return seen


class _Named:
    def __init__(self, name: str, leads: bool = False):
        self.name, self.leads = name, leads

    def on_event(self) -> str:
        if self.leads:
            assert lead(self)
        return self.name


def test_lead_moves_the_callback_first_and_calls_every_later_one_once() -> None:
    a, b, me, c, d = _Named("a"), _Named("b"), _Named("me", leads=True), _Named("c"), _Named("d")
    handler = _Handler([a, b, me, c, d])
    assert handler.call_event() == ["a", "b", "me", "c", "d"]
    assert handler.callbacks == [me, a, b, c, d]
    assert handler.call_event() == ["me", "a", "b", "c", "d"]  # stays first, nothing repeated


def test_lead_outside_a_handler_says_so() -> None:
    me = _Named("me")
    assert handler_of(me) is None
    assert not lead(me)


def test_a_callback_no_handler_calls_warns_when_report_to_names_a_tracker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Called outside a Trainer's CallbackHandler (a custom loop calling it by hand), it cannot
    move itself ahead of the trackers: it says so once, naming them, instead of staying silent."""
    from types import SimpleNamespace

    from moeaudit.integrations.transformers import MoeauditCallback

    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    for i, (report_to, warned) in enumerate(((["tensorboard"], True), ([], False), ("none", False))):
        callback = MoeauditCallback(probe=False)
        args = SimpleNamespace(output_dir=str(tmp_path / f"run{i}"), report_to=report_to)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moeaudit"):
            callback.on_train_begin(args, state, None, model=tiny_model("mixtral"))
        callback.on_train_end(args, state, None)
        messages = [r.getMessage() for r in caplog.records if "report_to" in r.getMessage()]
        assert len(messages) == warned, report_to
        if warned:
            assert "tensorboard" in messages[0] and ".attach(trainer)" in messages[0]
