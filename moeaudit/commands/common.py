"""What the commands share: the refusals made before any work (an output that exists or lies
inside the audited input, a run where one checkpoint belongs), the policy and checkpoints opened
with their notes, the expert-parallel session and the signing key.

Nothing here prints: a line for the user goes through :class:`Hooks`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.policy import Policy

Say = Callable[[str], None]
Tick = Callable[[str, int, int], None]
"""A progress callback: stage, done, total (``moeaudit.replay.result.Progress``)."""


def _silent(_line: str) -> None:
    pass


@contextmanager
def _no_progress() -> Iterator[Tick | None]:
    yield None


def _no_passphrase() -> bytes | None:
    return None


@dataclass(frozen=True)
class Hooks:
    """How a command reaches the user while it works. ``note``: one line on stderr as written
    (the policy used, a key created, a file written); ``warn``: a warning line on stderr;
    ``progress``: a context that yields a progress callback (or None) around long work;
    ``passphrase``: asked when the signing key is encrypted."""

    note: Say = _silent
    warn: Say = _silent
    progress: Callable[[], AbstractContextManager[Tick | None]] = _no_progress
    passphrase: Callable[[], bytes | None] = _no_passphrase


QUIET = Hooks()


class UnusableDevice(Exception):
    """A ``--device`` torch cannot compute on here (the CLI reports it as a usage error)."""


def torch_device(name: str) -> str:
    """A usable torch device name; the host copies of the replay planned for it."""
    import torch

    what = "pass --device cpu, or cuda on a machine with a GPU"
    try:
        dev = torch.device(name)
    except RuntimeError as exc:  # torch lists every device type it knows, most never usable here
        unknown = "Expected one of" in str(exc)
        raise UnusableDevice(f"unknown device type {name.split(':')[0]!r}: {what}" if unknown else str(exc)) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnusableDevice("CUDA is not available on this machine")
    if dev.type == "meta":
        raise UnusableDevice(f"meta tensors hold no data: {what}")
    available = getattr(getattr(torch, dev.type, None), "is_available", None)  # torch.mps, torch.xpu, ...
    if dev.type != "cpu" and not (callable(available) and available()):
        raise UnusableDevice(f"{dev.type} is not available on this machine: {what}")
    from moeaudit.replay.hostplan import plan_host_copies

    plan_host_copies(dev)  # before anything is hashed: the copies it keeps are the replay's source
    return str(dev)


def ranks(nproc: int | None) -> AbstractContextManager[Any]:
    """The expert-parallel session of a command: ``nproc`` starts the ranks; under torchrun they
    are there already; otherwise nothing (and torch is not imported for it)."""
    from contextlib import nullcontext

    if (nproc or 1) <= 1 and os.environ.get("WORLD_SIZE", "1") in ("", "1"):
        return nullcontext()
    from moeaudit.replay import dist

    return dist.session(nproc)


def load_policy(given: Path | None, start: Path, hooks: Hooks, also: tuple[Path, ...] = ()) -> Policy:
    """``given``, else policy.toml next to or above ``start`` (or ``also``), else the built-in
    policy; the note says which and whether its envelope constants are calibrated."""
    from moeaudit.locate import find_upwards, origin
    from moeaudit.policy import load_policy as load

    found, ignored = (None, []) if given else find_upwards(start, "policy.toml", also=also)
    policy = load(given or found)
    how = origin(given, found, ignored, "--policy")
    policy = replace(policy, origin=how if (given or found) else "built-in default; " + how)
    env = policy.envelope
    kind = "calibrated" if env.calibrated else "illustrative (Gradient Starvation Envelope (000) Table 6)"
    hooks.note(f"policy: {policy.source} (envelope constants {kind}; {policy.origin})")
    if not (given or found):
        hooks.warn(
            "warning: no policy file: the built-in constants are illustrative, not calibrated on "
            "your model — fit them on a healthy run with `moeaudit calibrate RUN --out policy.toml`"
        )
    return policy


def open_checkpoint(path: Path, hooks: Hooks) -> Checkpoint:
    from moeaudit.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    for w in ckpt.warnings:
        hooks.warn(f"warning: {path}: {w}")
    for n in ckpt.notes:
        hooks.warn(f"note: {path}: {n}")
    return ckpt


def check_output(path: Path | None, force: bool, *, stdout: bool = False) -> None:
    """An output that exists (without ``force``) or whose directory does not is refused before
    any work; so is ``-`` where the output is not one that ``stdout`` allows on stdout."""
    from moeaudit.errors import InputError, UsageError
    from moeaudit.jsonio import check_output_target

    if path is not None and str(path) == "-" and not stdout:
        raise UsageError("this output is written to a file, not to stdout", path="-", hint="name the file to write")
    if path is not None and str(path) != "-":
        check_output_target(path, force=force)
        if not path.parent.is_dir():
            raise InputError(
                "output directory does not exist", path=path.parent, hint="create it first or choose another path"
            )


def check_reference(reference: Path | None) -> None:
    """A --reference that is not there is refused before any replay, not after the run's."""
    import os

    from moeaudit.errors import InputError

    if reference is not None and not os.path.lexists(reference):
        raise InputError(
            "reference not found", path=reference, hint="pass a healthy checkpoint directory or its receipts JSON"
        )


def refuse_inside(option: str, path: Path | None, *audited: Path | None, whole_run: bool = False) -> None:
    """An output inside a checkpoint or run the command audits is refused before any work."""
    from moeaudit.output import refuse_inside as refuse
    from moeaudit.run import audited_paths

    if path is not None:
        refuse(path, audited_paths(*audited, whole_run=whole_run), option)


def one_checkpoint(path: Path, example: str) -> None:
    """A run directory where one checkpoint belongs is refused, its checkpoints listed."""
    from moeaudit.run_names import refuse_run_as_checkpoint

    refuse_run_as_checkpoint(path, example)


def run_layout(path: Path) -> None:
    """A directory that looks like a checkpoint under another name (step_250/) is refused."""
    from moeaudit.run_names import refuse_misnamed

    if path.is_dir():
        refuse_misnamed(path)


def signing_key(path: Path | None, hooks: Hooks) -> Any:
    """The private key at ``path``, else the user's moeaudit key (created on first use)."""
    from moeaudit.attest.signing import KeyNeedsPassphrase, default_key_path, ensure_key, load_private_key

    if path is None:
        path = default_key_path()
        if ensure_key(path):  # under a lock: a concurrent first use gets the same key
            hooks.note(f"created your signing key {path} (0600) and {path}.pub — keep the private key safe")
    try:
        key, warnings = load_private_key(path)
    except KeyNeedsPassphrase:
        key, warnings = load_private_key(path, hooks.passphrase())
    for w in warnings:
        hooks.note(f"warning: {w}")
    return key
