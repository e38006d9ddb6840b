"""``device``: the replay computes on an accelerator one layer at a time and hands receipts back
on the host (issue 6, item 5). The CPU path is the reference: asking for "cpu" explicitly must
change no byte; the CUDA tests run only where a GPU exists."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.receipts.state import state_receipts

VOCAB = 96  # hf_models.VOCAB

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture()
def inputs(hf_checkpoint: Any, tmp_path: Path) -> tuple[Checkpoint, canary_mod.Canary]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=g, dtype=torch.int32)
    probe = canary_mod.Canary(tokens, torch.arange(4, dtype=torch.int32) % 2, ("code", "prose"))
    return Checkpoint(hf_checkpoint("mixtral")), probe


def _numbers(doc: Any, path: str = "") -> dict[str, float]:
    """Every float of a receipts document, by its path."""
    if isinstance(doc, dict):
        return {k: v for key, val in doc.items() for k, v in _numbers(val, f"{path}/{key}").items()}
    if isinstance(doc, list):
        return {k: v for i, val in enumerate(doc) for k, v in _numbers(val, f"{path}/{i}").items()}
    return {path: float(doc)} if isinstance(doc, float) else {}


def test_explicit_cpu_is_the_default(inputs: tuple[Checkpoint, canary_mod.Canary]) -> None:
    ckpt, probe = inputs
    assert state_receipts(ckpt, probe, device="cpu") == state_receipts(ckpt, probe)


@cuda
def test_cuda_receipts_match_cpu(inputs: tuple[Checkpoint, canary_mod.Canary]) -> None:
    ckpt, probe = inputs
    on_cpu, on_gpu = state_receipts(ckpt, probe), state_receipts(ckpt, probe, device="cuda")
    assert on_gpu["environment"]["device"] == "cuda"
    for layer_cpu, layer_gpu in zip(on_cpu["layers"], on_gpu["layers"], strict=True):
        assert layer_cpu["occupancy"]["counts"] == layer_gpu["occupancy"]["counts"]
    cpu_numbers, gpu_numbers = _numbers(on_cpu), _numbers(on_gpu)
    assert math.isclose(cpu_numbers["/nll"], gpu_numbers["/nll"], rel_tol=1e-5)
    for path in ("/predictive_entropy", "/pooled/gradients/grad_mean"):
        assert math.isclose(cpu_numbers[path], gpu_numbers[path], rel_tol=1e-4), path


@cuda
def test_cuda_receipts_are_deterministic(inputs: tuple[Checkpoint, canary_mod.Canary]) -> None:
    ckpt, probe = inputs
    assert state_receipts(ckpt, probe, device="cuda") == state_receipts(ckpt, probe, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("command", ["receipts", "certify"])
def test_cuda_without_a_gpu_is_a_usage_error(command: str, tmp_path: Path) -> None:
    """Exit 2, one line naming the option, nothing written."""
    from click.testing import CliRunner

    from moeaudit.cli import cli

    samples = Path(__file__).resolve().parents[1] / "sample_checkpoints"
    target = samples / "healthy" / ("checkpoint-250" if command == "receipts" else "")
    out = ["--json", str(tmp_path / "r.json")] if command == "receipts" else [
        "--out", str(tmp_path / "cert")]
    result = CliRunner().invoke(cli, [command, str(target), "--device", "cuda", *out])
    assert result.exit_code == 2
    assert "--device" in result.output and "CUDA is not available" in result.output
    assert list(tmp_path.iterdir()) == []
