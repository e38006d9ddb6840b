"""The layer inputs a replay stores for its backward, on a device with a memory budget
(docs/decisions.md, "Input offload is an environment setting").

The forward keeps every layer's input (N·H floats: 28.7 GB of DeepSeek-V3's 61 layers at 16k
canary tokens, 73 % of the GPU peak, docs/scaling.md). Above a budget, the inputs of the first
layers — those the backward needs last — go to host memory instead (pinned on CUDA: the copy is
queued, ``non_blocking``, and the host never waits for it) and come back one layer ahead of
their use: reading layer i's input queues the copy back of layer i−1's. The numbers do not
change (a copy is exact); only where the bytes wait does.

The budget: ``MOEAUDIT_INPUT_BUDGET`` (bytes, or with a unit: ``12GB``, ``512MiB``; ``0``
offloads every input, ``inf`` none); by default, half the device's memory on CUDA (the other
half for the current layer's weights, taps and activations, and the allocator's slack), and no
limit elsewhere (the default path and the CPU keep everything where it is, in host memory).
"""

from __future__ import annotations

import math
import os
import re

import torch

from moeaudit.errors import UsageError
from moeaudit.replay.device import HOST, Device, prepare_device

ENV = "MOEAUDIT_INPUT_BUDGET"
DEFAULT_SHARE = 0.5  # of the device's memory, on CUDA
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_budget(text: str, name: str = ENV) -> float:
    """Bytes from ``text`` ("12GB", "512MiB", "1e9", "inf"), or a usage error naming the
    variable ``name`` it came from."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|inf)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or (m.group(1) == "inf" and unit):
        raise UsageError(f"{name}={text!r} is not a number of bytes (e.g. 24GB, 512MiB, 0, inf)")
    return float(m.group(1)) * _UNITS[unit]


def input_budget(device: Device) -> float:
    """Bytes of stored layer inputs the device may hold (``math.inf``: no limit)."""
    if os.environ.get(ENV):
        return parse_budget(os.environ[ENV])
    dev = prepare_device(device)
    if dev is not None and dev.type == "cuda":
        return DEFAULT_SHARE * torch.cuda.get_device_properties(dev).total_memory
    return math.inf


class StoredInputs:
    """Layer i's input by index, on the device while the budget holds, on the host beyond it.
    Which layers go to the host is fixed when the first input arrives (all have its size):
    the first L − R, R = budget // bytes per input, so that the backward, which walks the
    layers in reverse, finds the last R where they are and brings the others back one ahead."""

    def __init__(self, device: Device, num_layers: int, budget: float | None = None):
        self.device = prepare_device(device)
        self.num_layers = num_layers
        self.budget = input_budget(device) if budget is None and self.device is not None else budget
        self.first_resident = 0  # layers below it are offloaded
        self._items: list[torch.Tensor | None] = []
        self._back: dict[int, torch.Tensor] = {}  # copies on their way back to the device
        self.offloaded: list[int] = []

    def append(self, x: torch.Tensor) -> None:
        i = len(self._items)
        if i == 0 and self.device is not None and self.budget is not None and self.budget != math.inf:
            fit = int(self.budget // max(1, x.numel() * x.element_size()))
            self.first_resident = max(0, self.num_layers - fit)
        if i < self.first_resident:  # queued into pinned memory on CUDA: no wait
            self._items.append(x.detach().to(HOST, non_blocking=True))
            self.offloaded.append(i)
        else:
            self._items.append(x)

    def _to_device(self, i: int) -> torch.Tensor:
        t = self._items[i]
        assert t is not None, f"layer {i}'s input was released"
        return t.to(self.device, non_blocking=True)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= self.first_resident:
            out = self._items[i]
            assert out is not None, f"layer {i}'s input was released"
        else:
            back = self._back.pop(i, None)
            out = self._to_device(i) if back is None else back
        j = i - 1  # the next one the backward reads: its copy back queued now
        if 0 <= j < self.first_resident and j not in self._back and self._items[j] is not None:
            self._back[j] = self._to_device(j)
        return out

    def __setitem__(self, i: int, value: None) -> None:
        """``inputs[i] = None``: layer i's input is no longer needed (wherever it is)."""
        assert value is None
        self._items[i] = None
        self._back.pop(i, None)

    def __len__(self) -> int:
        return len(self._items)
