"""``moeaudit inspect``: a checkpoint described from its headers (no tensor is loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.commands.common import one_checkpoint


def inspect(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's summary: family, layers, experts, routing, dtypes, warnings."""
    from moeaudit.checkpoint import Checkpoint

    one_checkpoint(ckpt, "moeaudit inspect {ckpt}")
    return Checkpoint(ckpt).summary()
