"""What a replay does to the process, and what its cache entries are keyed by (docs/decisions.md, "The GPU
model is in the cache key").

A replay needs deterministic kernels and IEEE float32 products (no TF32); it sets them for its
own duration and gives the caller's settings back — moeaudit runs inside training processes.
Cache entries are bit-identical per machine (device model, driver, CUDA, torch), so that is
in their key.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit.cache import ReceiptsCache, cpu_capability, replay_machine
from moeaudit.checkpoint import Checkpoint
from moeaudit.replay.device import _fp32_backends, replay_scope
from moeaudit.replay.engine import replay

SAMPLES = Path(__file__).resolve().parents[1] / "sample_checkpoints"
FORCED_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY")  # as torch saw it at import
needs_samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


def _precisions() -> dict[str, str]:
    return {repr(b): b.fp32_precision for b in _fp32_backends()}


@pytest.fixture()
def restore_torch_settings() -> Iterator[None]:
    """What the tests below change on purpose, put back."""
    saved = _precisions()
    legacy = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    for b in _fp32_backends():
        b.fp32_precision = saved[repr(b)]
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy


@needs_samples
@pytest.mark.parametrize("device", [None, "cpu:0"])
def test_a_callers_matmul_precision_survives_a_replay(device: str | None, restore_torch_settings: None) -> None:
    """``torch.set_float32_matmul_precision("high")`` before, the same after (no RuntimeError
    for mixing torch's TF32 APIs); inside, every float32 product is IEEE and deterministic."""
    torch.set_float32_matmul_precision("high")
    before = _precisions()
    inside: list[tuple[set[str], bool]] = []
    ckpt = Checkpoint(SAMPLES / "healthy" / "checkpoint-250")
    tokens = canary_mod.load(SAMPLES / "canary.safetensors").tokens[:2]
    replay(
        ckpt,
        tokens,
        device=device,
        observers=[
            lambda *_: inside.append((set(_precisions().values()), torch.are_deterministic_algorithms_enabled()))
        ],
    )
    assert inside and all(p == {"ieee"} and det for p, det in inside)
    assert torch.get_float32_matmul_precision() == "high"
    assert _precisions() == before and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("api", ["new", "legacy", "none"])
def test_the_cuda_scope_restores_what_it_found(
    api: str, restore_torch_settings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA settings (cuBLAS workspace, TF32 off on cuBLAS and cuDNN) scoped to the replay,
    whichever of torch's APIs the caller used; they can be set and read without a GPU."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    if api == "new":
        torch.set_float32_matmul_precision("high")
    elif api == "legacy":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    before = _precisions()
    with replay_scope(torch.device("cuda", 0)):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert set(_precisions().values()) == {"ieee"}
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert _precisions() == before
    torch.get_float32_matmul_precision()  # no RuntimeError: the APIs were not mixed
    if api == "legacy":
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_a_callers_cublas_workspace_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with replay_scope("cuda:0"):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


# ----- cache key ----------------------------------------------------------------------------


def test_the_cpu_description_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read without importing torch, it names the kernel level torch itself reports."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    machine = replay_machine(None)
    assert machine == {"device": "cpu", "torch": torch.__version__, "cpu": cpu_capability()}
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86 and Path("/proc/cpuinfo").is_file() and not FORCED_CAPABILITY:
        assert cpu_capability() == f"{platform.machine().lower()} {torch.backends.cpu.get_cpu_capability()}"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_capability().endswith(" AVX2")


def _key(device: str | None) -> str:
    from moeaudit.certify import _Replayer
    from moeaudit.policy import Policy

    class Ckpt:
        digest = "0" * 64

    probe = canary_mod.Canary(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), ("x",))
    replayer = _Replayer(probe, Policy(), ReceiptsCache(enabled=False), lambda _m: None, 1, device)
    return replayer._key("receipts", Ckpt())


def test_the_cache_key_changes_with_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU model, driver, CUDA and torch versions all change the key (a stand-in GPU: nothing
    here runs on one), and so do torch and the CPU's kernel level on the CPU."""
    import moeaudit.cache as cache
    import moeaudit.replay.device as device

    gpu = {
        "device": "cuda:0",
        "torch": "2.13.0",
        "gpu": "NVIDIA H100 80GB HBM3",
        "capability": "sm_90",
        "cuda": "12.8",
        "driver": "12080",
        "cudnn": "91000",
    }
    described: dict[str, Any] = dict(gpu)
    monkeypatch.setattr(device, "describe_device", lambda _d: dict(described))
    keys = {_key("cuda:0")}
    for field, other in (
        ("gpu", "NVIDIA A100-SXM4-80GB"),
        ("capability", "sm_80"),
        ("driver", "12040"),
        ("cuda", "12.6"),
        ("cudnn", "90100"),
        ("torch", "2.12.0"),
    ):
        described.update(gpu, **{field: other})
        keys.add(_key("cuda:0"))
    assert len(keys) == 7
    assert _key(None) == _key(None) != _key("cpu:0")
    cpu = _key(None)
    monkeypatch.setattr(cache, "_torch_version", lambda: "2.12.0")
    assert _key(None) != cpu
    monkeypatch.undo()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert _key(None) != cpu
