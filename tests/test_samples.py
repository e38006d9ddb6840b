"""Sample runs (sample_checkpoints/README.md): deterministic, loadable by transformers, and the shipped
``sample_checkpoints/`` show what each run is meant to show — measured by replay, not read
from the README."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from moeaudit.canary import load as load_canary
from moeaudit.checkpoint import Checkpoint
from moeaudit.replay import replay
from moeaudit.samples.build import RUNS, build_samples, checkpoints, measure
from moeaudit.samples.data import DOMAINS, VOCAB, VOCAB_SIZE, Batches, Mix, decode, encode

SHIPPED = Path(__file__).resolve().parents[1] / "sample_checkpoints"
CONTINUED = ("frozen-drift", "sft-refine", "sft-repurpose")


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    seen: list[tuple[str, int, int]] = []
    built = build_samples(out, "tiny", progress=lambda *a: seen.append(a))
    assert set(built) == set(RUNS) and seen
    return out


# --- data ----------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_vocab() -> None:
    assert VOCAB_SIZE == len(VOCAB) <= 128
    text = "fn add3(x) {\n  return x * 2;\n}|id=12|\n"
    assert decode(encode(text)) == text
    with pytest.raises(ValueError, match="not in the sample vocabulary"):
        encode("é")


def test_batches_are_seeded_and_use_the_mix() -> None:
    a = Batches(Mix({"code": 1.0}), batch=4, seq_len=16, seed=3, stream_tokens=2000)
    b = Batches(Mix({"code": 1.0}), batch=4, seq_len=16, seed=3, stream_tokens=2000)
    first = a.next()
    assert torch.equal(first, b.next()) and first.shape == (4, 16)
    assert not torch.equal(a.next(), first)
    digits = Batches(Mix({"arithmetic": 1.0}), batch=4, seq_len=64, seed=0, stream_tokens=2000).next()
    assert "fn " not in decode(digits.flatten()) and "=" in decode(digits.flatten())


# --- the tiny build ------------------------------------------------------------------------------


def test_tiny_build_is_byte_identical(tiny: Path, tmp_path: Path) -> None:
    build_samples(tmp_path, "tiny")
    assert tree_hashes(tmp_path) == tree_hashes(tiny)


def test_tiny_run_directories(tiny: Path) -> None:
    canary = load_canary(tiny / "canary.safetensors")
    assert set(canary.domains) == set(DOMAINS)
    for run in RUNS:
        ckpts = checkpoints(tiny / run)
        assert len(ckpts) >= 2, run
        assert not list((tiny / run).glob("*.tmp")), "no half-written checkpoint is left"
        for ckpt in ckpts:
            state = json.loads((ckpt / "trainer_state.json").read_text())
            assert state["global_step"] == int(ckpt.name.split("-")[1])
            assert Checkpoint(ckpt).warnings == []
        steps = [json.loads(line)["step"] for line in (tiny / run / "metrics.jsonl").open()]
        assert steps == sorted(set(steps)) and steps
        probed = [json.loads(line) for line in (tiny / run / "canary_probe.jsonl").open()]
        assert [p["step"] for p in probed] == [int(c.name.split("-")[1]) for c in ckpts]
        assert {p["canary"] for p in probed} == {canary.digest}
    resume_events = [json.loads(x) for x in (tiny / "resume" / "events.jsonl").open()]
    assert [e["event"] for e in resume_events] == ["resume"]
    assert (tiny / "resume" / f"checkpoint-{resume_events[0]['step']}").is_dir()
    assert Checkpoint(checkpoints(tiny / "resume")[-1]).spec.shared_dim > 0
    for run in CONTINUED:
        (event,) = [json.loads(x) for x in (tiny / run / "events.jsonl").open()]
        assert event["event"] == "regime_change" and event["stage"] == "post-training"


@pytest.mark.parametrize("run", ["healthy", "resume", "deepseek"])  # mixtral, qwen2_moe, deepseek_v3
def test_tiny_checkpoint_loads_in_transformers(tiny: Path, run: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = checkpoints(tiny / run)[-1]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = load_canary(tiny / "canary.safetensors").tokens.long()
    with torch.no_grad():
        hf_loss = float(model(input_ids=tokens, labels=tokens).loss)
    ours = replay(Checkpoint(path), tokens, backward=False).nll
    assert ours == pytest.approx(hf_loss, rel=1e-4)


# --- the shipped samples -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped_canary():
    return load_canary(SHIPPED / "canary.safetensors")


def test_shipped_tree_and_size() -> None:
    total = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert total <= 40 * 2**20, f"sample_checkpoints is {total / 2**20:.1f} MiB"
    assert (SHIPPED / "canary.jsonl").is_file() and (SHIPPED / "README.md").is_file()
    for run in RUNS:
        ckpts = checkpoints(SHIPPED / run)
        assert 4 <= len(ckpts) <= 6, run
        assert all(int(c.name.split("-")[1]) % 250 == 0 for c in ckpts), run
        assert (SHIPPED / run / "metrics.jsonl").is_file()
        probed = [json.loads(line) for line in (SHIPPED / run / "canary_probe.jsonl").open()]
        assert [p["step"] for p in probed] == [int(c.name.split("-")[1]) for c in ckpts], run


def test_shipped_deepseek_is_balanced_by_its_bias_alone(shipped_canary) -> None:
    """No auxiliary loss in its metrics, every expert used at the end, and a selection bias
    that moved away from zero: the b_i ± γ balancer did the balancing."""
    run = SHIPPED / "deepseek"
    logged = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert all(m["loss"] == pytest.approx(m["lm_loss"]) for m in logged)
    last = checkpoints(run)[-1]
    stats = measure(last, shipped_canary)
    assert stats.dead == (0,) * len(stats.dead) and min(stats.entropy_norm) > 0.99
    ckpt = Checkpoint(last)
    assert ckpt.spec.family == "deepseek_v3" and ckpt.spec.routed_layers == (1, 2, 3)
    for i in ckpt.spec.routed_layers:
        bias = ckpt.layer_weights(i).params["router_bias"]
        assert 0.01 < float(bias.abs().max()) <= 1e-3 * 1500 + 1e-6  # |b| ≤ γ · steps


def test_shipped_healthy_uses_every_expert(shipped_canary) -> None:
    stats = measure(checkpoints(SHIPPED / "healthy")[-1], shipped_canary)
    assert stats.dead == (0,) * len(stats.dead)


def test_shipped_collapse_loses_half_its_experts_while_loss_falls(shipped_canary) -> None:
    ckpts = checkpoints(SHIPPED / "collapse")
    first, last = measure(ckpts[0], shipped_canary), measure(ckpts[-1], shipped_canary)
    E = Checkpoint(ckpts[-1]).spec.num_experts
    assert max(last.dead) >= E / 2
    assert sum(last.dead) > sum(first.dead), "collapse must happen during the run"
    assert last.nll < first.nll


def test_shipped_frozen_drift_narrows_while_loss_falls(shipped_canary) -> None:
    ckpts = checkpoints(SHIPPED / "frozen-drift")
    first, last = measure(ckpts[0], shipped_canary), measure(ckpts[-1], shipped_canary)
    assert sum(last.entropy_norm) < sum(first.entropy_norm)
    assert sum(last.c2) < sum(first.c2)
    # the LM loss on the shifted training mix falls (first vs. last 250 logged steps)
    logged = [json.loads(x) for x in (SHIPPED / "frozen-drift" / "metrics.jsonl").open()]
    lm = [r["lm_loss"] for r in logged]
    n = len([r for r in logged if r["step"] <= 250])
    assert sum(lm[-n:]) / n < sum(lm[:n]) / n - 0.02
