"""A training run directory in the Hugging Face Trainer layout (SPEC §2.3).

``RUN/checkpoint-<step>/`` checkpoints, optional ``metrics.jsonl`` (the training hook's log)
and ``events.jsonl`` (resumes, regime changes, stage). A checkpoint still being written —
missing or truncated files — is skipped with a warning and never half-read.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from moeaudit.checkpoint import Checkpoint
from moeaudit.errors import CheckpointError, InputError
from moeaudit.limits import iter_lines

PROBE_FILE = "canary_probe.jsonl"  # the training hook's canary probe (moeaudit.hooks)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
EVENTS = ("resume", "regime_change")
STAGES = ("pretraining", "post-training")


@dataclass(frozen=True)
class Event:
    step: int
    event: str
    note: str = ""


@dataclass
class Run:
    path: Path
    checkpoints: list[tuple[int, Checkpoint]]
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    stage: str | None = None  # from events.jsonl; None = not stated there
    metrics: Path | None = None
    probe: Path | None = None  # the hook's canary_probe.jsonl (canary gradients at saves)

    @property
    def steps(self) -> list[int]:
        return [s for s, _ in self.checkpoints]


def discover(path: str | Path) -> Run:
    root = Path(path)
    if not root.is_dir():
        raise InputError("not a run directory", path=root,
                         hint="expected RUN/checkpoint-<step>/ directories (Trainer layout)")
    found = sorted((int(m.group(1)), d) for d in root.iterdir()
                   if (m := CHECKPOINT_RE.match(d.name)))
    run = Run(root, [])
    for step, directory in found:
        if not directory.is_dir():  # a stray file, or a link that loops or dangles
            run.skipped.append((directory, f"{directory}: not a directory"))
            continue
        try:
            run.checkpoints.append((step, Checkpoint(directory)))
        except CheckpointError as exc:
            run.skipped.append((directory, exc.diagnostics()))
    if not run.checkpoints:
        why = f"; skipped: {run.skipped[0][1]}" if run.skipped else ""
        raise InputError(f"no usable checkpoint-<step>/ directory{why}", path=root)
    # present = any directory entry, so that a FIFO, device or directory under a log's name is
    # refused by the reader (it is not a regular file) instead of being silently ignored
    events_path = root / "events.jsonl"
    if os.path.lexists(events_path):
        run.events, run.stage = read_events(events_path)
    if os.path.lexists(root / "metrics.jsonl"):
        run.metrics = root / "metrics.jsonl"
    if os.path.lexists(root / PROBE_FILE):
        run.probe = root / PROBE_FILE
    return run


def read_events(path: Path) -> tuple[list[Event], str | None]:
    events, stage = [], None
    for n, raw, _ in iter_lines(path, "events log"):  # a regular file, lines of at most 4 MiB
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise InputError(f"line is not JSON ({why})", path=where) from exc
        if not isinstance(obj, dict):
            raise InputError("line is not a JSON object", path=where)
        if "stage" in obj and "event" not in obj:  # a metadata line: {"stage": "post-training"}
            if obj["stage"] not in STAGES:
                raise InputError(f"stage must be one of {STAGES}, got {obj['stage']!r}", path=where)
            stage = obj["stage"]
            continue
        step, event = obj.get("step"), obj.get("event")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InputError("'step' must be a non-negative integer", path=where)
        if event not in EVENTS:
            raise InputError(f"'event' must be one of {EVENTS}, got {event!r}", path=where)
        note = obj.get("note", "")
        events.append(Event(step, event, note if isinstance(note, str) else json.dumps(note)))
        if "stage" in obj:  # the stage the run is in from this event on
            if obj["stage"] not in STAGES:
                raise InputError(f"stage must be one of {STAGES}, got {obj['stage']!r}", path=where)
            stage = obj["stage"]
    return sorted(events, key=lambda e: e.step), stage
