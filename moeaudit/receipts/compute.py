"""The audit's own compute: floating-point operations counted while a replay runs, and, on an
NVIDIA GPU, the energy NVML's counter says the device used meanwhile.

**FLOPs are counted, not estimated.** :class:`torch.utils.flop_counter.FlopCounterMode` sees
every operation the replay dispatches — the forward, the layer-local backward and its
recomputation, and the receipts' own products — and adds the FLOPs of each matrix product
(``mm``, ``addmm``, ``bmm``, ``baddbmm``: 2·m·n·k), convolution and attention kernel from the
shapes it actually ran with; routed experts therefore count the tokens the routing sent them,
not a nominal top-k. Elementwise work, reductions and the recurrent scans of DeltaNet/Mamba
mixers are not counted, and attention is counted without its causal mask (a full T×T product,
as torch's formula does). torch registers no formula for the CPU flash-attention kernel;
``CPU_ATTENTION`` adds torch's own scaled-dot-product formulas for it, so a replay counts the
same FLOPs on the CPU as on a GPU.

**Energy only where it is measured.** NVML's total-energy counter (``pynvml``, Volta and later)
is read before and after the replay on the GPU that ran it; the difference is the whole
device's energy over that interval (another process on the same GPU counts too). On a CPU,
without ``pynvml``, or where NVML refuses, the energy is ``None`` with the reason — never an
estimate.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import flop_counter

COUNTER = f"torch.utils.flop_counter.FlopCounterMode (torch {torch.__version__.split('+')[0]})"


# FlopCounterMode hands a custom formula the shapes of the arguments (its shape_wrapper)
def _cpu_sdpa(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(query, key, value))


def _cpu_sdpa_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_backward_flop_count(grad_out, query, key, value))


def _cpu_attention() -> dict[Any, Any]:
    ops = torch.ops.aten
    out: dict[Any, Any] = {}
    if hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        out[ops._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa
    if hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        out[ops._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_sdpa_backward
    return out


CPU_ATTENTION = _cpu_attention()


@dataclass
class Meter:
    """What one metered block used: ``flops`` (counted), ``energy_joules`` (None: not measured,
    ``energy_reason`` says why)."""

    device: str | None
    flops: int = 0
    energy_joules: float | None = None
    energy_reason: str = ""
    seconds: float = 0.0
    _start_mj: int | None = field(default=None, repr=False)

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"flops": self.flops, "energy_joules": self.energy_joules}
        if self.energy_joules is None:
            out["energy_reason"] = self.energy_reason
        return out


@contextmanager
def metered(device: str | None = None) -> Iterator[Meter]:
    """Count the FLOPs of everything run inside the block; on a CUDA ``device``, read NVML's
    energy counter around it."""
    meter = Meter(device)
    handle, why = _nvml_handle(device)
    meter.energy_reason = why
    start = _energy_mj(handle)
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
    t0 = time.perf_counter()
    with counter:
        yield meter
    if handle is not None:
        torch.cuda.synchronize(torch.device(str(device)))
    meter.seconds = time.perf_counter() - t0
    meter.flops = int(counter.get_total_flops())
    end = _energy_mj(handle)
    if start is not None and end is not None:
        meter.energy_joules = (end - start) / 1000.0
        meter.energy_reason = ""
    elif handle is not None:
        meter.energy_reason = "NVML did not return the GPU's total energy counter"


def _nvml_handle(device: str | None) -> tuple[Any, str]:
    """NVML's handle of the GPU ``device`` names, matched by its UUID (NVML numbers devices
    without CUDA_VISIBLE_DEVICES); else None and why energy is not measured."""
    if device is None or not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None, "not measured: the replay ran on the CPU, and NVML measures NVIDIA GPUs only"
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None, "not measured: pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
        index = torch.device(str(device)).index
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
        uuid = getattr(props, "uuid", None)
        if uuid is None:
            return None, "not measured: this torch does not name the GPU's UUID to match NVML's device"
        handle = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + str(uuid))
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # supported here (Volta and later)?
        return handle, ""
    except Exception as exc:  # pynvml.NVMLError and its many subclasses
        return None, f"not measured: NVML: {exc}"


def _energy_mj(handle: Any) -> int | None:
    if handle is None:
        return None
    try:
        import pynvml

        return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except Exception:
        return None


__all__ = ["COUNTER", "CPU_ATTENTION", "Meter", "metered"]
