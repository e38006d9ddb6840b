"""The routed experts' W1/W3 products kept from the forward for the backward (``replay.stash``;
docs/decisions.md, "The experts' W1/W3 products kept for the backward (`replay.stash`)"): which
layers keep them under a budget, that the backward uses them, and that the receipts do not depend on
it — bit for bit, in the test process's default thread setting, since the default budget can follow the
memory free when a replay starts (on a tight machine)."""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit.checkpoint import Checkpoint
from moeaudit.errors import UsageError
from moeaudit.policy import Policy
from moeaudit.receipts.state import run_state
from moeaudit.replay import engine, stash
from moeaudit.replay.blocks import experts as experts_mod
from moeaudit.replay.stash import (
    ENV,
    ExpertStash,
    activation_budget,
    default_budget,
    host_headroom,
    keepable,
    reserved_bytes,
    stored_input_bytes,
)

pytest.importorskip("transformers")

import hfmodels  # noqa: E402
from support.device_receipts import _probe  # noqa: E402


def _receipts_and_stash(ckpt: Checkpoint, monkeypatch: pytest.MonkeyPatch, budget: str) -> tuple[str, list[Any]]:
    monkeypatch.setenv(ENV, budget)
    made: list[ExpertStash] = []
    used: list[bool] = []

    class Spy(ExpertStash):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def offer(self, layer: int) -> Any:
            kept = super().offer(layer)
            if kept is not None:
                used.append(layer)
            return kept

    real = experts_mod._swiglu_grads
    reused: list[int] = []

    def spy_grads(*args: Any) -> Any:
        if len(args) > 4 and args[4] is not None:
            reused.append(args[4][0].shape[0])
        return real(*args)

    monkeypatch.setattr(engine, "ExpertStash", Spy)
    monkeypatch.setattr(experts_mod, "_swiglu_grads", spy_grads)
    doc = run_state(ckpt, _probe(), Policy())[0]
    doc.pop("environment", None)
    assert len(made) == 1 and made[0].used == 0 and made[0].layers == []  # every layer's taken back
    return json.dumps(doc, sort_keys=True), [used, sum(reused)]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "qwen2_moe", "flex_olmo", "jetmoe", "longcat_flash"])
def test_kept_products_give_the_same_receipts(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / family, family))
    spec = ckpt.spec
    probe = _probe()
    N = probe.num_windows * probe.window_len
    routed = list(spec.routed_layers)
    per_layer = N * spec.top_k * spec.expert_dim * 2 * 4
    none, (kept_none, rows_none) = _receipts_and_stash(ckpt, monkeypatch, "0")
    one, (kept_one, rows_one) = _receipts_and_stash(ckpt, monkeypatch, str(per_layer))
    every, (kept_all, rows_all) = _receipts_and_stash(ckpt, monkeypatch, "inf")
    assert kept_none == [] and rows_none == 0
    assert kept_one == routed[:1] and kept_all == routed  # the first routed layer only; every one
    if not spec.zero_experts:  # every (token, slot) reused
        assert rows_one == N * spec.top_k and rows_all == len(routed) * N * spec.top_k
    else:  # LongCat: the slots of identity experts have no products
        assert 0 < rows_one <= N * spec.top_k and rows_one < rows_all <= len(routed) * N * spec.top_k
    assert none == one == every  # the numbers do not depend on the budget


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text", "nemotron_h"])
def test_other_expert_forms_keep_nothing(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's clamped GLU, Llama 4's scaled inputs, Nemotron-H's ReLU² form their own
    products in the backward: no budget is spent on them."""
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / family, family))
    assert not keepable(ckpt.spec)
    _, (kept, rows) = _receipts_and_stash(ckpt, monkeypatch, "inf")
    assert kept == [] and rows == 0


def test_layers_are_kept_in_forward_order_while_the_budget_lasts(tmp_path: Path) -> None:
    spec = Checkpoint(hfmodels.save_any(tmp_path / "mixtral", "mixtral")).spec
    s = ExpertStash(spec, tokens=10, budget=2.5 * 10 * spec.top_k * spec.expert_dim * 2 * 4, dtype=torch.float32)
    assert [s.offer(i) is not None for i in range(4)] == [True, True, False, False]
    assert s.layers == [0, 1] and s.take(3) is None
    assert s.take(1) == {} and s.layers == [0] and s.used == s.per_layer
    assert s.offer(2) is not None  # room again once a layer's products are taken
    half = ExpertStash(spec, tokens=10, budget=math.inf, dtype=torch.bfloat16)
    assert half.per_layer * 2 == s.per_layer
    H = spec.hidden_size
    assert reserved_bytes(spec, 10, torch.float32) == (spec.num_layers * 10 + spec.vocab_size) * H * 4


@pytest.mark.parametrize(("text", "value"), [("0", 0.0), ("2GB", 2e9), ("512MiB", 512 * 2**20), ("inf", math.inf)])
def test_budget_settings(text: str, value: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, text)
    assert activation_budget(None) == value


@pytest.mark.parametrize("text", ["lots", "-1GB", "infGB"])
def test_a_bad_budget_is_one_clear_usage_error(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, text)
    with pytest.raises(UsageError, match=ENV):
        activation_budget(None)


def test_the_default_is_capped_by_a_quarter_of_the_headroom_on_the_host_and_nothing_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(stash, "host_headroom", lambda: 8e9)
    assert activation_budget(None) == 2e9 and activation_budget("cpu:0") == 2e9
    assert activation_budget(None, reserved=4e9) == 1e9  # what the replay holds anyway comes off first
    assert activation_budget(None, reserved=9e9) == 0.0
    assert activation_budget(None, cap=5e8) == 5e8 and activation_budget(None, reserved=7e9, cap=5e8) == 2.5e8
    assert activation_budget("meta") == 0.0  # an accelerator: recomputed, its memory kept for the inputs


def test_the_default_keeps_no_more_than_the_stored_inputs_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ample memory the default does not follow the free memory: the products kept take at
    most what every layer's stored input takes, so the replay's activations at most double (the
    peak-memory figure of docs/benchmarks.md §2), and which layers keep them is the same on any
    machine with that much room."""
    monkeypatch.delenv(ENV, raising=False)
    # experts narrow enough (I = 12: a layer's products 2·k·I = 48 floats a token, the inputs L·H =
    # 96) that the cap keeps some layers' products and not others
    hfmodels.save_tiny(tmp_path / "mixtral", "mixtral", intermediate_size=12)
    ckpt = Checkpoint(tmp_path / "mixtral")
    spec, probe = ckpt.spec, _probe()
    tokens = probe.num_windows * probe.window_len
    inputs = stored_input_bytes(spec, tokens, torch.float32)
    assert inputs == spec.num_layers * tokens * spec.hidden_size * 4
    assert reserved_bytes(spec, tokens, torch.float32) == inputs + spec.vocab_size * spec.hidden_size * 4
    per_layer = ExpertStash(spec, tokens, 0.0, torch.float32).per_layer
    expect = min(len(spec.routed_layers), int(inputs // per_layer))
    assert 0 < expect < len(spec.routed_layers)  # the cap bites on this probe: some layers keep, some do not
    for headroom in (64e9, 1e12):
        monkeypatch.setattr(stash, "host_headroom", lambda h=headroom: h)
        assert default_budget(None, spec, tokens, torch.float32) == inputs
        kept = engine.replay(ckpt, probe.tokens).kept_layers
        assert list(kept) == list(spec.routed_layers[:expect]), (headroom, kept)
    reserved = reserved_bytes(spec, tokens, torch.float32)
    monkeypatch.setattr(stash, "host_headroom", lambda: reserved + 2 * inputs)  # a tight machine: the quarter binds
    assert default_budget(None, spec, tokens, torch.float32) == inputs / 2
    monkeypatch.setattr(stash, "host_headroom", lambda: 0.0)
    assert default_budget(None, spec, tokens, torch.float32) == 0.0
    assert engine.replay(ckpt, probe.tokens).kept_layers == []


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_the_headroom_respects_rlimit_data() -> None:
    """Under an RLIMIT_DATA cap the headroom is below the cap (the cap less the data segment);
    without one it is at most the machine's available memory."""
    assert 0 < host_headroom() <= stash._meminfo_available()
    cap = 3 * 2**30
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_DATA, ({cap}, {cap}))\n"
        "from moeaudit.replay.stash import host_headroom, _rlimit_headroom\n"
        "print(host_headroom(), _rlimit_headroom())\n"
    )
    if resource.getrlimit(resource.RLIMIT_DATA)[1] not in (resource.RLIM_INFINITY,) and (
        resource.getrlimit(resource.RLIMIT_DATA)[1] < cap
    ):
        pytest.skip("the hard RLIMIT_DATA is below the cap this test sets")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    headroom, rlimit = (float(v) for v in out.stdout.split())
    assert 0 < rlimit < cap and headroom <= rlimit
