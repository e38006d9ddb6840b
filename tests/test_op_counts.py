"""Operators per routed layer, capped (docs/scaling.md, "Operators per routed layer"). On a GPU
each aten operator is a kernel launch, and a layer whose launches each do little work is bound by
the launches: what a layer dispatches per expert multiplies by the experts it hits (256 on
DeepSeek-V3), and what it dispatches per token by the canary's length. Counted on the CPU by
``support.op_counts`` (a ``TorchDispatchMode``; views and allocations left out, and on the
device branch only the operators on the stand-in device: see its docstring).

A routed layer's operators are its sweeps over the experts (``experts_forward_sets`` in the
forward, ``experts_backward`` in the backward, and in the backward of some layers the forward
sweep again) plus the rest (attention, router, receipts, autograd's part). Per layer:

    ops ≤ REST[phase] + Σ_sweeps (FIXED + READ·read + EVAL·evaluations)    forward sweep
                                 (FIXED + GRAD·hit)                        backward sweep

with ``read`` the experts the sweep fetches, ``evaluations`` its (expert, index set) pairs —
the top-k set and the overlap receipts' candidates and random expert — and ``hit`` the
experts the top-k set sends tokens to. The rest does not depend on the experts hit, the tokens,
the windows or the width (checked exactly, but for the loops over tokens named below);
``python tests/test_op_counts.py FAMILY...`` prints the counts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.receipts.state import state_receipts
from moeaudit.replay.blocks import experts as experts_mod

pytest.importorskip("transformers")

import hfmodels  # noqa: E402
from device_meter import STANDIN  # noqa: E402
from support.op_counts import OpMeter, Sweep, measure_ops  # noqa: E402

# Operators per expert of a sweep, by the kind of expert (measured on the device branch, float32
# weights as the tiny models store them):
#   READ  per expert fetched: one copy to the device per stored tensor (W1, W3, W2; gpt-oss also
#         its three biases; Nemotron-H's ReLU² has no W3);
#   EVAL  per (expert, index set) the forward evaluates: gather its rows, the MLP's products and
#         activation, write its rows back;
#   GRAD  per expert hit in the backward: gather its rows, the hand-written backward of the MLP,
#         scatter dL/dy and dL/dc, the three (six) gradient norms and their sum of squares.
# Counted with no expert products kept for the backward (``_nothing_kept``): a SwiGLU expert's
# backward forms W1 x and W3 x again (two operators a kept layer does not dispatch).
KINDS: dict[str, tuple[int, int, int]] = {  # kind: (READ, EVAL, GRAD)
    "swiglu": (3, 7, 38),
    "relu2": (2, 6, 24),  # Nemotron-H
    "scaled": (3, 13, 43),  # Llama 4: input scaled by the combine weight, output divided by it
    "clamped": (3, 12, 50),  # HY-V4, Step 3.5: clamped SwiGLU
    "clamped_biased": (6, 12, 67),  # gpt-oss: clamped GLU with biases
}
# a sweep's own operators: the slot order of each index set and the tokens per expert (forward:
# 1 + 4 per set, i.e. 13 for the three sets of a receipts replay; backward 9: the slot order,
# dL/dy, dL/dc and the norms' vector)
FIXED = {"experts_forward_sets": 13, "experts_backward": 9}
# the rest of a routed layer (attention or mixer, router, norms, receipts, autograd), at most, over
# every family's routed layers (largest measured: forward 1079, hy_v4_vl; backward 386, jamba at
# 48 tokens a window)
REST = {"forward": 1120, "backward": 400}
# the margins: a regression of two operators per expert fails, and of one per (expert, set) where
# the sweep evaluates more sets than one (the forward of a receipts replay: three)
MARGIN_FIXED, MARGIN_PER_EXPERT = 2, 1
# families whose mixer steps through the tokens in a Python loop, so that their operators grow
# with the canary's length: Mamba-1's recurrence, one token at a time (replay/mamba.py), and
# MiniMax's lightning attention, one block of tokens at a time (replay/lightning.py)
TOKEN_LOOPS = ("jamba", "minimax")

TOKENS = (16, 48)  # tokens per window of the two probes (4 windows each)


# the overlap receipts take their per-token values 1024 tokens at a time (receipts/overlap.py,
# TOKEN_CHUNK), a step of at most this many forward operators per further 1024 tokens
OVERLAP_CHUNK = 60


@pytest.fixture(autouse=True)
def _nothing_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """No expert products kept for the backward (``replay.stash``): a GPU's default, and the
    counts then do not depend on the host's budget (which keeps some layers' and not others')."""
    monkeypatch.setenv("MOEAUDIT_ACTIVATION_BUDGET", "0")


def _probe(tokens: int, windows: int = 4) -> canary_mod.Canary:
    gen = torch.Generator().manual_seed(5)
    t = torch.randint(0, hfmodels.VOCAB, (windows, tokens), generator=gen, dtype=torch.int32)
    return canary_mod.Canary(t, torch.arange(windows, dtype=torch.int32) % 2, ("code", "prose"))


def metered(ckpt: Checkpoint, tokens: int, device_branch: bool = True, windows: int = 4) -> OpMeter:
    probe = _probe(tokens, windows)
    return measure_ops(
        ckpt,
        lambda tick: state_receipts(ckpt, probe, progress=tick, device=STANDIN if device_branch else None),
        device_branch,
    )


def expert_kind(ckpt: Checkpoint, layer: int) -> str:
    experts = ckpt.layer_weights(layer, lazy_experts=True).experts
    names = set().union(*(experts[e].keys() for e in range(len(experts))))
    if "w3" not in names:
        return "relu2"
    if ckpt.spec.moe.scaled_inputs:
        return "scaled"
    if ckpt.spec.expert_glu(layer) is not None:
        return "clamped_biased" if "b1" in names else "clamped"
    return "swiglu"


def sweep_cap(sweep: Sweep, kind: str, margins: bool = True) -> int:
    read, evaluate, grad = KINDS[kind]
    per_expert = MARGIN_PER_EXPERT if margins else 0
    cap = FIXED[sweep.fn] + (MARGIN_FIXED if margins else 0)
    if sweep.fn == "experts_forward_sets":
        return cap + (read + per_expert) * sweep.read + evaluate * sum(sweep.sets)
    return cap + (grad + per_expert) * sweep.hit


def rest(meter: OpMeter, label: str) -> int:
    return meter.ops(label) - sum(s.ops for s in meter.sweeps_of(label))


def violations(ckpt: Checkpoint, meter: OpMeter) -> list[str]:
    """The routed layers whose operators exceed the caps, one line each."""
    out = []
    for layer in ckpt.spec.routed_layers:
        kind = expert_kind(ckpt, layer)
        for phase in ("forward", "backward"):
            label = f"{phase} {layer}"
            sweeps = meter.sweeps_of(label)
            if not any(s.fn == ("experts_forward_sets" if phase == "forward" else "experts_backward") for s in sweeps):
                out.append(f"{label}: no sweep over the experts seen")
            for s in sweeps:
                if s.ops > sweep_cap(s, kind):
                    out.append(f"{label}: {s.fn} ({kind}, sets {s.sets}, read {s.read}) {s.ops} > {sweep_cap(s, kind)}")
            if rest(meter, label) > REST[phase]:
                out.append(f"{label}: {rest(meter, label)} operators besides the sweeps > {REST[phase]}")
    return out


def _key(s: Sweep) -> tuple[Any, ...]:
    return s.fn, tuple(s.sets), s.read


@pytest.mark.parametrize("family", hfmodels.ALL)
def test_operators_per_routed_layer_are_capped(family: str, tmp_path: Path) -> None:
    """The caps at two canary lengths, and the counts independent of the length: the rest of
    each layer the same, and each sweep the same wherever it hits the same experts, or else
    off its kind's operators per expert by the same amount (its fixed part)."""
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / family, family))
    short, long = (metered(ckpt, t) for t in TOKENS)
    assert violations(ckpt, short) == [] and violations(ckpt, long) == []
    assert not short.views and not long.views, "views NO_KERNEL does not list"
    grew = []
    for layer in ckpt.spec.routed_layers:
        kind = expert_kind(ckpt, layer)
        for phase in ("forward", "backward"):
            label = f"{phase} {layer}"
            if rest(short, label) != rest(long, label):
                grew.append(label)
            for a, b in zip(short.sweeps_of(label), long.sweeps_of(label), strict=True):
                if _key(a) == _key(b):
                    assert a.ops == b.ops, (label, a, b)
                else:
                    off = [s.ops - sweep_cap(s, kind, margins=False) for s in (a, b)]
                    assert off[0] == off[1], (label, a, b)
    if family in TOKEN_LOOPS:
        assert grew, f"{family} no longer grows with the tokens: take it out of TOKEN_LOOPS"
    else:
        assert grew == [], grew


def test_the_counts_grow_by_the_experts_hit_only(tmp_path: Path) -> None:
    """Mixtral with 4 and with 16 experts, every expert hit by every index set at 48 tokens a
    window: the sweeps grow by their per-expert operators and the rest of the layer not at all —
    on the device branch. On the default path, which copies nothing (READ is 0), the forward's
    rest also checks each expert's stored tensors finite (``replay.finite.all_finite``: 5
    operators a tensor), work the device branch leaves to the host."""

    def counts(experts: int, device_branch: bool) -> tuple[OpMeter, Checkpoint]:
        path = tmp_path / f"e{experts}"
        if not path.exists():
            hfmodels.save_tiny(path, "mixtral", num_local_experts=experts)
        ckpt = Checkpoint(path)
        return metered(ckpt, 48, device_branch), ckpt

    read, evaluate, grad = KINDS["swiglu"]
    for device_branch in (True, False):
        (m4, ckpt), (m16, _) = counts(4, device_branch), counts(16, device_branch)
        for layer in ckpt.spec.routed_layers:
            for phase in ("forward", "backward"):
                label = f"{phase} {layer}"
                (s4,), (s16,) = m4.sweeps_of(label), m16.sweeps_of(label)
                assert (s4.sets, s16.sets) == ([4] * len(s4.sets), [16] * len(s16.sets)), label
                finite = 0 if device_branch or phase == "backward" else 5 * read * 12
                assert rest(m16, label) - rest(m4, label) == finite, label
                per_expert = (s16.ops - s4.ops) / 12
                if phase == "forward":
                    assert per_expert == (read if device_branch else 0) + evaluate * len(s4.sets), label
                else:
                    assert per_expert == grad - (0 if device_branch else read), label


def test_the_counts_do_not_grow_with_the_width(tmp_path: Path) -> None:
    """Twice the hidden size: the same operators, layer for layer."""
    meters = []
    for hidden in (32, 64):
        path = tmp_path / f"h{hidden}"
        hfmodels.save_tiny(path, "mixtral", hidden_size=hidden)
        meters.append(metered(Checkpoint(path), 16))
    a, b = meters
    assert {k: sum(v.values()) for k, v in a.counts.items()} == {k: sum(v.values()) for k, v in b.counts.items()}


def test_the_counts_do_not_grow_with_the_windows(tmp_path: Path) -> None:
    """4, 8 and 24 windows: the same operators, but for the overlap receipts' second chunk of
    1024 tokens (24 windows of 48 tokens are 1152), one step in the forward."""
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / "mixtral", "mixtral"))
    (w4, w8), w24 = (metered(ckpt, 16, windows=w) for w in (4, 8)), metered(ckpt, 48, windows=24)
    assert w4.counts == w8.counts
    for layer in ckpt.spec.routed_layers:
        assert 0 < rest(w24, f"forward {layer}") - rest(w4, f"forward {layer}") <= OVERLAP_CHUNK
        assert rest(w24, f"backward {layer}") == rest(w4, f"backward {layer}")


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_extra_operator_per_expert_is_caught(phase: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caps are tight enough to catch a regression of a few operators per expert: one more
    per (expert, set) the forward evaluates outside the kept path (the MLP's output copied), two
    more per expert in the backward (its sum of squares scaled by 1 and shifted by 0)."""
    ckpt = Checkpoint(hfmodels.save_any(tmp_path / "mixtral", "mixtral"))
    assert violations(ckpt, metered(ckpt, 16)) == []
    if phase == "forward":
        mlp = experts_mod.expert_mlp
        monkeypatch.setattr(experts_mod, "expert_mlp", lambda *a: mlp(*a).clone())
    else:
        sos = experts_mod._sum_of_squares
        monkeypatch.setattr(experts_mod, "_sum_of_squares", lambda norms: sos(norms) * 1.0 + 0.0)
    found = violations(ckpt, metered(ckpt, 16))
    assert found and all(line.startswith(phase) for line in found), found


def _table(families: list[str], root: Path) -> None:  # pragma: no cover - a measurement tool
    for family in families:
        ckpt = Checkpoint(hfmodels.save_any(root / family, family))
        for tokens in TOKENS:
            meter = metered(ckpt, tokens)
            for phase in ("forward", "backward"):
                label = f"{phase} {ckpt.spec.routed_layers[0]}"
                sweeps = "  ".join(f"{s.fn[8:]} sets {s.sets} read {s.read}: {s.ops}" for s in meter.sweeps_of(label))
                print(
                    f"{family:18} T {tokens:2} {label:11} ops {meter.ops(label):5}  rest {rest(meter, label):5}  "
                    f"{sweeps}  [{expert_kind(ckpt, ckpt.spec.routed_layers[0])}]"
                )


if __name__ == "__main__":  # pragma: no cover
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _table(sys.argv[1:] or list(hfmodels.ALL), Path(tmp))
