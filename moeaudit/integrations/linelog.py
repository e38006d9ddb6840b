"""The append-only JSONL files the training hook writes, and what a crash can cost (docs/decisions.md,
"Live monitoring").

Each line is handed to the operating system when it is logged (one ``write``, no ``fsync``), so
a process that dies — an exception, SIGKILL, the OOM killer — loses no logged line: the kernel
holds it. ``fsync`` (durable on disk) happens only at :meth:`LineLog.sync` points: every
checkpoint save, :meth:`LineLog.close`, interpreter exit (``atexit``) and SIGTERM / SIGINT
(then the previous handler runs). A power loss or kernel crash loses at most the lines since
the last sync, and may leave a torn last line, which :func:`repair` drops when the file is
reopened (``moeaudit`` itself reads past it as a finding). A line is not fsynced on its
own: that would cost ~8 ms a step on the tiny model, for durability against a crash of the machine only.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class LineLog:
    """One JSONL file, opened for appending on the first line."""

    def __init__(self, path: Path):
        self.path = path
        self._file: TextIO | None = None

    def write(self, line: str) -> None:
        f = self._file
        if f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open)
            _OPEN.add(self)
            _install_once()
        f.write(line)
        f.flush()  # to the kernel: survives the process, not the machine

    def sync(self) -> None:
        """Make every line written so far durable (fsync)."""
        if self._file is not None and not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self.sync()
        finally:
            self._file.close()
            self._file = None
            _OPEN.discard(self)


# --- exit and signals: one handler for every open log (weakly held) -----------------------------

_OPEN: weakref.WeakSet[LineLog] = weakref.WeakSet()
_PREVIOUS: dict[int, Any] = {}
_INSTALLED: list[bool] = []


def _install_once() -> None:
    """atexit, and SIGTERM/SIGINT handlers chained to the ones in place (main thread only: a
    log first written from another thread still syncs at exit). A handler someone installs
    after ours replaces it; the lines are in the kernel all the same."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    atexit.register(_sync_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        try:
            _PREVIOUS[sig] = signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # an embedded interpreter without signals
            continue


def _sync_all() -> None:
    for log in list(_OPEN):
        try:
            log.sync()
        except OSError:
            continue  # a full disk at exit: nothing more to do


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _sync_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:  # the default action (terminate), after the sync
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def repair(path: Path, resume_step: int | None) -> None:
    """Drop a torn last line, and lines after ``resume_step`` (atomic rewrite)."""
    if not path.is_file():
        return
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    keep = lines[:-1]  # the piece after the last newline is empty or a torn write
    if resume_step is not None:
        keep = [ln for ln in keep if _step_of(ln) <= resume_step]
    new = b"".join(ln + b"\n" for ln in keep)
    if new == raw:
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(new)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _step_of(line: bytes) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1  # not ours to judge: keep it
