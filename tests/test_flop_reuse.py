"""The audit's FLOPs metered once per shape (moeaudit/receipts/flop_reuse.py; docs/compliance.md,
"Measured quantities"): every count a replay carries equals the count metering that same replay
gives, on the shipped samples and on checkpoints of several families whose routing differs; where
the count depends on the routing (zero-computation experts) nothing is carried; the stash's
budget, which changes the FLOPs, is pinned to the reference's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit.checkpoint.checkpoint import Checkpoint
from moeaudit.policy import Policy
from moeaudit.receipts.compute import metered
from moeaudit.receipts.flop_reuse import FlopReuse, routing_dependent
from moeaudit.receipts.state import run_state
from moeaudit.replay.stash import ENV as STASH_ENV

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"


def _steps(run: Path) -> list[Path]:
    return sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def _replays(ckpts: list[Path], canary: Any) -> list[dict[str, Any]]:
    """Each checkpoint replayed as certify plans it, but always metered: the rule's entry
    (``entry``), the count metering gave (``metered``), the receipts and the stash layers."""
    policy = Policy()
    reuse = FlopReuse(None)
    out = []
    for path in ckpts:
        ckpt = Checkpoint(path)
        plan = reuse.plan(ckpt, canary, policy.to_json()["receipts"])
        with metered() as m:
            doc, obs = run_state(ckpt, canary, policy, stash_budget=plan.budget)
        entry = reuse.record(plan, f"{path.name}.json", m.record(), obs.kept_layers)
        out.append({"entry": entry, "metered": m.flops, "doc": doc, "kept": obs.kept_layers, "plan": plan})
    return out


def _occupancy(doc: dict[str, Any]) -> list[list[int]]:
    return [layer["occupancy"]["counts"] for layer in doc["layers"]]


@pytest.mark.parametrize("run", ["healthy", "deepseek", "resume", "collapse"])
def test_carried_counts_equal_the_metered_counts_on_the_samples(run: str) -> None:
    """mixtral (healthy, and collapse, whose routing collapses over the run), deepseek_v3 and
    qwen2_moe: the first replay is metered, the other five carry its count, and metering each of
    them gives exactly that count."""
    canary = canary_mod.load(SAMPLES / "canary.safetensors")
    got = _replays(_steps(SAMPLES / run), canary)
    first = got[0]["entry"]
    assert "flops_from" not in first and first["flops"] == got[0]["metered"] > 0
    for r in got[1:]:
        assert r["entry"]["flops_from"] == f"{_steps(SAMPLES / run)[0].name}.json"
        assert r["entry"]["flops"] == r["metered"] == got[0]["metered"]
    assert len({str(_occupancy(r["doc"])) for r in got}) == len(got)  # every checkpoint routes differently


def _tiny_canary(windows: int = 4, length: int = 16) -> canary_mod.Canary:
    import hfmodels

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, hfmodels.VOCAB, (windows, length), generator=gen, dtype=torch.int32)
    return canary_mod.Canary(tokens, torch.tensor([0, 1] * (windows // 2), dtype=torch.int32), ("a", "b"))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "qwen2_moe"])
def test_carried_counts_equal_the_metered_counts_across_seeds(family: str, tmp_path: Path) -> None:
    """Three tiny checkpoints of one architecture, weights from three seeds (so three routings):
    the counts the second and third carry are the ones metering them gives."""
    pytest.importorskip("transformers")
    import hfmodels

    paths = [tmp_path / f"checkpoint-{seed}" for seed in range(3)]
    for seed, p in enumerate(paths):
        hfmodels.save_tiny(p, family, seed=seed)
    got = _replays(paths, _tiny_canary())
    assert routing_dependent(Checkpoint(paths[0])) is None
    assert [r["entry"].get("flops_from") for r in got] == [None, "checkpoint-0.json", "checkpoint-0.json"]
    assert [r["entry"]["flops"] for r in got] == [r["metered"] for r in got] == [got[0]["metered"]] * 3
    assert len({str(_occupancy(r["doc"])) for r in got}) == 3


def _all_families() -> tuple[str, ...]:
    try:
        import hfmodels
    except ImportError:  # no transformers: the test skips
        return ()
    return tuple(hfmodels.ALL)


@pytest.mark.slow
@pytest.mark.parametrize("family", _all_families())
def test_every_family_carries_exactly_or_meters_every_replay(family: str, tmp_path: Path) -> None:
    """Every replayed family: a checkpoint and its copy with every matrix moved by 2 % of its
    spread (support.certify_families), which routes some tokens differently. The copy carries the
    first's count and metering it gives exactly that count — or, where the rule says the count
    follows the routing (zero-computation experts), both are metered and the counts differ."""
    pytest.importorskip("transformers")
    import hfmodels
    from support.certify_families import _nudged_copy

    first, second = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    hfmodels.save_any(first, family)
    _nudged_copy(first, second)
    got = _replays([first, second], _tiny_canary(8))
    assert _occupancy(got[0]["doc"]) != _occupancy(got[1]["doc"])
    if routing_dependent(Checkpoint(first)) is None:
        assert got[1]["entry"]["flops_from"] == "checkpoint-1.json"
        assert got[1]["entry"]["flops"] == got[1]["metered"] == got[0]["metered"]
    else:
        assert family == "longcat_flash" and "flops_from" not in got[1]["entry"]
        assert got[1]["entry"]["flops"] == got[1]["metered"] != got[0]["metered"]


def test_zero_computation_experts_are_metered_on_every_replay(tmp_path: Path) -> None:
    """LongCat-Flash: a slot routed to an identity expert costs no product, so the count follows
    the routing. Nothing is carried, and the counts do differ between seeds (the first's would
    have been wrong)."""
    pytest.importorskip("transformers")
    from hfmodels.longcat import save_longcat

    paths = [tmp_path / f"checkpoint-{seed}" for seed in range(3)]
    for seed, p in enumerate(paths):
        save_longcat(p, seed=seed)
    assert "zero-computation" in str(routing_dependent(Checkpoint(paths[0])))
    got = _replays(paths, _tiny_canary())
    assert all(r["plan"].meter and "flops_from" not in r["entry"] for r in got)
    assert [r["entry"]["flops"] for r in got] == [r["metered"] for r in got]
    assert len({r["metered"] for r in got}) > 1


def test_the_stash_budget_is_pinned_to_the_references(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer whose W1/W3 products were kept forms 2 products fewer in its backward:
    4·N·k·H·I FLOPs. A replay whose budget cannot keep what the reference kept is metered (and
    becomes a reference); one whose budget can runs with the reference's budget, keeps the same
    layers and carries its count."""
    pytest.importorskip("transformers")
    import hfmodels

    paths = [tmp_path / f"checkpoint-{seed}" for seed in range(3)]
    for seed, p in enumerate(paths):
        hfmodels.save_tiny(p, "mixtral", seed=seed)
    canary, policy = _tiny_canary(), Policy()
    reuse = FlopReuse(None)
    s = Checkpoint(paths[0]).spec
    got = []
    for path, budget in zip(paths, ["inf", "0", "1GB"], strict=True):
        monkeypatch.setenv(STASH_ENV, budget)
        ckpt = Checkpoint(path)
        plan = reuse.plan(ckpt, canary, policy.to_json()["receipts"])
        with metered() as m:
            _, obs = run_state(ckpt, canary, policy, stash_budget=plan.budget)
        got.append((reuse.record(plan, path.name, m.record(), obs.kept_layers), m.flops, obs.kept_layers))
    layers = list(s.routed_layers)
    assert [g[2] for g in got] == [layers, [], layers]
    assert [g[0].get("flops_from") for g in got] == [None, None, "checkpoint-0"]
    n = canary.num_windows * canary.window_len
    assert got[1][1] - got[0][1] == len(layers) * 4 * n * s.top_k * s.hidden_size * s.expert_dim
    assert got[2][0]["flops"] == got[2][1] == got[0][1]


def test_an_unmetered_block_counts_nothing_and_still_times() -> None:
    with metered(count=False) as m:
        torch.ones(3, 4) @ torch.ones(4, 5)
    assert m.flops == 0 and m.seconds > 0 and m.record()["energy_joules"] is None


def test_an_expert_parallel_replay_is_metered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 counts the rows routed to its own experts only: that follows the routing."""
    from moeaudit.replay import dist

    ckpt = Checkpoint(_steps(SAMPLES / "healthy")[0])
    assert routing_dependent(ckpt) is None
    monkeypatch.setattr(dist, "active", lambda: object())
    assert "expert-parallel" in str(routing_dependent(ckpt))
    plan = FlopReuse(None).plan(ckpt, canary_mod.load(SAMPLES / "canary.safetensors"), Policy().to_json()["receipts"])
    assert plan.meter and plan.key is None


def test_a_replay_that_kept_other_layers_than_its_reference_carries_nothing() -> None:
    """The stash keeps a prefix of the layers, so a replay run with its reference's budget keeps
    the same ones; were it not so, no count would be carried silently."""
    from moeaudit.receipts.flop_reuse import Plan, Reference

    ref = Reference("checkpoint-250.json", 123, (0, 1), 10)
    assert ref.budget == 20.0
    reuse = FlopReuse(None)
    carried = reuse.record(Plan(meter=False, budget=20.0, carry=ref), "checkpoint-500.json", {"flops": 0}, [0, 1])
    assert carried == {"flops": 123, "flops_from": "checkpoint-250.json"}
    with pytest.raises(RuntimeError, match="kept the W1/W3 products of layers \\[0\\]"):
        reuse.record(Plan(meter=False, budget=20.0, carry=ref), "checkpoint-500.json", {"flops": 0}, [0])
