"""No replay dispatches an operator that torch refuses on CUDA in deterministic mode (docs/scaling.md,
"The GPU path: syncs, copies and the memory model"): float ``cumsum`` (Gated DeltaNet's chunk decays) would stop every
qwen3_next and qwen3_5_moe replay on a GPU. The operators are recorded on the CPU, for every registered
family, in everything the device branch runs on the device: the replay's forward and backward,
the pair receipts and greedy generation; ``moeaudit.replay.determinism`` holds torch's list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.policy import Policy
from moeaudit.replay.determinism import CUDA_RAISING, recording

pytest.importorskip("transformers")

import hfmodels  # noqa: E402

STANDIN = "cpu:0"


def _raising(block: Any) -> dict[str, str]:
    with recording() as rec:
        block()
    return rec.raising


@pytest.mark.parametrize("family", hfmodels.ALL)
def test_no_family_dispatches_an_operator_cuda_refuses(family: str, tmp_path: Path) -> None:
    from moeaudit.receipts.drift import bootstrap_for, pair_layer
    from moeaudit.receipts.state import run_state
    from moeaudit.replay.engine import greedy_generate, replay

    path = hfmodels.save_any(tmp_path / family, family)
    config = json.loads((path / "config.json").read_text())
    if config.get("max_position_embeddings", 70) < 70:  # the windows must fit the model's context
        config["max_position_embeddings"] = 70
        (path / "config.json").write_text(json.dumps(config))
    ckpt = Checkpoint(path)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, hfmodels.VOCAB, (2, 70), generator=g)  # 70 > DeltaNet's chunk of 64
    probe = canary_mod.Canary(tokens.int(), torch.zeros(2, dtype=torch.int32), ("all",))
    _, obs = run_state(ckpt, probe, Policy(), keep_states=True)
    layer = ckpt.spec.routed_layers[0]

    def pair() -> None:
        lw0, lw1 = (ckpt.layer_weights(layer, lazy_experts=True) for _ in range(2))
        boot = bootstrap_for(Policy().receipts, 2, layer)
        pair_layer(ckpt.spec, lw0, lw1, obs.states[layer], obs.states[layer], boot, device=STANDIN)

    assert _raising(lambda: replay(ckpt, tokens, device=STANDIN)) == {}
    assert _raising(pair) == {}
    assert _raising(lambda: greedy_generate(ckpt, tokens[:, :8], 1, device=STANDIN)) == {}


def test_the_guard_catches_the_cumsum_it_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With DeltaNet's prefix sum put back as a float cumsum, the recording names it."""
    from moeaudit.replay import deltanet
    from moeaudit.replay.engine import replay

    ckpt = Checkpoint(hfmodels.save_any(tmp_path / "qwen3_next", "qwen3_next"))
    tokens = torch.randint(0, hfmodels.VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(deltanet, "_prefix_sum", lambda x, lower: x.cumsum(-1))
    assert "aten.cumsum.default" in _raising(lambda: replay(ckpt, tokens))


@pytest.mark.parametrize(
    ("call", "flagged"),
    [
        (lambda: torch.ones(3).cumsum(0), True),
        (lambda: torch.arange(3).cumsum(0), False),  # integer cumsum has a deterministic kernel
        (lambda: torch.arange(3).cumsum(0, dtype=torch.float64), True),
        (lambda: torch.bincount(torch.tensor([1, 2])), False),
        (lambda: torch.bincount(torch.tensor([1, 2]), weights=torch.ones(2)), True),
        (lambda: torch.randn(5).median(), False),
        (lambda: torch.randn(5).median(0), True),  # with indices
        (lambda: F.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1])), True),  # nll_loss_forward
        (lambda: torch.zeros(3).scatter_reduce(0, torch.tensor([0, 0]), torch.ones(2), "prod"), True),
        (lambda: torch.zeros(3).scatter_reduce(0, torch.tensor([0, 0]), torch.ones(2), "sum"), False),
        (
            lambda: torch.ones(3, requires_grad=True).index_add(0, torch.tensor([0]), torch.ones(1)).sum().backward(),
            False,
        ),  # index_add: deterministic under the mode
    ],
)
def test_the_list_is_judged_per_call(call: Any, flagged: bool) -> None:
    assert bool(_raising(call)) is flagged


def test_every_entry_cites_the_docs() -> None:
    assert all(entry.documented.startswith("torch.") for entry in CUDA_RAISING.values())


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 7)])
def test_the_prefix_sum_is_a_float32_cumsum(shape: tuple[int, ...]) -> None:
    """Summed in float64 and rounded once, as the CPU's float32 cumsum accumulates: the same
    bits here; an infinite term reaches only the sums that include it (no 0·∞ = NaN)."""
    from moeaudit.replay.deltanet import _prefix_sum

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 10
    lower = torch.ones(shape[-1], shape[-1], dtype=torch.bool).tril()
    assert torch.equal(_prefix_sum(x, lower), x.cumsum(-1))
    x[..., 2] = float("-inf")
    assert torch.equal(_prefix_sum(x, lower), x.cumsum(-1))
