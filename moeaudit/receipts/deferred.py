"""Receipt numbers computed where the tensors live, read by the host once per layer (docs/decisions.md,
"The GPU path: receipts on the device, copies ahead, inputs offloaded").

A receipt function builds its JSON tree with :class:`Pending` leaves — a tensor (a scalar, a
per-expert vector, a bootstrap interval) and how it reads as JSON — instead of calling
``float``/``int``/``tolist`` on each number, which on a GPU would stop the host once per number
and copy every per-token array back. :func:`resolve` then gathers every pending tensor of the
tree into one float64 vector, brings it to the host in one copy (one synchronisation), and
reads each leaf from its slice.

Exact: float32, float64, bool and integer values below 2⁵³ (counts) are represented in
float64 exactly, so a leaf reads the same Python number as ``float(t)`` / ``int(t)`` /
``t.tolist()`` of the tensor itself — the default path's receipts do not change by a bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Read = Callable[[torch.Tensor], Any]  # the leaf's host copy (float64, the tensor's shape) → JSON


class Pending:
    """A receipt value still on its device: ``read`` turns its host copy into JSON."""

    __slots__ = ("read", "tensor")

    def __init__(self, tensor: torch.Tensor, read: Read):
        self.tensor, self.read = tensor.detach(), read


def _float(h: torch.Tensor) -> float:
    return float(h)


def _int(h: torch.Tensor) -> int:
    return int(h)


def _list(h: torch.Tensor) -> Any:
    return h.tolist()


def _ints(h: torch.Tensor) -> list[int]:
    return [int(c) for c in h.tolist()]


def number(t: torch.Tensor) -> Pending:
    """``float(t)``."""
    return Pending(t, _float)


def integer(t: torch.Tensor) -> Pending:
    """``int(t)``."""
    return Pending(t, _int)


def floats(t: torch.Tensor) -> Pending:
    """``t.tolist()`` as floats (nested for a matrix)."""
    return Pending(t, _list)


def integers(t: torch.Tensor) -> Pending:
    """``[int(c) for c in t.tolist()]`` of a vector."""
    return Pending(t, _ints)


def mean_or_none(values: torch.Tensor, count: torch.Tensor) -> Pending:
    """``float(values)`` where ``count`` > 0, else None (a mean over no tokens)."""
    return Pending(torch.stack([values.double(), count.double()]), lambda h: float(h[0]) if float(h[1]) > 0 else None)


def interval(q_2: torch.Tensor) -> Pending:
    """A 95 % interval [lo, hi]; None where it is NaN (no finite replicate)."""
    return Pending(q_2, lambda h: None if math.isnan(float(h[0])) else [float(h[0]), float(h[1])])


def apply(value: Pending, then: Callable[[Any], Any]) -> Pending:
    """``value`` read, then passed through ``then`` on the host."""
    return Pending(value.tensor, lambda h: then(value.read(h)))


def _collect(tree: Any, out: list[Pending]) -> None:
    if isinstance(tree, Pending):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _collect(v, out)
    elif isinstance(tree, list | tuple):
        for v in tree:
            _collect(v, out)


def _rebuild(tree: Any, values: dict[int, Any]) -> Any:
    if isinstance(tree, Pending):
        return values[id(tree)]
    if isinstance(tree, dict):
        return {k: _rebuild(v, values) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rebuild(v, values) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_rebuild(v, values) for v in tree)
    return tree


def resolve(tree: Any) -> Any:
    """``tree`` with every :class:`Pending` leaf read: one float64 vector of all of them, one
    copy to the host (a blocking copy: the one wait of the layer's receipts; on the host, no
    copy at all)."""
    pending: list[Pending] = []
    _collect(tree, pending)
    if not pending:
        return tree
    flat = torch.cat([p.tensor.reshape(-1).to(torch.float64) for p in pending])
    host = flat.to("cpu")
    values: dict[int, Any] = {}
    offset = 0
    for p in pending:
        n = p.tensor.numel()
        values[id(p)] = p.read(host[offset : offset + n].view(p.tensor.shape))
        offset += n
    return _rebuild(tree, values)
