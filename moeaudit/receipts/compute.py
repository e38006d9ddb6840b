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
same FLOPs on the CPU as on a GPU. Nor does torch count ``torch._grouped_mm``, the bf16 experts'
grouped GEMM (``replay.precision``); ``GROUPED_PRODUCTS`` counts it as the per-expert matmuls it
replaces.

**Energy only where it is measured.** NVML's total-energy counter (``pynvml``, Volta and later)
is read before and after the replay on the GPU that ran it; the difference is the whole
device's energy over that interval (another process on the same GPU counts too). On a CPU,
without ``pynvml``, or where NVML refuses, the energy is ``None`` with the reason — never an
estimate.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
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


def _grouped_mm(a: Any, b: Any, *args: Any, **kwargs: Any) -> int:
    """``torch._grouped_mm`` (the bf16 experts' grouped GEMM, ``replay.precision``), for which torch
    registers no formula: 2 · contraction · output elements, summed over the groups, as the
    per-expert matmuls it replaces count. a [M, K] × b [G, K, N] (row groups): 2·M·K·N;
    a [K, M] × b [M, N] (groups along M, a weight gradient): 2·K·M·N; a [G, M, K] × b [G, K, N]:
    2·G·M·K·N; a [G, M, K] × b [K, N] (groups along N): 2·M·K·N."""
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 3:
        return 2 * a[1] * a[2] * b[-1]
    return 2 * a[0] * a[1] * b[-1]


def _products() -> dict[Any, Any]:
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    return {} if op is None else {op: _grouped_mm}


GROUPED_PRODUCTS = _products()
FORMULAS = {**CPU_ATTENTION, **GROUPED_PRODUCTS}  # what metered adds to torch's own formulas


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
def metered(device: str | None = None, *, count: bool = True) -> Iterator[Meter]:
    """Count the FLOPs of everything run inside the block; on a CUDA ``device``, read NVML's
    energy counter around it. ``count=False`` reads the energy and the time only (``flops``
    stays 0): for a replay whose count is carried (``receipts.flop_reuse``)."""
    meter = Meter(device)
    handle, why = _nvml_handle(device)
    meter.energy_reason = why
    start = _energy_mj(handle)
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=FORMULAS) if count else None
    t0 = time.perf_counter()
    with counter if counter is not None else nullcontext():
        yield meter
    if handle is not None:
        torch.cuda.synchronize(torch.device(str(device)))
    meter.seconds = time.perf_counter() - t0
    meter.flops = int(counter.get_total_flops()) if counter is not None else 0
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


__all__ = ["COUNTER", "CPU_ATTENTION", "FORMULAS", "GROUPED_PRODUCTS", "Meter", "metered"]
