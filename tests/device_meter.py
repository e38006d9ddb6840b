"""Host synchronisations and host↔device copies of the device branch, counted on the CPU
(docs/decisions.md, "The GPU path: receipts on the device, copies ahead, inputs offloaded").

The device branch runs on a stand-in device, ``cpu:0``. Every tensor the replay puts there
(``.to(cpu:0)``) becomes an ``OnDevice`` tensor, and so — torch's subclass propagation — does
everything computed from one, autograd's gradients included; ``.to("cpu")`` / ``.cpu()`` bring
a tensor back as a plain one. So an ``OnDevice`` tensor is exactly what would live on the GPU,
and the calls that would stop the host on a GPU can be counted:

* ``sync``: a read of a device tensor by the host (``item``, ``tolist``, ``float``, ``int``,
  ``bool``), a blocking copy (either way: torch waits for the stream after it), and an explicit
  wait (``moeaudit.replay.device.synchronize``);
* ``h2d`` / ``d2h``: copies to / from the device, with their bytes.

Counts are bucketed by layer: a layer starts when the replay reads its weights
(``Checkpoint.layer_weights``) and ends at its progress tick; what happens between the last
forward layer and the first backward one is the LM head (``head``). Blind spot: tensors created
directly on a device (``torch.arange(T, device=x.device)``) are host tensors here, so a read of
one would go uncounted; the replay reads none.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

STANDIN = torch.device("cpu", 0)
_SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


class OnDevice(torch.Tensor):
    """A tensor on the stand-in device (torch propagates the subclass through every op; the
    gradients autograd leaves in ``.grad`` are tagged on the way out)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """The stand-in device, so that a copy to where a device tensor lives
        (``t.to(x.device)``) is counted as one, as it would be on a GPU."""
        return STANDIN

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        with torch._C.DisableTorchFunctionSubclass():
            g = torch._C.TensorBase.grad.__get__(self)  # type: ignore[union-attr]
        return None if g is None else _dev(g)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.grad.__set__(self, value)  # type: ignore[union-attr]


class Meter:
    def __init__(self) -> None:
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.label = "setup"
        self.phase = "forward"

    def add(self, kind: str, n: int = 1) -> None:
        self.counts[self.label][kind] += n

    def layer_start(self, layer: int) -> None:
        self.label = f"{self.phase} {layer}"

    def tick(self, stage: str, done: int, total: int) -> None:
        """The replay's progress callback: "forward layer i/L" ends a layer; after the last
        forward layer comes the LM head."""
        i, L = stage.rsplit(" ", 1)[1].split("/")
        if stage.startswith("forward") and i == L:
            self.phase, self.label = "backward", "head"
        else:
            self.label = "between"

    def layers(self, phase: str) -> list[Counter[str]]:
        return [c for label, c in self.counts.items() if label.startswith(phase + " ")]


def _target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """ "device", "host" or None (a dtype-only ``to``)."""
    dev = kwargs.get("device")
    for a in args:
        if isinstance(a, torch.Tensor):
            return "device" if isinstance(a, OnDevice) else "host"
        if isinstance(a, str | torch.device):
            dev = a
    if dev is None:
        return None
    return "device" if torch.device(dev) == STANDIN else "host"


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor) if isinstance(t, OnDevice) else t


def _dev(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t if isinstance(t, OnDevice) else t.as_subclass(OnDevice)


@contextmanager
def metering(meter: Meter) -> Iterator[Meter]:
    """Patch ``torch.Tensor`` and ``moeaudit.replay.device.synchronize`` to count into ``meter``."""
    import importlib

    try:
        device_mod: Any = importlib.import_module("moeaudit.replay.device")
    except ImportError:  # a tree from before it (docs/scaling.md's "before" counts)
        device_mod = None
    originals: dict[str, Any] = {n: getattr(torch.Tensor, n) for n in (*_SYNC_METHODS, "to", "cpu")}
    orig_sync = getattr(device_mod, "synchronize", None)

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target, on = _target(args, kwargs), isinstance(self, OnDevice)
        blocking = not kwargs.get("non_blocking", any(a is True for a in args[1:]))
        with torch._C.DisableTorchFunctionSubclass():
            out = originals["to"](self, *args, **kwargs)
        if target == "device" and not on:
            meter.add("h2d")
            meter.add("h2d_bytes", self.numel() * self.element_size())
            meter.add("sync", blocking)
            return _dev(out)
        if target == "host" and on:
            meter.add("d2h")
            meter.add("d2h_bytes", self.numel() * self.element_size())
            meter.add("sync", blocking)
            return _plain(out)
        return _dev(out) if on else out

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return to(self, "cpu")

    to._original = originals["to"]  # type: ignore[attr-defined]  # for DeviceGuard
    cpu._original = originals["cpu"]  # type: ignore[attr-defined]

    def reader(name: str) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(self, OnDevice):
                meter.add("sync")
                if name == "tolist":
                    meter.add("d2h")
                    meter.add("d2h_bytes", self.numel() * self.element_size())
            with torch._C.DisableTorchFunctionSubclass():
                return originals[name](_plain(self), *args, **kwargs)

        read._original = originals[name]  # type: ignore[attr-defined]
        return read

    def synchronize(device: Any) -> None:
        if device is not None and torch.device(device) == STANDIN:
            meter.add("sync")
        if orig_sync is not None:
            orig_sync(device)

    try:
        torch.Tensor.to = to  # type: ignore[method-assign, assignment]
        torch.Tensor.cpu = cpu  # type: ignore[method-assign, assignment]
        for name in _SYNC_METHODS:
            setattr(torch.Tensor, name, reader(name))
        if device_mod is not None:
            device_mod.synchronize = synchronize
        yield meter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        if device_mod is not None:
            device_mod.synchronize = orig_sync


@contextmanager
def layer_starts(ckpt: Any, meter: Any) -> Iterator[None]:
    """Inside the block a layer starts, for ``meter.layer_start``, when the replay reads its
    weights (``ckpt.layer_weights``)."""
    read = ckpt.layer_weights

    def layer_weights(layer: int, *args: Any, **kwargs: Any) -> Any:
        meter.layer_start(layer)
        return read(layer, *args, **kwargs)

    ckpt.layer_weights = layer_weights
    try:
        yield
    finally:
        del ckpt.layer_weights


def measure(ckpt: Any, run: Callable[[Callable[[str, int, int], None]], Any]) -> Meter:
    """Run ``run(progress)`` (a replay on ``STANDIN`` of ``ckpt``) under the meter, with layer
    starts taken from ``ckpt.layer_weights``."""
    meter = Meter()
    with layer_starts(ckpt, meter), metering(meter):
        run(meter.tick)
    return meter


class DeviceGuard(torch.overrides.TorchFunctionMode):
    """What the stand-in cannot see by itself: a host tensor meeting a device tensor in one
    operation — which on a GPU raises ("expected all tensors to be on the same device") or, for
    an index, copies and waits. Under this mode a tensor created with ``device=`` the stand-in
    (``torch.zeros(n, device=x.device)``) is a device tensor, and every call that mixes a device
    tensor with a host tensor of more than one element (a 0-dim host tensor is a scalar CUDA
    accepts) is recorded in ``mixed`` (the operator and the shapes, device ones marked ``@``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        flat: list[torch.Tensor] = []

        def walk(a: Any) -> None:
            if isinstance(a, torch.Tensor):
                flat.append(a)
            elif isinstance(a, list | tuple):
                for b in a:
                    walk(b)

        walk(args)
        walk(list(kwargs.values()))
        name = getattr(func, "__name__", str(func))
        on = [isinstance(t, OnDevice) for t in flat]
        if (
            any(on)
            and any(not d and t.dim() > 0 for t, d in zip(flat, on, strict=True))
            and name not in ("to", "cpu", "copy_", "__get__", "__set__")
        ):
            self.mixed.append(
                f"{name}("
                + ", ".join(f"{'@' if d else ''}{list(t.shape)}" for t, d in zip(flat, on, strict=True))
                + ")"
            )
        # the meter's wrappers have counted the call that brought us here: run what they wrap
        out = getattr(func, "_original", func)(*args, **kwargs)
        dev = kwargs.get("device")
        if isinstance(out, torch.Tensor) and dev is not None and torch.device(dev) == STANDIN:
            return _dev(out)
        return out
