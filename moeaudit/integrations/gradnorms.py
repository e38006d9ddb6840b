"""One fused pass over the gradients: every squared norm a metrics line needs (docs/benchmarks.md §7).

A :class:`NormPass` is planned once from the routed layers' parameters (and, optionally, every
other parameter of the model, for the global norm a trainer clips with) and then, per logged
step, reduces each gradient once on its own device and brings back one vector with a single
host sync:

* a fused expert tensor ``[E, ...]`` gives E per-expert sums of squares (a norm over all dims
  but the first, `000` Def. 6.1);
* a tensor of one expert, the router or the shared expert gives one sum of squares;
* everything is added into its slot with one ``index_add_`` in float64.

Accuracy without a float64 copy of the gradients: float32 norms of runs of at most ``CHUNK``
contiguous values, squared and summed in float64 — relative error 1e-8 to 2e-7 (tested at
1e-6), against 1e-5 for one float32 reduction of a 2M-value expert and 7e-4 at 16M values
(measured). Tensors under ``SMALL`` values are reduced in float64 outright. On CPU all runs go
through one ``torch._foreach_norm``; on an accelerator, one ``vector_norm`` per tensor.

Distributed: a gradient that is a ``DTensor`` (FSDP2's ``fully_shard``, expert parallelism on a
device mesh) is reduced on its local shard — a fused tensor sharded on the expert dim lands in
its experts' slots at the shard's global offset — and the slot vector is summed over ranks with
one ``all_reduce`` (squares add, norms do not). A replicated mesh dim contributes from its
coordinate 0 only; a plain tensor next to DTensors is taken as replicated and counted on global
rank 0 only. Without DTensors (DDP: every rank holds the same all-reduced gradient) there is no
collective. Shape legend: E experts, R rows (E for a fused tensor, 1 otherwise), S slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

CHUNK = 16384  # float32 norms of runs of this many contiguous values (under ATen's grain size)
SMALL = 1 << 16  # tensors under this many values: one _foreach_norm in float64

GradOf = Callable[[torch.Tensor], "torch.Tensor | None"]


def dot_grad(t: torch.Tensor) -> torch.Tensor | None:
    return t.grad


@dataclass
class Slots:
    """Where each quantity sits in the summed vector."""

    experts: dict[int, range] = field(default_factory=dict)  # layer → its E expert slots
    router: dict[int, int] = field(default_factory=dict)
    shared: dict[int, int] = field(default_factory=dict)
    other: int | None = None  # every parameter that is none of the above (global norm)
    size: int = 0

    def take(self, n: int = 1) -> range:
        r = range(self.size, self.size + n)
        self.size += n
        return r


@dataclass(frozen=True)
class _Entry:
    param: torch.Tensor
    slot: int  # first slot; a fused tensor fills E consecutive slots
    fused: bool


@dataclass(frozen=True)
class Sums:
    """Squared norms of one step, as Python floats (non-finite stays non-finite)."""

    experts: dict[int, list[float]]
    router: dict[int, float]
    shared: dict[int, float]
    total: float | None  # every parameter with a gradient (None: not planned)
    extras: tuple[list[float], ...] = ()  # the ``extras`` tensors, flattened, same sync


class NormPass:
    """Plan once, then ``sums()`` per logged step. ``layers``: layer → object with ``experts``
    (expert → tensors), ``fused``, ``router`` and ``shared`` lists (``hooks._LayerParams``)."""

    def __init__(self, layers: Mapping[int, Any], others: Sequence[torch.Tensor] | None = None):
        self.slots = Slots()
        self.entries: list[_Entry] = []
        seen: set[int] = set()
        for layer, lp in layers.items():
            E = lp.num_experts()
            block = self.slots.experts[layer] = self.slots.take(E)
            for e, tensors in lp.experts.items():
                self._add(tensors, block[e], False, seen)
            self._add(lp.fused, block.start, True, seen)
            self.slots.router[layer] = self.slots.take().start
            self._add(lp.router, self.slots.router[layer], False, seen)
            if lp.shared:
                self.slots.shared[layer] = self.slots.take().start
                self._add(lp.shared, self.slots.shared[layer], False, seen)
        if others is not None:
            self.slots.other = self.slots.take().start
            self._add([t for t in others if id(t) not in seen], self.slots.other, False, seen)
        self.collective = any(_is_dtensor(e.param) for e in self.entries)

    def _add(self, tensors: Sequence[torch.Tensor], slot: int, fused: bool, seen: set[int]) -> None:
        for t in tensors:
            if id(t) not in seen:  # a tied or repeated tensor counts once
                seen.add(id(t))
                self.entries.append(_Entry(t, slot, fused))

    def sums(self, grad_of: GradOf = dot_grad, extras: Sequence[torch.Tensor] = ()) -> Sums:
        """Every squared norm of this step: one reduction per gradient, one host sync (and one
        ``all_reduce`` when gradients are sharded). Call it on every rank when ``collective``.
        ``extras``: device tensors (a loss, routing counts) brought back in the same sync."""
        vector = self.vector(grad_of, extras)
        return self.unpack(vector.tolist(), [x.numel() for x in extras])  # the host sync

    def vector(self, grad_of: GradOf = dot_grad, extras: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """:meth:`sums`' numbers as one float64 vector where the gradients live, with no host
        sync: the squared-norm slots, then ``extras`` flattened (:meth:`unpack` reads it)."""
        total = _slot_vector(self.entries, self.slots.size, grad_of, self.collective)
        if self.collective:
            torch.distributed.all_reduce(total)
        if extras:
            total = torch.cat([total, *(x.detach().reshape(-1).to(total) for x in extras)])
        return total

    def unpack(self, values: list[float], extra_sizes: Sequence[int] = ()) -> Sums:
        """:class:`Sums` from a :meth:`vector` read on the host (``extra_sizes``: its extras' numel)."""
        S = self.slots.size
        cuts = [S, *(S + n for n in _cumsum(extra_sizes))]
        more = tuple(values[a:b] for a, b in zip(cuts, cuts[1:]))
        values = values[:S]
        s = self.slots
        other = values[s.other] if s.other is not None else None
        return Sums(
            experts={k: values[r.start : r.stop] for k, r in s.experts.items()},
            router={k: values[i] for k, i in s.router.items()},
            shared={k: values[i] for k, i in s.shared.items()},
            total=None if other is None else sum(values),
            extras=more,
        )


class Readback:
    """Per-step vectors read on the host without stopping it: each :meth:`push` queues the
    vector's copy to the host behind the step's kernels (``non_blocking``: into pinned memory
    on CUDA) and records an event; :meth:`ready` returns, oldest first, the ones whose copy has
    landed — normally the previous step's, by the time the next step is measured — and never
    waits, unless ``wait`` (one synchronisation, for a log or save step). The values are the
    gradients' at push time: the copy is ordered on the stream before the optimizer's update."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, Any, Any]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, vector: torch.Tensor, context: Any) -> None:
        host = vector.to("cpu", non_blocking=True)
        event = None
        if vector.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pending.append((host, event, context))

    def ready(self, wait: bool = False) -> list[tuple[list[float], Any]]:
        out = []
        while self._pending:
            host, event, context = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
            self._pending.popleft()
            out.append((host.tolist(), context))  # a host tensor whose copy has landed
        return out


def _cumsum(xs: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def _slot_vector(entries: Sequence[_Entry], size: int, grad_of: GradOf, collective: bool) -> torch.Tensor:
    """[S] float64: each gradient's squares added into its slots, summed across devices."""
    pieces: dict[torch.device, _Pieces] = {}
    for entry in entries:
        g = grad_of(entry.param)
        if g is None:
            continue
        local, offset = _local(g.detach(), collective) if collective else (g.detach(), 0)
        if local is None or local.numel() == 0:
            continue
        rows = local.shape[0] if entry.fused and local.dim() > 0 else 1
        first = entry.slot + offset if entry.fused else entry.slot
        pieces.setdefault(local.device, _Pieces()).add(local.reshape(rows, -1), first)
    home = _home(entries) if collective else next(iter(pieces), torch.device("cpu"))
    total = torch.zeros(size, dtype=torch.float64, device=home)
    for p in pieces.values():
        for idx, sq in p.reduce():
            total.index_add_(0, idx.to(home), sq.to(home))
    return total


class _Pieces:
    """The gradients of one device, cut for reduction: rows of a small tensor in float64;
    a large one in float32 runs of ``CHUNK`` values (one ``_foreach_norm`` over all of them on
    CPU — each run is under ATen's grain size, so no OpenMP region is opened, which on a busy
    machine costs a scheduler wake-up each, 24 ms measured; one ``vector_norm`` per tensor on
    an accelerator)."""

    def __init__(self) -> None:
        self.small: list[torch.Tensor] = []
        self.small_slots: list[int] = []
        self.runs: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.direct: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, flat_RN: torch.Tensor, first: int) -> None:
        R, N = flat_RN.shape
        if flat_RN.numel() < SMALL:
            self.small.extend(flat_RN.unbind(0))
            self.small_slots.extend(range(first, first + R))
            return
        slots_R = torch.arange(first, first + R, device=flat_RN.device)
        if flat_RN.device.type != "cpu":
            self.direct.append((slots_R, _rows_sq(flat_RN)))
            return
        head = N - N % CHUNK
        if head:
            runs, slots = self.runs.setdefault(flat_RN.dtype, ([], []))
            runs.extend(flat_RN[:, :head].reshape(-1, CHUNK).unbind(0))
            slots.append(slots_R.repeat_interleave(head // CHUNK))
        if N > head:
            self.small.extend(flat_RN[:, head:].unbind(0))
            self.small_slots.extend(range(first, first + R))

    def reduce(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot index, float64 squares) pairs to add."""
        out = list(self.direct)
        if self.small:
            dev = self.small[0].device
            norms = torch._foreach_norm(self.small, 2, dtype=torch.float64)
            out.append((_index(self.small_slots, dev), torch.stack(norms).pow(2)))
        for dtype, (runs, slots) in self.runs.items():
            acc = None if dtype in (torch.float32, torch.float64) else torch.float32
            norms = torch._foreach_norm(runs, 2, dtype=acc)
            out.append((torch.cat(slots), torch.stack(norms).double().pow(2)))
        return out


_INDEX: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _index(slots: list[int], device: torch.device) -> torch.Tensor:
    """The slots as an index tensor on ``device``, made once: building it from a list on an
    accelerator would be a blocking host-to-device copy every step."""
    key = (device, tuple(slots))
    index = _INDEX.get(key)
    if index is None:
        if len(_INDEX) > 64:
            _INDEX.clear()
        index = _INDEX[key] = torch.tensor(slots, device=device)
    return index


def _rows_sq(x_RN: torch.Tensor) -> torch.Tensor:
    """[R] float64 sums of squares of each row: float32 runs of ``CHUNK``, added in float64."""
    R, N = x_RN.shape
    acc = None if x_RN.dtype in (torch.float32, torch.float64) else torch.float32
    head = N - N % CHUNK
    out = torch.zeros(R, dtype=torch.float64, device=x_RN.device)
    if head:
        chunks_RCL = x_RN[:, :head].reshape(R, -1, CHUNK)
        out += torch.linalg.vector_norm(chunks_RCL, dim=-1, dtype=acc).double().pow(2).sum(-1)
    if N > head:
        out += x_RN[:, head:].double().pow(2).sum(-1)
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
    global _DTENSOR
    if _DTENSOR is None:
        if not torch.distributed.is_available():
            return False
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return isinstance(t, _DTENSOR)


_DTENSOR: type | None = None


def _local(g: torch.Tensor, collective: bool) -> tuple[torch.Tensor | None, int]:
    """(this rank's share of ``g`` to count, global row offset of a dim-0 shard)."""
    if not _is_dtensor(g):
        if collective and torch.distributed.get_rank() != 0:
            return None, 0  # replicated next to sharded tensors: counted once, on rank 0
        return g, 0
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(g, DTensor)
    mesh, placements = g.device_mesh, g.placements
    if any(p.is_partial() for p in placements):  # unreduced: reduce before squaring
        g = g.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])
        placements = g.placements
    coord = list(mesh.get_coordinate() or ())
    if any(p.is_replicate() and c != 0 for p, c in zip(placements, coord)):
        return None, 0
    _, offset = compute_local_shape_and_global_offset(g.shape, mesh, placements)
    return g.to_local(), int(offset[0]) if offset else 0


def _home(entries: Sequence[_Entry]) -> torch.device:
    """The device a collective's vector lives on: the first DTensor's (NCCL needs CUDA)."""
    for e in entries:
        if _is_dtensor(e.param):
            return torch.device(e.param.device)
    return torch.device("cpu")
