"""Checkpoint bytes on the host for a replay on an accelerator: kept once, pinned, read in place.

On the CPU a replay holds one decoder layer at a time (docs/glossary.md, "Replay"), so the private copies of the
checkpoint's files are capped (``limits.PRIVATE_COPY_BYTES``) and a larger file is re-read
through its block digests — each weight hashed again in the forward and again in the backward.
On a GPU machine the host is otherwise idle, and that re-hashing was most of the replay's time
(8.5 of 11.7 s on the 1.32 B benchmark on an H200, docs/benchmarks.md "GPU"). So for a replay on
an accelerator the copies are budgeted from the memory the process may still take, like the
activation budget (``stash.host_headroom``), allocated in pinned memory, and tensors are read as
views of them: the file is read and hashed once, and each weight crosses to the device by DMA
from the very bytes that were hashed, with no staging copy.

``MOEAUDIT_HOST_COPY_BUDGET`` (bytes, or with a unit; ``0``: the CPU's cap) overrides the budget.
The receipts do not depend on the plan: the bytes are the same, only where they are held moves
(tests/test_hostplan.py).
"""

from __future__ import annotations

import os

import torch

from moeaudit import limits
from moeaudit.checkpoint import sealed
from moeaudit.replay.device import Device, prepare_device
from moeaudit.replay.offload import parse_budget
from moeaudit.replay.stash import host_headroom

ENV = "MOEAUDIT_HOST_COPY_BUDGET"
SHARE = 0.5  # of the host headroom when the plan is made; the activation budget is 0 on a device


def host_copy_budget() -> int:
    """Bytes of private copies a replay on an accelerator may hold."""
    if os.environ.get(ENV):
        budget = parse_budget(os.environ[ENV], ENV)
        return limits.PRIVATE_COPY_BYTES if budget == 0 else int(min(budget, 1 << 62))
    return max(limits.PRIVATE_COPY_BYTES, int(SHARE * host_headroom()))


def _pinned(size: int) -> memoryview:
    """``size`` bytes of page-locked host memory, as a writable byte view (kept alive by it)."""
    return memoryview(torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()).cast("B")  # type: ignore[arg-type]


def plan_host_copies(device: Device, *, pin: bool | None = None) -> sealed.HostPlan:
    """Set the process's plan for a replay on ``device``: on an accelerator, copies budgeted from
    the host's headroom, pinned (CUDA), read in place. Call it before the checkpoints are hashed
    (the CLI does, when it reads ``--device``); the default path and the CPU keep the cap.
    ``pin`` overrides whether copies are pinned (tests on the CPU stand-in: no)."""
    dev = prepare_device(device)
    if dev is None or dev.type == "cpu":
        return sealed.PLAN
    pin = dev.type == "cuda" if pin is None else pin
    settle = torch.cuda.synchronize if dev.type == "cuda" else sealed.HostPlan.settle
    sealed.PLAN = sealed.HostPlan(
        budget=host_copy_budget(), allocate=_pinned if pin else bytearray, alias=True, settle=settle
    )
    return sealed.PLAN
