"""The transformers callback's per-step work stops the host never (docs/decisions.md, "No host sync on a
Trainer step"): counted on the
CPU with the stand-in device of tests/device_meter.py — the model's parameters (and so its
gradients, the norms, the routing counts) are device tensors there, and a read of one by the
host is a sync. Only the callback's own work is counted (its step hook and its forward hooks),
not the model's. At the trainer's log and save steps one read-back is allowed."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from device_meter import DeviceGuard, Meter, _dev, metering  # noqa: E402

from moeaudit.integrations import core, summary  # noqa: E402
from moeaudit.integrations.transformers import MoeauditCallback  # noqa: E402


def _tiny_mixtral() -> torch.nn.Module:
    cfg = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        vocab_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    for m in model.modules():  # every parameter on the stand-in device
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(_dev(p.detach()), requires_grad=p.requires_grad)
    return model


def _counted(meter: Meter, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        outer, meter.label = meter.label, label
        try:
            return fn(*args, **kwargs)
        finally:
            meter.label = outer

    return run


def _expert_norms(model: torch.nn.Module) -> dict[str, list[float]]:
    out = {}
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        with torch._C.DisableTorchFunctionSubclass():
            sq = ex.gate_up_proj.grad.double().pow(2).sum((1, 2)) + ex.down_proj.grad.double().pow(2).sum((1, 2))
            out[str(i)] = [math.sqrt(float(v)) for v in sq]
    return out


def test_the_callback_step_is_sync_free_and_its_lines_are_the_step_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meter = Meter()
    meter.label = "model"
    hook, route = core.LossMeter.hook, summary.RoutingCounts._hook
    monkeypatch.setattr(core.LossMeter, "hook", lambda self, *a, **k: _counted(meter, "hooks", hook)(self, *a, **k))
    monkeypatch.setattr(
        summary.RoutingCounts, "_hook", lambda self, layer: _counted(meter, "hooks", route(self, layer))
    )
    model = _tiny_mixtral()
    cb = MoeauditCallback()
    args = SimpleNamespace(output_dir=str(tmp_path), max_grad_norm=1.0)
    state = SimpleNamespace(global_step=0, is_world_process_zero=True, log_history=[])
    cb.on_train_begin(args, state, None, model=model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    expected, steps = [], 5
    guard = DeviceGuard()
    with metering(meter), guard:
        for s in range(steps):
            meter.label = "model"
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            expected.append(_expert_norms(model))
            meter.label = f"step {s + 1}"
            cb.on_pre_optimizer_step(args, state, None)
            meter.label = "model"
            model.zero_grad()
            state.global_step += 1
        meter.label = "log"
        logs: dict[str, Any] = {"loss": 1.0}
        cb.on_log(args, state, None, logs=logs)
        meter.label = "end"
        cb.on_train_end(args, state, None)
    for s in range(1, steps + 1):  # the step's own work: no sync, one copy back (queued)
        assert meter.counts[f"step {s}"]["sync"] == 0, dict(meter.counts[f"step {s}"])
        assert meter.counts[f"step {s}"]["d2h"] == 1, dict(meter.counts[f"step {s}"])
    assert meter.counts["hooks"]["sync"] == 0 and meter.counts["hooks"]["d2h"] == 0
    assert meter.counts["log"]["sync"] == 0  # the lines were already back
    assert any(k.startswith("moe/layer_") for k in logs)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    for line, want in zip(lines, expected, strict=True):
        assert set(line["expert_grad_norms"]) == set(want)
        for layer, norms in want.items():
            assert line["expert_grad_norms"][layer] == pytest.approx(norms, rel=1e-6)
        assert math.isfinite(line["loss"]) and isinstance(line["clipped"], bool)


class _SlowEvent:
    """A copy that has not landed until the host waits for it (a GPU whose queue is behind)."""

    waits = 0

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        _SlowEvent.waits += 1
        self.done = True


def test_lines_in_flight_are_written_at_log_save_and_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the copies land late, nothing waits on a step; the log step, the save step and the
    end of training write every line still in flight, in step order."""
    from moeaudit.integrations import gradnorms

    push = gradnorms.Readback.push

    def slow_push(self: gradnorms.Readback, vector: torch.Tensor, context: Any) -> None:
        push(self, vector, context)
        host, _, ctx = self._pending.pop()
        self._pending.append((host, _SlowEvent(), ctx))

    monkeypatch.setattr(gradnorms.Readback, "push", slow_push)
    _SlowEvent.waits = 0
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            vocab_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
    )
    cb = MoeauditCallback()
    args = SimpleNamespace(output_dir=str(tmp_path), max_grad_norm=1.0)
    state = SimpleNamespace(global_step=0, is_world_process_zero=True, log_history=[])
    cb.on_train_begin(args, state, None, model=model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "metrics.jsonl"

    def steps(n: int) -> None:
        for _ in range(n):
            model(input_ids=ids, labels=ids).loss.backward()
            cb.on_pre_optimizer_step(args, state, None)
            model.zero_grad()
            state.global_step += 1

    def logged() -> list[int]:
        return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []

    steps(3)
    assert logged() == [] and _SlowEvent.waits == 0  # three steps, no wait, no line yet
    cb.on_log(args, state, None, logs={"loss": 1.0})
    assert logged() == [1, 2, 3] and _SlowEvent.waits == 3
    steps(2)
    assert logged() == [1, 2, 3]
    cb.on_save(args, state, None)
    assert logged() == [1, 2, 3, 4, 5]
    steps(1)
    cb.on_train_end(args, state, None)
    assert logged() == [1, 2, 3, 4, 5, 6] and _SlowEvent.waits == 6
