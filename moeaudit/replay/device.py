"""Where a replay computes (``--device``), and the process settings it computes under.

Two paths. ``device=None`` is the default: everything on the host, no copies at all. Any
explicit device — ``"cuda"``, and the CPU too (``"cpu"``, ``"cpu:0"``) — takes the *device
branch*: each layer's weights are copied there (experts one at a time, converted there), the
layer is computed there, and the taps come back to the host in one batch of copies per layer.
On the CPU the copies are no-ops, so CI runs the device branch of every family and checks that
it gives the default path's receipts (tests/test_device.py).

Settings (docs/glossary.md, "Replay": deterministic, float32): ``replay_scope`` turns on
``torch.use_deterministic_algorithms(True)``, IEEE float32 products on every backend (no TF32 on
cuBLAS / cuDNN, no reduced-precision oneDNN on the CPU) and, on CUDA, cuBLAS's fixed workspace
— for the duration of the replay only, then the caller's settings back: moeaudit runs inside
training processes too (the hook, library use), whose torch flags it must not change
(docs/scaling.md, "The GPU path: syncs, copies and the memory model"). Only the per-backend ``fp32_precision`` API is
touched: mixing it with the legacy ``allow_tf32`` flags makes torch raise on the caller's next
``get_float32_matmul_precision``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights, StoredExperts
from moeaudit.precision import current

Device = torch.device | str | None  # None: the host, with no copies at all
HOST = torch.device("cpu")
CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace (CUDA docs, "Results reproducibility")


def prepare_device(device: Device) -> torch.device | None:
    """None for the default path; any explicit device (the CPU included) resolved for the
    device branch, a bare ``cuda`` to the index it will run on."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_name(device: Device) -> str:
    """The name receipts record for the device that computed them ("cpu" on the default path)."""
    dev = prepare_device(device)
    return "cpu" if dev is None else str(dev)


def describe_device(device: Device) -> dict[str, str]:
    """What a replay on an accelerator depends on besides its inputs (the cache key:
    docs/decisions.md, "The GPU model is in the cache key"): its name, model, compute capability, the CUDA runtime torch
    was built with, the driver's CUDA version, cuDNN and torch. (The CPU's: :func:`moeaudit.cache.replay_machine`.)"""
    dev = prepare_device(device)
    assert dev is not None and dev.type != "cpu"
    out = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        out.update(
            gpu=torch.cuda.get_device_name(dev),
            capability=f"sm_{major}{minor}",
            cuda=str(torch.version.cuda),
            driver=_cuda_driver(),
            cudnn=str(torch.backends.cudnn.version()),
        )
    return out


def _cuda_driver() -> str:
    """The driver's CUDA version (``cuDriverGetVersion``, e.g. "12080"), "unknown" if unreadable."""
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except (OSError, AttributeError):
        pass
    return "unknown"


def moved(obj: Any, device: Device, non_blocking: bool = False) -> Any:
    """``obj`` with every tensor in it (dicts, taps, routings) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: moved(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(moved(v, device, non_blocking) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj,
            **{f.name: moved(getattr(obj, f.name), device, non_blocking) for f in dataclasses.fields(obj) if f.init},
        )
    return obj


def to_host(obj: Any, device: Device) -> Any:
    """``obj`` copied to the host: every copy queued (non-blocking: into pinned memory), then one
    wait for them all — one synchronisation per call, however many tensors ``obj`` holds."""
    out = moved(obj, HOST, non_blocking=True)
    synchronize(device)
    return out


def synchronize(device: Device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    dev = prepare_device(device)
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)


def to_device(t: torch.Tensor, device: Device) -> torch.Tensor:
    """``t`` copied to ``device`` without a stream synchronisation: from pageable memory CUDA
    stages the bytes before the call returns (so the source may go at once), and kernels queued
    after it on the stream see them; a blocking copy would also wait for every kernel queued
    before it — once per expert, draining the GPU's queue each time (docs/decisions.md, "The GPU path: receipts on the
    device, copies ahead, inputs offloaded")."""
    return t.to(device, non_blocking=True)


class DeviceExperts(Sequence[dict[str, torch.Tensor]]):
    """A layer's experts on a device, one at a time: expert e's stored bytes are copied over and
    converted there (the host keeps the on-disk dtype: bf16 as bf16, block-scaled FP8 as float8
    bytes with their scales, MXFP4 as codes and exponents — ``StoredExperts`` and its kinds), so
    what crosses is what the file stores, and float32 exists only on the device.

    Double-buffered (docs/decisions.md, "The GPU path: receipts on the device, copies ahead, inputs
    offloaded"): a sweep that says which experts it will read, in order (:func:`announce`; ``experts_forward_sets`` and
    ``experts_backward`` do), gets the copy of the next expert started when it reads one, so that expert e+1's bytes
    cross while e computes; at most two experts' stored bytes are on the device. On CUDA the copies come from
    pinned host memory on a side stream (``non_blocking``: the DMA overlaps the compute stream's
    kernels), which the compute stream waits for, by an event, only when it reads that expert.
    Elsewhere (the CPU, ``cpu:0`` standing in for a device) nothing is pinned — pinning needs an
    accelerator — and the copies are the plain queued ones. ``sent`` lists the experts whose
    bytes were sent, in order, and ``early`` those that were sent before they were read."""

    def __init__(self, experts: Sequence[dict[str, torch.Tensor]], device: Device):
        self.experts, self.device = experts, device
        dev = prepare_device(device)
        self._cuda = dev is not None and dev.type == "cuda"
        self._stream: Any = torch.cuda.Stream(dev) if self._cuda else None
        self._plan: list[int] = []
        self._ahead: tuple[int, dict[str, torch.Tensor], Any] | None = None  # (expert, tensors, event)
        self.sent: list[int] = []
        self.early: list[int] = []

    def __len__(self) -> int:
        return len(self.experts)

    def visit(self, order: Sequence[int]) -> None:
        """The experts the caller reads next, in this order (each once)."""
        self._plan, self._ahead = list(order), None

    def _stored(self, e: int) -> dict[str, torch.Tensor]:
        """What crosses for expert e: its stored tensors (converted on the device after)."""
        if isinstance(self.experts, StoredExperts):
            return self.experts.stored[e]
        return self.experts[e]

    def _send(self, e: int) -> tuple[dict[str, torch.Tensor], Any]:
        self.sent.append(e)
        stored = self._stored(e)
        if not self._cuda:
            return {n: to_device(t, self.device) for n, t in stored.items()}, None
        with torch.cuda.stream(self._stream):  # pinned staging, then the DMA on the side stream
            out = {n: t.pin_memory().to(self.device, non_blocking=True) for n, t in stored.items()}
            done = torch.cuda.Event()
            done.record(self._stream)
        return out, done

    def __getitem__(self, e: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if self._ahead is not None and self._ahead[0] == e:
            _, w, done = self._ahead
            self.early.append(e)
        else:
            w, done = self._send(e)
        self._ahead = None
        if done is not None:  # the compute stream waits for the side stream's copy, not the host
            current = torch.cuda.current_stream(self._stream.device)
            current.wait_event(done)
            for t in w.values():
                t.record_stream(current)  # allocated on the side stream, used on this one
        if e in self._plan:  # start the next expert's copy before this one computes
            i = self._plan.index(e)
            self._plan = self._plan[i + 1 :]
            if self._plan:
                nxt = self._plan[0]
                self._ahead = (nxt, *self._send(nxt))
        if isinstance(self.experts, StoredExperts):  # convert on the device, not on the host
            return self.experts.convert(w)
        return w

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.visit(range(len(self)))
        return (self[e] for e in range(len(self)))


def announce(experts: Sequence[dict[str, torch.Tensor]], order: Sequence[int]) -> None:
    """Tell ``experts`` which of them a sweep reads, in order (a :class:`DeviceExperts` then
    copies each one ahead of its use; other sequences need nothing)."""
    if isinstance(experts, DeviceExperts):
        experts.visit(order)


def on_device(lw: LayerWeights, device: Device) -> LayerWeights:
    """The layer's weights for computing on ``device`` (the same object on the default path)."""
    if device is None:
        return lw
    return dataclasses.replace(
        lw, params={n: to_device(t, device) for n, t in lw.params.items()}, experts=DeviceExperts(lw.experts, device)
    )


def _load_trim() -> Callable[[], object]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return lambda: None
    return lambda: trim(0)


# glibc keeps freed blocks below its (dynamic, up to 32 MB) mmap threshold in the heap, and a
# layer's many short-lived tensors fragment it: with no trim at all the peak RSS of the 32-layer
# benchmark replay grows by 8 % with memory that is free but not returned (docs/benchmarks.md §2).
release_freed_memory = _load_trim()


# layer steps between two trims on the host: a trim returns every freed page, and the next layers
# fault them in again (8 % of a narrow replay's wall time when it ran after every layer); every
# 8th keeps the 32-layer replay's peak within 3 % of trimming after each (docs/decisions.md,
# "Freed memory goes back to the system every 8 layers")
TRIM_EVERY = 8


def trimmer(device: Device, every: int = TRIM_EVERY) -> Callable[[], object]:
    """What to call after each layer: on the host, the trim after every ``every``-th call;
    nothing on an accelerator, where the host holds the pinned copies and little else, and a
    trim costs ~12 ms a layer (0.2 s of the 1.32 B GPU benchmark's replay, docs/benchmarks.md "GPU")."""
    dev = prepare_device(device)
    if dev is not None and dev.type != "cpu":
        return lambda: None
    calls = itertools.count(1)

    def trim() -> None:
        if next(calls) % every == 0:
            release_freed_memory()

    return trim


def _set_deterministic(on: bool, warn_only: bool) -> None:
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
    else:
        setter(on, warn_only=warn_only)


@contextmanager
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` (docs/glossary.md, "Replay") for the duration, then the
    caller's settings back. Set through ``torch._C`` where it exists, which skips the public
    call's import of ``torch._inductor`` and ``torch._dynamo`` to set the compiler's flag
    (≈0.9 s of every run, for a compiler the replay never uses).

    Deterministic mode also fills every new tensor with NaN before use, one extra write of
    every allocation (3–7 % of a replay's CPU time, docs/benchmarks.md §2). The replay never reads memory it
    has not written, so the fill is off inside; the receipts are bit-identical either way."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    get_fill = getattr(torch._C, "_get_deterministic_fill_uninitialized_memory", None)
    set_fill = getattr(torch._C, "_set_deterministic_fill_uninitialized_memory", None)
    was_fill = get_fill() if get_fill is not None else None
    if not was_on or was_warn:
        _set_deterministic(True, False)
    if set_fill is not None:
        set_fill(False)
    try:
        yield
    finally:
        if not was_on or was_warn:
            _set_deterministic(was_on, was_warn)
        if set_fill is not None and was_fill is not None:
            set_fill(was_fill)


def _fp32_backends() -> list[Any]:
    """Every backend whose float32 products torch may run in reduced precision (TF32 on cuBLAS
    and cuDNN, bf16/TF32 in oneDNN on CPUs that have them)."""
    b = torch.backends
    found = [
        getattr(getattr(b, lib, None), op, None)
        for lib, op in (
            ("cuda", "matmul"),
            ("cudnn", "conv"),
            ("cudnn", "rnn"),
            ("mkldnn", "matmul"),
            ("mkldnn", "conv"),
            ("mkldnn", "rnn"),
        )
    ]
    return [x for x in found if x is not None and hasattr(x, "fp32_precision")]


@contextmanager
def ieee_float32() -> Iterator[None]:
    """float32 products in IEEE float32 on every backend for the duration (no TF32: it would move
    receipts beyond the oracle tolerance, docs/scaling.md), then each backend's setting back."""
    saved = [(backend, backend.fp32_precision) for backend in _fp32_backends()]
    try:
        for backend, _ in saved:
            backend.fp32_precision = "ieee"
        yield
    finally:
        for backend, value in reversed(saved):
            backend.fp32_precision = value


@contextmanager
def tf32_products(device: torch.device | None) -> Iterator[None]:
    """TF32 products on cuBLAS and cuDNN for the duration when ``tf32`` was asked for and the
    replay runs on CUDA; nothing otherwise (entered after ``ieee_float32``, so it overrides it
    for the replay only; the same per-backend ``fp32_precision`` API)."""
    if current() != "tf32" or device is None or device.type != "cuda":
        yield
        return
    b = torch.backends
    backends = [getattr(getattr(b, lib, None), op, None) for lib, op in (("cuda", "matmul"), ("cudnn", "conv"))]
    saved = [(x, x.fp32_precision) for x in backends if x is not None and hasattr(x, "fp32_precision")]
    try:
        for x, _ in saved:
            x.fp32_precision = "tf32"
        yield
    finally:
        for x, value in reversed(saved):
            x.fp32_precision = value


@contextmanager
def cublas_workspace(device: torch.device | None) -> Iterator[None]:
    """``CUBLAS_WORKSPACE_CONFIG`` (what deterministic cuBLAS needs) while a CUDA replay runs,
    unless the caller set one; removed afterwards. cuBLAS reads it when a handle is created, so a
    process that used cuBLAS before without it keeps its handle's workspace: torch checks the
    variable on every deterministic matmul, not the handle (docs/scaling.md)."""
    if device is None or device.type != "cuda" or "CUBLAS_WORKSPACE_CONFIG" in os.environ:
        yield
        return
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    try:
        yield
    finally:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


@contextmanager
def replay_scope(device: Device = None) -> Iterator[None]:
    """Every process setting a replay needs (docs/glossary.md, "Replay"), for its duration only."""
    with ExitStack() as stack:
        stack.enter_context(deterministic())
        stack.enter_context(ieee_float32())
        stack.enter_context(tf32_products(prepare_device(device)))  # only under --precision tf32, on CUDA
        stack.enter_context(cublas_workspace(prepare_device(device)))
        yield
