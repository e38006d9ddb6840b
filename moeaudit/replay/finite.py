"""Which weights hold NaN or Inf (``nonfinite_weights``, docs/glossary.md, "Per checkpoint (state receipts)"), checked
once, in the forward pass, on the tensors as stored (converting to float32 neither creates nor removes a NaN/Inf)."""

from __future__ import annotations

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.replay.device import Device, prepare_device

_SUMMABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t``. Fast path: a NaN or ±Inf anywhere makes the float32 sum non-finite,
    so a finite sum settles it in one pass; only a non-finite sum (which finite values can also
    reach by overflow) needs the element-wise check."""
    if t.dtype in _SUMMABLE and bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


class FiniteCheck:
    """Which weights hold NaN or Inf, over a whole forward: tensors on the host are checked at
    once (``all_finite``), tensors on a device queue an exact flag there (``isfinite(t).all()``,
    no fallback needed) and are read back together at the end — one host read for the pass,
    not one per layer (a read waits for the device's queue; tests/test_host_syncs.py)."""

    def __init__(self, device: Device = None) -> None:
        self.device = prepare_device(device)
        self.entries: list[tuple[str, bool | int]] = []  # name, host verdict or index of a device flag
        self.flags: list[torch.Tensor] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.device is None or t.device != self.device:
            self.entries.append((name, all_finite(t)))
        else:
            self.entries.append((name, len(self.flags)))
            self.flags.append(torch.isfinite(t).all())

    def nonfinite(self) -> list[str]:
        read = torch.stack(self.flags).tolist() if self.flags else []
        return [n for n, f in self.entries if not (f if isinstance(f, bool) else read[f])]


def nonfinite_names(lw: LayerWeights) -> list[str]:
    """Which of a layer's tensors hold NaN or Inf (checked once, in the forward pass, on the
    tensors as stored: converting to float32 neither creates nor removes a NaN/Inf)."""
    check = FiniteCheck()
    for n, t in lw.stored_tensors():
        check.add(f"layer {lw.layer} {n}", t)
    return check.nonfinite()
