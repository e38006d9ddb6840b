"""Operators a replay dispatches, counted per (phase, layer) on the CPU (docs/scaling.md,
"Operators per routed layer"). On a GPU nearly every aten operator that computes is one kernel
launch (some are two or three, a fused one is one for several): the count is the launch count's
stand-in, and what makes a replay launch-bound when each launch does little work.

``OpMeter`` is a ``TorchDispatchMode``: it sees every aten operator after autograd has taken
its part (the backward's too: autograd's engine runs its nodes under the same modes) and after
composite operators are decomposed into the ones a backend implements, i.e. what a device
would be asked to run. Layers are bucketed as in ``device_meter.measure``: a layer starts
when the replay reads its weights (``Checkpoint.layer_weights``) and ends at its progress tick.
Each sweep over the experts (``experts._slots_of_sets``) records, in the bucket it runs in,
how many experts each of its index sets hits: the ``hit`` the counts are fitted against.

Not counted (``NO_KERNEL``): operators that only make a new tensor header over the same storage
(views: strides, offsets, a shape) or allocate without writing — no kernel runs for them on
any backend. Copies between devices are not seen either: on the stand-in ``cpu:0`` a ``.to``
the device is the identity and dispatches nothing (``device_meter`` counts those copies).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from device_meter import STANDIN, DeviceGuard, Meter, OnDevice, metering

from moeaudit.replay.blocks import experts as experts_mod

# aten operators that launch no kernel: each returns a view of its input (a new size / stride /
# offset over the same storage: view, _unsafe_view, as_strided, t, transpose, permute, expand,
# slice, select, unsqueeze, squeeze, unbind, split, chunk, narrow, unfold, diagonal, view_as_real /
# _complex, alias, detach, _reshape_alias, real / imag of a real tensor, lift_fresh) or only
# allocates (empty, empty_like, empty_strided, new_empty: memory from the caching allocator, not
# written). ``reshape`` / ``flatten`` / ``contiguous`` never reach a backend themselves (composite:
# a view, or a ``clone``/``_unsafe_view`` that is counted when it copies).
NO_KERNEL = frozenset(
    {
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "as_strided",
        "t",
        "transpose",
        "permute",
        "expand",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "unbind",
        "split",
        "split_with_sizes",
        "chunk",
        "narrow",
        "unfold",
        "diagonal",
        "view_as_real",
        "view_as_complex",
        "alias",
        "detach",
        "lift_fresh",
        "real",
        "imag",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "_local_scalar_dense",  # a read by the host: a copy and a wait, counted by device_meter
    }
)


@dataclass
class Sweep:
    """One sweep over a layer's experts (``experts_forward_sets`` or ``experts_backward``): the
    experts each index set sends tokens to (``sets``: the layer's top-k first, then the sets an
    observer asked for), how many experts it reads (``read``: in any set) and the operators it
    dispatched (``ops``, its share of the layer's)."""

    fn: str
    sets: list[int] = field(default_factory=list)
    read: int = 0
    ops: int = 0

    @property
    def hit(self) -> int:
        """Experts the top-k set sends tokens to."""
        return self.sets[0] if self.sets else 0

    @property
    def extra(self) -> int:
        """(expert, set) pairs of the other sets: the experts evaluated for the observers."""
        return sum(self.sets[1:])


@dataclass
class OpMeter(TorchDispatchMode):
    """Counts aten operators (by name, views left out) into ``counts[label]``; the labels are
    ``device_meter.Meter``'s ("setup", "forward i", "head", "backward i", "between"). Each sweep
    over the experts in ``label`` is in ``sweeps[label]``, with the operators it dispatched."""

    device_branch: bool = True
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    host: dict[str, Counter[str]] = field(default_factory=dict)  # on the device branch: host tensors' ops
    sweeps: dict[str, list[Sweep]] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)
    label: str = "setup"
    phase: str = "forward"
    sweep: Sweep | None = None  # the sweep running now

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = func.overloadpacket.__name__
        if name in NO_KERNEL:
            self.skipped[name] += 1
        elif not self.device_branch or _on_device(args, kwargs or {}):
            self.counts.setdefault(self.label, Counter())[name] += 1
            if self.sweep is not None:
                self.sweep.ops += 1
        else:
            self.host.setdefault(self.label, Counter())[name] += 1
        return func(*args, **(kwargs or {}))

    def layer_start(self, layer: int) -> None:
        self.label = f"{self.phase} {layer}"

    def tick(self, stage: str, done: int, total: int) -> None:
        """The replay's progress callback (as ``device_meter.Meter.tick``)."""
        i, L = stage.rsplit(" ", 1)[1].split("/")
        if stage.startswith("forward") and i == L:
            self.phase, self.label = "backward", "head"
        else:
            self.label = "between"

    def ops(self, label: str) -> int:
        return sum(self.counts.get(label, Counter()).values())

    def sweeps_of(self, label: str) -> list[Sweep]:
        return self.sweeps.get(label, [])


def _on_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An operator of the device branch's device: a tensor argument on the stand-in (tagged
    ``OnDevice`` by ``device_meter.metering``) or a factory given ``device=`` the stand-in."""
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev) == STANDIN:
        return True
    return any(isinstance(a, OnDevice) for a in pytree.tree_leaves((args, kwargs)))


SWEEPS = ("experts_forward_sets", "experts_backward")


@contextmanager
def counting_sweeps(meter: OpMeter) -> Iterator[OpMeter]:
    """Record each sweep over the experts: ``experts_forward_sets`` and ``experts_backward`` are
    wrapped wherever the replay imported them (every ``moeaudit`` module holding them), and
    ``experts._slots_of_sets``, which each sweep calls once (the backward's through
    ``expert_slots``, before the sweep starts), gives the experts each set hits (a sweep handed ``sorted_slots`` uses those of the latest call,
which made them)."""
    originals = {n: getattr(experts_mod, n) for n in (*SWEEPS, "_slots_of_sets")}
    last: list[list[list[int]]] = [[]]  # tokens per expert of each set, of the latest call

    def slots_of_sets(sets: Any, E: int) -> Any:
        out = originals["_slots_of_sets"](sets, E)
        last[0] = [list(counts) for _, counts in out]
        return out

    def wrapped(fn: str) -> Callable[..., Any]:
        def sweep(*args: Any, **kwargs: Any) -> Any:
            if meter.sweep is not None:  # ``experts_forward`` → ``experts_forward_sets``: one sweep
                return originals[fn](*args, **kwargs)
            meter.sweep = Sweep(fn)
            try:
                return originals[fn](*args, **kwargs)
            finally:
                counts = last[0]
                meter.sweep.sets = [sum(1 for c in per_e if c) for per_e in counts]
                meter.sweep.read = sum(1 for per_e in zip(*counts, strict=True) if any(per_e))
                meter.sweeps.setdefault(meter.label, []).append(meter.sweep)
                meter.sweep = None

        return sweep

    patched: list[tuple[Any, str, Any]] = []
    for mod in [m for name, m in sys.modules.items() if name.startswith("moeaudit.") and m is not None]:
        for fn in SWEEPS:
            if getattr(mod, fn, None) is originals[fn]:
                patched.append((mod, fn, originals[fn]))
    try:
        for mod, fn, _ in patched:
            setattr(mod, fn, wrapped(fn))
        experts_mod._slots_of_sets = slots_of_sets
        yield meter
    finally:
        for mod, fn, orig in patched:
            setattr(mod, fn, orig)
        experts_mod._slots_of_sets = originals["_slots_of_sets"]


def measure_ops(
    ckpt: Any, run: Callable[[Callable[[str, int, int], None]], Any], device_branch: bool = True
) -> OpMeter:
    """Run ``run(progress)`` (a replay of ``ckpt``; on ``STANDIN`` where ``device_branch``) under
    the meter, with layer starts taken from ``ckpt.layer_weights`` (as ``device_meter.measure``).
    On the device branch the tensors the replay puts on the stand-in are tagged
    (``device_meter.metering``; ``DeviceGuard`` tags those created there) and only their
    operators are counted in ``counts``: what the host computes on its own tensors (reading the
    checkpoint, checking it finite, drawing the bootstrap's windows) launches nothing on a GPU
    and goes to ``host``."""
    meter = OpMeter(device_branch=device_branch)
    read = ckpt.layer_weights

    def layer_weights(layer: int, *args: Any, **kwargs: Any) -> Any:
        meter.layer_start(layer)
        return read(layer, *args, **kwargs)

    ckpt.layer_weights = layer_weights
    try:
        with metering(Meter()), DeviceGuard(), counting_sweeps(meter), meter:
            run(meter.tick)
    finally:
        del ckpt.layer_weights
    return meter
