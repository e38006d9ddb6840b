"""Host synchronisations and host↔device copies of the device branch, per layer, capped
(docs/scaling.md, "The GPU path: syncs, copies and the memory model"). Counted on the CPU by ``device_meter`` (a
stand-in device whose tensors are tagged; see its docstring for what counts as a sync). The caps do not grow with the
number of experts: a sync per expert — the backward's ``float(vector_norm(...))`` of each gradient, a
blocking copy of each expert's weights — multiplies by 256 on DeepSeek-V3. docs/scaling.md
records the counts before and after; ``python tests/test_host_syncs.py FAMILY...`` prints them.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.receipts.state import state_receipts

pytest.importorskip("transformers")

import hfmodels  # noqa: E402
from device_meter import STANDIN, Meter, measure  # noqa: E402
from support.host_syncs import CAP  # noqa: E402


def _probe() -> canary_mod.Canary:
    tokens = torch.randint(0, hfmodels.VOCAB, (4, 16), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    return canary_mod.Canary(tokens, torch.arange(4, dtype=torch.int32) % 2, ("code", "prose"))


def metered(path: Path) -> Meter:
    ckpt = Checkpoint(path)
    probe = _probe()
    return measure(ckpt, lambda tick: state_receipts(ckpt, probe, progress=tick, device=STANDIN))


def _routed(meter: Meter, ckpt: Checkpoint, phase: str) -> list[Counter[str]]:
    return [meter.counts[f"{phase} {i}"] for i in ckpt.spec.routed_layers]


@pytest.mark.parametrize("family", hfmodels.ALL)
def test_syncs_and_copies_per_layer_are_capped(family: str, tmp_path: Path) -> None:
    path = hfmodels.save_any(tmp_path / family, family)
    ckpt = Checkpoint(path)
    meter = metered(path)
    moa = 1 if ckpt.spec.settings.moa else 0  # JetMoE's attention: its tokens per attention expert (1 a pass)
    for phase in ("forward", "backward"):
        for i, counts in zip(ckpt.spec.routed_layers, _routed(meter, ckpt, phase), strict=True):
            for kind, cap in CAP[phase].items():
                assert counts[kind] <= cap + moa, (phase, i, kind, dict(counts))
    for phase in ("forward", "backward"):  # dense layers: no tap, no expert sweep
        for i in set(range(ckpt.spec.num_layers)) - set(ckpt.spec.routed_layers):
            assert meter.counts[f"{phase} {i}"]["sync"] <= 1, (phase, i)
    for kind, cap in CAP["head"].items():
        assert meter.counts["head"][kind] <= cap, dict(meter.counts["head"])
    assert meter.counts["between"]["sync"] == 0


def test_the_counts_do_not_grow_with_the_experts(tmp_path: Path) -> None:
    """Four times the experts: more copies (each expert's weights once per pass), not one more
    synchronisation; the copies to the device are queued, not waited for."""
    from hfmodels import save_tiny

    def counts(experts: int) -> tuple[Counter[str], Counter[str]]:
        path = tmp_path / f"e{experts}"
        save_tiny(path, "mixtral", num_local_experts=experts)
        meter = metered(path)
        return meter.counts["forward 1"], meter.counts["backward 1"]

    (f4, b4), (f16, b16) = counts(4), counts(16)
    assert (f4["sync"], b4["sync"]) == (f16["sync"], b16["sync"]) == (2, 2)
    assert f16["h2d"] > f4["h2d"] and b16["h2d"] > b4["h2d"]


def test_the_meter_sees_what_it_should() -> None:
    """A read of a device tensor is a sync, of a host tensor not; a blocking copy is one."""
    from device_meter import metering

    meter = Meter()
    with metering(meter):
        x = torch.ones(3).to(STANDIN, non_blocking=True)  # queued: no sync
        y = (x * 2).sum()
        float(y)  # sync
        float(torch.ones(()))  # host: nothing
        y.tolist()  # sync + a copy back
        x.cpu()  # a blocking copy back: sync
    assert dict(meter.counts["setup"]) == {"h2d": 1, "h2d_bytes": 12, "sync": 3, "d2h": 2, "d2h_bytes": 16}


def _table(families: list[str], root: Path) -> None:  # pragma: no cover - a measurement tool
    for family in families:
        path = hfmodels.save_any(root / family, family)
        ckpt = Checkpoint(path)
        meter = metered(path)
        for phase in ("forward", "backward"):
            c = _routed(meter, ckpt, phase)[0]
            print(f"{family:18} {phase:8} sync {c['sync']:3}  h2d {c['h2d']:3}  d2h {c['d2h']:3}")


if __name__ == "__main__":  # pragma: no cover
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _table(sys.argv[1:] or list(hfmodels.ALL), Path(tmp))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss", "llama4_text"])
def test_pair_receipts_sync_four_times_a_layer(family: str, tmp_path: Path) -> None:
    """Tokens per expert of each checkpoint's sweep (2), the per-token drift values (1), the
    per-expert weight sums (1)."""
    from device_meter import metering

    from moeaudit.policy import Policy
    from moeaudit.receipts.drift import bootstrap_for, pair_layer
    from moeaudit.receipts.state import run_state

    ckpt = Checkpoint(hfmodels.save_any(tmp_path / family, family))
    _, obs = run_state(ckpt, _probe(), Policy(), keep_states=True)
    layer = ckpt.spec.routed_layers[0]
    lw0, lw1 = (ckpt.layer_weights(layer, lazy_experts=True) for _ in range(2))
    meter = Meter()
    with metering(meter):
        pair_layer(
            ckpt.spec,
            lw0,
            lw1,
            obs.states[layer],
            obs.states[layer],
            bootstrap_for(Policy().receipts, 4, layer),
            device=STANDIN,
        )
    assert meter.counts["setup"]["sync"] == 4, dict(meter.counts["setup"])
