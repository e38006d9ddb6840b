"""``moeaudit receipts``: the state receipts of one checkpoint on the canary (docs/glossary.md, "Per checkpoint (state
receipts)")."""

from __future__ import annotations

from pathlib import Path

from moeaudit.commands.common import (
    QUIET,
    Hooks,
    check_output,
    load_policy,
    one_checkpoint,
    open_checkpoint,
    ranks,
    refuse_inside,
    torch_device,
)
from moeaudit.records import Receipts


def receipts(
    ckpt: Path,
    *,
    canary_path: Path | None = None,
    policy_path: Path | None = None,
    json_out: Path | None = None,
    force: bool = False,
    conflict: bool = False,
    generate: int = 0,
    device: str = "cpu",
    nproc: int | None = None,
    hooks: Hooks = QUIET,
) -> Receipts:
    """The ``moeaudit.receipts/v1`` document (one forward and one backward; ``conflict``: one
    backward per canary domain more; ``generate``: N greedy tokens). ``json_out`` is only
    checked here, before any work: the caller writes it."""
    from moeaudit import canary as canary_mod
    from moeaudit.locate import require_canary
    from moeaudit.receipts.state import state_receipts

    refuse_inside("--json", json_out, ckpt)
    check_output(json_out, force, stdout=True)
    one_checkpoint(ckpt, "moeaudit receipts {ckpt}")
    dev = None if device == "cpu" else torch_device(device)  # before the checkpoint is read
    checkpoint = open_checkpoint(ckpt, hooks)
    probe = canary_mod.load(require_canary(canary_path and str(canary_path), ckpt))
    policy = load_policy(policy_path, ckpt, hooks)
    with ranks(nproc), hooks.progress() as tick:
        return state_receipts(
            checkpoint, probe, policy, conflict=conflict, generate=generate, progress=tick, device=dev
        )
