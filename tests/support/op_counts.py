"""Operators a replay dispatches, counted per (phase, layer) on the CPU (docs/scaling.md,
"Operators per routed layer"). On a GPU nearly every aten operator that computes is one kernel
launch (a few are two or three): the count stands in for the launch count, which is what makes
a replay launch-bound when each launch does little work.

``OpMeter`` is a ``TorchDispatchMode``: it sees every aten operator after autograd has taken
its part (the backward's too: autograd's engine runs its nodes under the same modes) and after
composite operators are decomposed into those a backend implements, i.e. what a device would be
asked to run. On the device branch (``state_receipts(..., device=STANDIN)``) the tensors the
replay puts on the stand-in ``cpu:0`` are tagged (``device_meter``) and only the operators that
touch one are counted: the host's own work (reading and checking the stored weights, drawing the
bootstrap's windows) launches nothing on a GPU and is kept apart in ``host``. A copy to the
device is one ``_to_copy`` (on a GPU one asynchronous copy on the stream; ``device_meter``
counts their bytes). On the default path (``device_branch=False``) every operator is counted.

Layers are bucketed as in ``device_meter.measure``: a layer starts when the replay reads its
weights (``Checkpoint.layer_weights``) and ends at its progress tick. Each sweep over the
experts (``experts_forward_sets``, ``experts_backward``) is recorded in the bucket it runs in
with the experts each of its index sets hits and the operators it dispatched (``Sweep``).

Not counted (``NO_KERNEL``): operators that only make a new tensor header over the same storage
(views: sizes, strides, an offset), change a header in place, or allocate without writing —
no kernel runs for them on any backend.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from device_meter import STANDIN, DeviceGuard, Meter, OnDevice, layer_starts, metering
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from moeaudit.replay.blocks import experts as experts_mod

# aten operators that launch no kernel, named explicitly (a new one shows up in ``OpMeter.views``):
# * views, a new header over the same storage: view, _unsafe_view, _reshape_alias, as_strided,
#   t, transpose, permute, expand, slice, select, unsqueeze, squeeze, unbind, split(_with_sizes),
#   chunk, narrow, unfold, diagonal, view_as_real / _complex, alias, detach, real / imag;
# * the same done to a header in place (t_, transpose_, unsqueeze_, squeeze_, as_strided_:
#   ``quantile`` reshapes its work tensor so);
# * allocations that write nothing (empty, empty_like, empty_strided, new_empty(_strided)) and
#   lift_fresh (a constant wrapped as a tensor, no data moved);
# * _local_scalar_dense, the host's read of a device scalar (``item``): a copy and a wait, not a
#   kernel, and counted as both by ``device_meter``.
# ``reshape`` / ``flatten`` / ``contiguous`` never reach a backend themselves: they decompose into
# a view or a ``clone`` (counted, it copies).
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
        "t_",
        "transpose_",
        "unsqueeze_",
        "squeeze_",
        "as_strided_",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "_local_scalar_dense",
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
    views: set[str] = field(default_factory=set)  # counted operators that are views: NO_KERNEL misses them
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
            if func.is_view:
                self.views.add(name)
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
    ``expert_slots``, before the sweep starts), gives the experts each set hits; a sweep handed
    ``sorted_slots`` takes those of the latest call, which made them."""
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
    with layer_starts(ckpt, meter), metering(Meter()), DeviceGuard(), counting_sweeps(meter), meter:
        run(meter.tick)
    return meter
