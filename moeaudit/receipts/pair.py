"""The healthy reference of the handoff margin (docs/policy.md, "[margins]"): a checkpoint replayed, or its receipts
JSON checked against the canary and the fields the margin reads (:mod:`moeaudit.receipts.reference`).
``moeaudit compare`` itself is :mod:`moeaudit.commands.compare`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint
from moeaudit.policy import Policy
from moeaudit.receipts.reference import read_receipts
from moeaudit.receipts.state import run_state
from moeaudit.records import Receipts
from moeaudit.replay.result import Progress


def load_reference(
    path: str | Path,
    canary: Canary,
    policy: Policy,
    progress: Progress | None = None,
    device: str | None = None,
    hashed: list[dict[str, Any]] | None = None,
) -> Receipts:
    """A reference is a healthy checkpoint directory (replayed on ``device``) or its receipts
    JSON on the same canary. For a receipts file, ``hashed`` receives the ``predicate.inputs``
    entry of the very bytes parsed (one read, docs/security.md)."""
    path = Path(path)
    if path.is_dir():
        return run_state(Checkpoint(path), canary, policy, progress=progress, device=device)[0]
    return read_receipts(path, canary, policy, hashed)
