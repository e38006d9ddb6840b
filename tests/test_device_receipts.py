"""State receipts computed where the taps live (docs/decisions.md, "The GPU path: receipts on the
device, copies ahead, inputs offloaded").

On a device the observers get the taps there — h, y, u of the active and the overlap experts,
(3 + min(E, 2k))·N·H floats a layer — and compute every statistic there; what comes back is
the layer's receipts, in one copy (``moeaudit.receipts.deferred``). Measured on the CPU with
``cpu:0`` standing in for the device (``device_meter``): the bytes copied back per routed layer
are capped by the size of that layer's receipts and do not grow with the tokens or the width;
the receipts are the default path's, bit for bit; and no operation mixes a host tensor with a
device one (which the stand-in, all CPU, would otherwise run without complaint).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.policy import Policy
from moeaudit.receipts import bootstrap, deferred
from moeaudit.receipts.state import run_state

pytest.importorskip("transformers")

import hfmodels  # noqa: E402
from device_meter import STANDIN, DeviceGuard, Meter, measure, metering  # noqa: E402
from support.device_receipts import _probe  # noqa: E402

FAMILIES = ["mixtral", "deepseek_v3", "qwen2_moe", "gpt_oss", "llama4_text", "phimoe"]
TOKENS_PER_EXPERT_SETS = 3  # R_k, the overlap candidates, the random outside expert


def _on_standin(
    ckpt: Checkpoint, probe: canary_mod.Canary, keep_states: bool = False
) -> tuple[dict[str, Any], Meter, DeviceGuard]:
    guard, box = DeviceGuard(), {}

    def run(tick: Callable[[str, int, int], None]) -> None:
        with guard:
            box["doc"] = run_state(ckpt, probe, Policy(), keep_states=keep_states, progress=tick, device=str(STANDIN))[
                0
            ]

    meter = measure(ckpt, run)
    return box["doc"], meter, guard


def _leaves(tree: Any) -> int:
    """How many numbers (and nulls, each read from two: an interval or a mean over no tokens) a
    receipts entry holds."""
    if isinstance(tree, dict):
        return sum(_leaves(v) for v in tree.values())
    if isinstance(tree, list):
        return sum(_leaves(v) for v in tree)
    if tree is None:
        return 2
    return 1 if isinstance(tree, int | float) and not isinstance(tree, bool) else 0


def _without_environment(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "environment"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_s_receipts_come_back_in_one_copy_of_their_own_size(family: str, tmp_path: Path) -> None:
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / family, family))
    probe = _probe()
    doc, meter, guard = _on_standin(ckpt, probe)
    assert guard.mixed == []
    default = run_state(ckpt, probe, Policy())[0]
    # bit for bit: every number is read from an exact float64 copy of the tensor that held it
    assert json.dumps(_without_environment(doc)) == json.dumps(_without_environment(default))
    E = ckpt.spec.num_experts
    N, H = probe.num_windows * probe.window_len, ckpt.spec.hidden_size
    for entry in doc["layers"]:
        counts = meter.counts[f"forward {entry['layer']}"]
        receipt = {k: v for k, v in entry.items() if k != "gradients"}
        cap = 8 * _leaves(receipt) + 8 * E * TOKENS_PER_EXPERT_SETS
        # one copy of the receipts + the tokens per expert; the taps alone were ≥ 4·N·H floats
        assert counts["d2h"] <= 2 and counts["sync"] <= 2, dict(counts)
        assert counts["d2h_bytes"] <= cap < 4 * 4 * N * H, (dict(counts), cap)


def test_the_copy_back_does_not_grow_with_the_tokens_or_the_width(tmp_path: Path) -> None:
    """Three times the tokens and twice the width: not one byte more comes back per layer (the
    taps did: 61 024 bytes a mixtral layer at N 64, H 32, before receipts were computed on the device)."""
    from hfmodels import save_tiny

    back = {}
    for hidden, T in ((32, 16), (64, 48)):
        path = tmp_path / f"h{hidden}"
        save_tiny(path, "mixtral", hidden_size=hidden)
        ckpt = Checkpoint(path)
        _, meter, _ = _on_standin(ckpt, _probe(T=T))
        back[hidden, T] = [meter.counts[f"forward {i}"]["d2h_bytes"] for i in ckpt.spec.routed_layers]
    assert back[32, 16] == back[64, 48]
    assert max(back[32, 16]) < 20_000


def test_anchor_states_for_pair_receipts_come_to_the_host(tmp_path: Path) -> None:
    """``keep_states`` (compare, certify): z and y of each layer are kept on the host, queued
    before the layer's one wait (two copies more, no synchronisation more)."""
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / "mixtral", "mixtral"))
    probe = _probe()
    guard = DeviceGuard()
    meter = Meter()
    with metering(meter), guard:
        _, obs = run_state(ckpt, probe, Policy(), keep_states=True, device=str(STANDIN))
    assert guard.mixed == []
    _, host = run_state(ckpt, probe, Policy(), keep_states=True)
    for layer, states in obs.states.items():
        for name in ("z_NH", "y_NH"):
            t = getattr(states, name)
            assert type(t) is torch.Tensor  # a host tensor, not the stand-in's
            assert torch.equal(t, getattr(host.states[layer], name))


def test_the_guard_sees_a_host_tensor_meeting_a_device_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the random outside expert drawn on the host and left there (as before this work),
    the guard names the operation that would raise on a GPU."""
    from moeaudit.receipts import overlap

    def on_the_host(topk_NK: torch.Tensor, E: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        r = torch.rand((topk_NK.shape[0], E), generator=g, dtype=torch.float64)
        return r.scatter(1, topk_NK, -1.0).argmax(dim=-1, keepdim=True)

    monkeypatch.setattr(overlap, "random_outside", on_the_host)
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / "mixtral", "mixtral"))
    _, _, guard = _on_standin(ckpt, _probe())
    assert any(m.startswith("scatter([64, 4], @[64, 2]") for m in guard.mixed), guard.mixed[:5]


def test_resolve_reads_every_leaf_exactly_in_one_copy() -> None:
    meter = Meter()
    x32 = torch.tensor([1 / 3, 2.5e-30, -7.0], dtype=torch.float32)
    big = torch.tensor([2**52 + 1, 0, 7], dtype=torch.int64)
    with metering(meter):
        d32, dbig = x32.to(STANDIN, non_blocking=True), big.to(STANDIN, non_blocking=True)
        tree = {
            "f": deferred.number(d32[0]),
            "l": deferred.floats(d32),
            "i": deferred.integers(dbig),
            "n": deferred.integer(dbig[0]),
            "m": [deferred.floats(torch.stack([d32, d32]))],
            "none": deferred.mean_or_none(d32.sum(), (d32 > 5).sum()),
            "plain": "kept",
        }
        meter.label = "resolve"
        out = deferred.resolve(tree)
    assert dict(meter.counts["resolve"]) == {"d2h": 1, "d2h_bytes": 8 * 16, "sync": 1}
    assert out == {
        "f": float(x32[0]),
        "l": x32.tolist(),
        "i": big.tolist(),
        "n": 2**52 + 1,
        "m": [[x32.tolist(), x32.tolist()]],
        "none": None,
        "plain": "kept",
    }
    assert type(out["n"]) is int and type(out["f"]) is float


def _filtered_interval(stat_B: torch.Tensor) -> list[float] | None:
    """The interval as computed before receipts were computed on the device: a boolean index of the finite replicates
    (a synchronisation on a GPU), then ``quantile``."""
    stat_B = stat_B[torch.isfinite(stat_B)]
    if stat_B.numel() == 0:
        return None
    q = torch.quantile(stat_B.double(), torch.tensor([0.025, 0.975], dtype=torch.float64))
    return [float(q[0]), float(q[1])]


def test_nanquantile_intervals_are_the_filtered_ones_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 1200, (1,), generator=g))
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** (trial % 9 - 4)
        if trial % 3 == 0:
            x[torch.rand(n, generator=g) < 0.2] = math.inf
            x[torch.rand(n, generator=g) < 0.1] = math.nan
        if trial % 5 == 0:
            x = x.float()
        assert bootstrap._interval(x) == _filtered_interval(x), trial
    assert bootstrap._interval(torch.tensor([math.nan, -math.inf])) is None


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_the_receipts_dispatch_no_operator_cuda_refuses(family: str, tmp_path: Path) -> None:
    """The receipts now run on the device too: none of their operators may be one torch refuses
    on CUDA in deterministic mode (tests/test_determinism.py checks the replay itself)."""
    from moeaudit.replay.determinism import recording

    ckpt = Checkpoint(hfmodels.save_any(tmp_path / family, family))
    with recording() as rec:
        run_state(ckpt, _probe(), Policy(), keep_states=True, device=str(STANDIN))
    assert rec.raising == {}
    assert {"aten.sort.default", "aten.scatter_add_.default"} <= rec.ops  # the intervals, the counts
