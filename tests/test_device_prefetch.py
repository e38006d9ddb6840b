"""Double-buffered expert copies (docs/decisions.md, "The GPU path: receipts on the device,
copies ahead, inputs offloaded"): a sweep over a layer's experts on a device says
which experts it reads, in order, and each read starts the copy of the next one, so that
expert e+1's bytes cross while e computes. Checked on the CPU with ``cpu:0`` standing in for
the device: every expert a sweep reads is sent once, in the sweep's order, every one but the
first before it is read, none that is not read; nothing is pinned off CUDA (pinning needs an
accelerator); the receipts do not change (tests/test_device.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit.checkpoint import Checkpoint
from moeaudit.replay import device as device_mod
from moeaudit.replay.device import DeviceExperts

pytest.importorskip("transformers")

STANDIN = torch.device("cpu", 0)


def _experts(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"w1": torch.randn(3, 2, generator=g), "w2": torch.randn(2, 3, generator=g)} for _ in range(n)]


def test_each_read_starts_the_next_planned_copy() -> None:
    host = _experts(5)
    on = DeviceExperts(host, STANDIN)
    on.visit([0, 2, 3])
    assert torch.equal(on[0]["w1"], host[0]["w1"]) and on.sent == [0, 2]  # 2 is on its way
    assert torch.equal(on[2]["w2"], host[2]["w2"]) and on.sent == [0, 2, 3]
    assert torch.equal(on[3]["w1"], host[3]["w1"]) and on.sent == [0, 2, 3]  # the plan is done
    assert on.early == [2, 3]
    on[1]  # outside any plan: sent when read, nothing ahead
    assert on.sent == [0, 2, 3, 1] and on.early == [2, 3]


def test_a_read_off_the_plan_does_not_use_the_copy_ahead() -> None:
    host = _experts(4)
    on = DeviceExperts(host, STANDIN)
    on.visit([0, 1, 2])
    on[0]
    got = on[2]  # 1 was copied ahead; 2 is read instead: sent now, and the right one
    assert torch.equal(got["w1"], host[2]["w1"]) and on.sent == [0, 1, 2] and on.early == []


class _Spy(DeviceExperts):
    made: list[_Spy] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Spy.made.append(self)


def test_a_replay_sends_each_expert_it_reads_once_and_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixtral with 16 experts on the stand-in: in every routed layer, forward and backward, the
    experts are sent in increasing order, each once, every one but the first before it is read;
    and no host tensor is pinned (the CPU has no pinned memory)."""
    from hfmodels import save_tiny

    from moeaudit.replay.engine import replay

    save_tiny(tmp_path / "m", "mixtral", num_local_experts=16)
    ckpt = Checkpoint(tmp_path / "m")
    _Spy.made = []
    monkeypatch.setattr(device_mod, "DeviceExperts", _Spy)

    def no_pinning(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("pinned off CUDA")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    tokens = torch.randint(0, ckpt.spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    replay(ckpt, tokens, device=STANDIN)
    routed = [s for s in _Spy.made if s.sent]
    assert len(routed) == 2 * len(ckpt.spec.routed_layers)  # forward and backward of each
    for spy in routed:
        assert spy.sent == sorted(set(spy.sent)), spy.sent  # once each, in the sweep's order
        assert spy.early == spy.sent[1:]  # every one but the first copied before it was read
        assert len(spy.sent) > 8  # most of the 16 experts get tokens: a real sweep
