"""Stored layer inputs beyond a device memory budget wait in host memory (docs/decisions.md, "Input offload is an
environment setting").

Checked on the CPU with ``cpu:0`` standing in for the device: with a budget for one layer's
input, the first layers' inputs are copied to the host in the forward (one copy each, queued)
and back in the backward, each queued when the layer after it is read; the receipts are those
of the default path, bit for bit; the budget's setting and its default."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moeaudit.checkpoint import Checkpoint
from moeaudit.errors import UsageError
from moeaudit.policy import Policy
from moeaudit.receipts.state import run_state
from moeaudit.replay import offload
from moeaudit.replay.offload import ENV, StoredInputs, input_budget, parse_budget

pytest.importorskip("transformers")

import hfmodels  # noqa: E402
from device_meter import STANDIN, measure  # noqa: E402
from support.device_receipts import _probe  # noqa: E402


def test_inputs_beyond_the_budget_go_to_the_host_and_come_back_one_ahead() -> None:
    xs = [torch.full((2, 3, 4), float(i)) for i in range(4)]
    stored = StoredInputs(STANDIN, 4, budget=2 * 2 * 3 * 4 * 4)  # room for two inputs
    for x in xs:
        stored.append(x)
    assert stored.offloaded == [0, 1] and stored.first_resident == 2
    assert torch.equal(stored[3], xs[3]) and stored._back == {}
    assert torch.equal(stored[2], xs[2]) and set(stored._back) == {1}  # 1 queued while 2 computes
    stored[2] = None
    assert torch.equal(stored[1], xs[1]) and set(stored._back) == {0}
    assert torch.equal(stored[0], xs[0]) and stored._back == {}


@pytest.mark.parametrize(("budget", "offloaded"), [(0.0, [0, 1, 2]), (math.inf, []), (None, [])])
def test_the_budget_decides_which(budget: float | None, offloaded: list[int]) -> None:
    stored = StoredInputs(STANDIN, 3, budget=budget)  # None: the default, no limit off CUDA
    for i in range(3):
        stored.append(torch.ones(5) * i)
    assert stored.offloaded == offloaded


def test_the_default_path_never_offloads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    stored = StoredInputs(None, 2)
    stored.append(torch.ones(3))
    assert stored.offloaded == [] and stored.budget is None


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_offloaded_inputs_give_the_same_receipts(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / family, family))
    probe = _probe()
    N, H, L = probe.num_windows * probe.window_len, ckpt.spec.hidden_size, ckpt.spec.num_layers
    input_bytes = N * H * 4
    monkeypatch.setenv(ENV, str(input_bytes))  # room for one layer's input: L − 1 go to the host
    made: list[StoredInputs] = []

    class Spy(StoredInputs):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    import moeaudit.replay.engine as engine

    monkeypatch.setattr(engine, "StoredInputs", Spy)
    box: dict[str, Any] = {}
    meter = measure(
        ckpt,
        lambda tick: box.setdefault("doc", run_state(ckpt, probe, Policy(), progress=tick, device=str(STANDIN))[0]),
    )
    assert made[0].offloaded == list(range(L - 1))
    monkeypatch.delenv(ENV)
    default = run_state(ckpt, probe, Policy())[0]
    strip = {"environment"}
    assert json.dumps({k: v for k, v in box["doc"].items() if k not in strip}) == json.dumps(
        {k: v for k, v in default.items() if k not in strip}
    )
    plain = measure(ckpt, lambda tick: run_state(ckpt, probe, Policy(), progress=tick, device=str(STANDIN)))
    for i in range(L):
        out = meter.counts[f"forward {i}"]["d2h_bytes"] - plain.counts[f"forward {i}"]["d2h_bytes"]
        assert out == (input_bytes if i < L - 1 else 0), i
        assert meter.counts[f"forward {i}"]["sync"] == plain.counts[f"forward {i}"]["sync"]  # queued
    back = sum(
        meter.counts[f"backward {i}"]["h2d_bytes"] - plain.counts[f"backward {i}"]["h2d_bytes"] for i in range(L)
    )
    assert back == (L - 1) * input_bytes  # each once, however the layers are bucketed


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0.0), ("12GB", 12e9), ("512MiB", 512 * 2**20), ("1.5e9", 1.5e9), ("inf", math.inf), (" 3 kb ", 3000.0)],
)
def test_budget_settings(text: str, value: float) -> None:
    assert parse_budget(text) == value


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "-1GB", "infGB", ""])
def test_a_bad_budget_is_one_clear_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match=ENV):
        parse_budget(text)


def test_the_default_budget_is_half_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(
        offload.torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=80 * 10**9)
    )
    assert input_budget("cuda:0") == 40e9
    assert input_budget(STANDIN) == math.inf and input_budget(None) == math.inf
    monkeypatch.setenv(ENV, "24GB")
    assert input_budget("cuda:0") == 24e9
