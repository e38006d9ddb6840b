"""Which precision replays compute in (``--precision fp32|tf32|bf16``; docs/policy.md, "Reduced precision"), torch-free.

The choice is a context (:func:`precision_mode`) that the command-line sets around a command,
read where a replay computes (``moeaudit.replay.precision``), where its receipts are recorded
(``moeaudit.receipts.agreement``) and where they are cached (a reduced-precision receipt is
never served for an fp32 request). Outside any :func:`precision_mode` it is fp32, the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Final

PRECISIONS: Final = ("fp32", "tf32", "bf16")
REFERENCE: Final = "fp32"

_precision: ContextVar[str] = ContextVar("moeaudit_precision", default=REFERENCE)
# None: chosen by device (grouped GEMMs on CUDA sm_90+); "grouped" / "loop": forced (tests, benchmarks)
_kernel: ContextVar[str | None] = ContextVar("moeaudit_expert_kernel", default=None)


@contextmanager
def precision_mode(precision: str, kernel: str | None = None) -> Iterator[None]:
    """Replays started inside compute in ``precision`` (one of :data:`PRECISIONS`); ``kernel``
    forces the bf16 experts' kernel ("grouped" or "loop") instead of choosing it by device."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if kernel not in (None, "grouped", "loop"):
        raise ValueError(f"unknown expert kernel {kernel!r}")
    token, ktoken = _precision.set(precision), _kernel.set(kernel)
    try:
        yield
    finally:
        _kernel.reset(ktoken)
        _precision.reset(token)


def current() -> str:
    """The precision asked for (``fp32`` unless inside :func:`precision_mode`)."""
    return _precision.get()


def forced_kernel() -> str | None:
    return _kernel.get()


def ran(precision: str, device: str | None) -> str:
    """What a replay asked to run in ``precision`` on ``device`` (None: the host) computes in:
    TF32 kernels exist only on CUDA, so elsewhere tf32 is the fp32 path; bf16 runs everywhere."""
    if precision == "tf32" and not (device or "cpu").startswith("cuda"):
        return REFERENCE
    return precision
