"""A training run directory in the Hugging Face Trainer layout (README.md, "Logging from your training loop").

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
from typing import Any

from moeaudit.checkpoint import Checkpoint
from moeaudit.errors import CheckpointError, InputError
from moeaudit.jsonio import NotStrictJSON, strict_loads
from moeaudit.limits import Hashed, iter_lines
from moeaudit.locate import CHECKPOINT_PREFIXES

PROBE_FILE = "canary_probe.jsonl"  # the training hook's canary probe (moeaudit.integrations.hooks)

# ASCII digits only: int() also reads "٣٠٠" and "３００" as 300 (docs/decisions.md, "Checkpoint steps"). ``step-<N>`` is
# torchtitan's name for its DCP checkpoint directories (``<dump_folder>/checkpoint/step-<N>``).
CHECKPOINT_RE = re.compile(r"^(?:checkpoint|step)-([0-9]+)$", re.ASCII)
EVENTS = ("resume", "regime_change")
STAGES = ("pretraining", "post-training")


@dataclass(frozen=True)
class Event:
    step: int
    event: str
    note: str = ""
    source: str = ""  # where it was declared: "events.jsonl:<line>" (written by the audited party)


@dataclass
class Run:
    path: Path
    checkpoints: list[tuple[int, Checkpoint]]
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    stage: str | None = None  # from events.jsonl; None = not stated there
    metrics: Path | None = None
    probe: Path | None = None  # the hook's canary_probe.jsonl (canary gradients at saves)
    # entries named like a checkpoint whose step cannot be read (``checkpoint-500 ``,
    # ``checkpoint-1_000``): not audited, each named with why (docs/decisions.md)
    left_out: list[tuple[str, str]] = field(default_factory=list)
    # log name ("events", "metrics", "probe") → its ``predicate.inputs`` entry, of the bytes read
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    parsed: dict[str, Any] = field(default_factory=dict)  # "metrics" / "probe" → MetricsSeries
    stages: list[tuple[int, str]] = field(default_factory=list)  # (from step, stage); -1: from the start
    # the canary digest each probe line names (None: names none), from the probe's hashed read
    probe_canaries: list[str | None] | None = None

    @property
    def steps(self) -> list[int]:
        return [s for s, _ in self.checkpoints]

    def read_logs_once(self, *, parse_probe: bool) -> None:
        """Read metrics.jsonl (and canary_probe.jsonl) once each, hashing the very bytes parsed:
        every number a certificate takes from a log then belongs to the digest it signs beside
        it, whatever the path names later (docs/security.md, "One read per input"). A probe
        that nothing parses (``parse_probe`` false) is hashed in one read and not kept."""
        from moeaudit.metrics import read_metrics

        if self.metrics is not None and "metrics" not in self.parsed:
            self.parsed["metrics"] = read_metrics(self.metrics)
            self.inputs["metrics"] = self.parsed["metrics"].record()
        if self.probe is not None and "probe" not in self.parsed:
            canaries: list[str | None] = []
            note = lambda line: _note_canary(line, canaries)  # noqa: E731
            if parse_probe:
                self.parsed["probe"] = read_metrics(self.probe, "canary probe log", tap=note)
                self.inputs["probe"] = self.parsed["probe"].record()
                self.probe_canaries = canaries
            elif "probe" not in self.inputs:
                hashed = Hashed()
                for _, line, _ in iter_lines(self.probe, "canary probe log", hashed=hashed):
                    note(line)
                self.inputs["probe"] = hashed.record(self.probe.name)
                self.probe_canaries = canaries


def _note_canary(line: bytes, out: list[str | None]) -> None:
    """The canary digest a probe line names (None: it names none); a line that is not JSON is
    skipped here (the metrics reader judges it), as ``canary.probe_digests`` does."""
    if not line.strip():
        return
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return
    digest = value.get("canary") if isinstance(value, dict) else None
    out.append(digest if isinstance(digest, str) else None)


def discover(path: str | Path) -> Run:
    root = Path(path)
    if not root.exists():
        raise InputError(
            "no such run directory", path=root, hint="expected RUN/checkpoint-<step>/ directories (Trainer layout)"
        )
    if not root.is_dir():
        raise InputError(
            "not a run directory", path=root, hint="expected RUN/checkpoint-<step>/ directories (Trainer layout)"
        )
    if (root / "config.json").is_file() and not any(CHECKPOINT_RE.match(p.name) for p in root.iterdir()):
        raise InputError(
            "this is a checkpoint, not a run directory",
            path=root,
            hint=f"audit its run: {root.parent} (or one checkpoint: `moeaudit receipts {root}`)",
        )
    left_out: list[tuple[str, str]] = []
    found = _checkpoint_dirs(root, left_out)
    run = Run(root, [], left_out=left_out)
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
        why += f"; left out {left_out[0][0]}: {left_out[0][1]}" if left_out and not run.skipped else ""
        raise InputError(f"no usable checkpoint-<step>/ directory{why}", path=root)
    logs = read_logs(root)
    run.events, run.stage, run.metrics, run.probe = logs.events, logs.stage, logs.metrics, logs.probe
    if logs.events_input is not None:
        run.inputs["events"] = logs.events_input
    run.stages = logs.stages
    return run


def truncate(run: Run, until: int) -> Run:
    """The run as it stood at step ``until``: its checkpoints up to that step (and the skipped
    entries and events up to it)."""
    kept = [(s, c) for s, c in run.checkpoints if s <= until]
    if not kept:
        raise InputError(f"no usable checkpoint at or before step {until}", path=run.path)

    def step(p: Path) -> int:
        m = CHECKPOINT_RE.match(p.name)
        return int(m.group(1)) if m else -1

    stages = [(s, stage) for s, stage in run.stages if s <= until]
    return Run(
        run.path,
        kept,
        [(p, why) for p, why in run.skipped if step(p) <= until],
        [e for e in run.events if e.step <= until],
        stages[-1][1] if stages else None,  # the stage as it stood at ``until``
        run.metrics,
        run.probe,
        list(run.left_out),
        dict(run.inputs),
        dict(run.parsed),
        stages,
        run.probe_canaries,
    )


def stage_at(stages: list[tuple[int, str]], step: int) -> str | None:
    """The stage in force at ``step``: a stage declared on an event applies from its step on,
    so a checkpoint saved at that step starts the new stage (its baseline), and a pair whose
    base is earlier is judged as the stage before it; None where no statement covers ``step``."""
    found = [stage for s, stage in stages if s <= step]
    return found[-1] if found else None


def stage_start(stages: list[tuple[int, str]], step: int) -> int | None:
    """The step from which the stage in force at ``step`` was declared (None: no statement)."""
    found = [s for s, _ in stages if s <= step]
    return found[-1] if found else None


@dataclass(frozen=True)
class RunLogs:
    """What a run directory says besides its checkpoints (README.md, "Logging from your training loop")."""

    events: list[Event]
    stage: str | None
    metrics: Path | None
    probe: Path | None
    events_input: dict[str, Any] | None = None  # the digest of the events.jsonl bytes parsed
    stages: list[tuple[int, str]] = field(default_factory=list)


def read_logs(root: Path) -> RunLogs:
    """events.jsonl, metrics.jsonl and canary_probe.jsonl at a run's root, where present.

    Present = any directory entry, so that a FIFO, device or directory under a log's name is
    refused by the reader (it is not a regular file) instead of being silently ignored."""
    events_path, metrics, probe = root / "events.jsonl", root / "metrics.jsonl", root / PROBE_FILE
    events: list[Event] = []
    stage: str | None = None
    stages: list[tuple[int, str]] = []
    record: dict[str, Any] | None = None
    if os.path.lexists(events_path):
        hashed = Hashed()
        events, stage, stages = _read_events(events_path, hashed)
        record = hashed.record(events_path.name)
    return RunLogs(
        events,
        stage,
        metrics if os.path.lexists(metrics) else None,
        probe if os.path.lexists(probe) else None,
        record,
        stages,
    )


LOG_FILES = ("metrics.jsonl", "events.jsonl", PROBE_FILE)


def audited_paths(*named: Path | None, whole_run: bool = False) -> list[Path]:
    """What a command reads from the checkpoints and runs it was given, for refusing an output
    inside them (:func:`moeaudit.output.refuse_inside`): each checkpoint directory (a link's
    target too), and for a checkpoint inside a run or a run, every checkpoint directory and log of
    that run; ``whole_run``: the run directories themselves (certify's output set and its lock)."""
    found: list[Path] = []
    for path in (Path(p) for p in named if p is not None):
        run = path if _is_run(path) else run_of(path) if path.is_dir() else None
        if path.is_dir() and run is None:
            found.append(path)  # a lone checkpoint
        elif run is None:
            found.append(path)  # a log or a receipts file named on the command line
        else:
            found += _checkpoint_dirs_quiet(run) + [run / n for n in LOG_FILES]
            if whole_run:
                found.append(run)
    return found


def _is_run(path: Path) -> bool:
    try:
        return path.is_dir() and any(CHECKPOINT_RE.match(p.name) for p in path.iterdir())
    except OSError:
        return False


def _checkpoint_dirs_quiet(root: Path) -> list[Path]:
    try:  # discover reports a bad layout; here only the output is checked against it
        return [p for p in root.iterdir() if CHECKPOINT_RE.match(p.name)]
    except OSError:
        return []


def run_of(checkpoint: Path) -> Path | None:
    """The run directory a ``checkpoint-<step>`` directory belongs to, or None."""
    resolved = checkpoint.resolve()
    return resolved.parent if CHECKPOINT_RE.match(resolved.name) else None


def step_of(checkpoint: Path) -> int | None:
    m = CHECKPOINT_RE.match(checkpoint.resolve().name)
    return int(m.group(1)) if m else None


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """The entries under ``root`` that :func:`discover` takes for checkpoints, by step (an entry
    that is no directory is skipped there); raises as it does for a step named twice."""
    return _checkpoint_dirs(root)


def _checkpoint_dirs(root: Path, left_out: list[tuple[str, str]] | None = None) -> list[tuple[int, Path]]:
    """``checkpoint-<step>`` (or torchtitan's ``step-<step>``) entries by step. A step written
    in other than ASCII digits, or two entries with the same step (``checkpoint-0100`` beside
    ``checkpoint-100``, or ``step-100``), are errors:
    which one is "step 100" would be a guess, and the second would overwrite the first's
    receipts. A lone ``checkpoint-0100`` is step 100 (docs/decisions.md). Any other entry named
    like a checkpoint whose step is not ASCII digits alone (``checkpoint-500 ``,
    ``checkpoint-+500``, ``checkpoint-1_000``, a newline in it) is appended to ``left_out`` as
    (its name, shown with escapes, and why): it is not audited, and never silently."""
    found: dict[int, Path] = {}
    for d in sorted(root.iterdir()):
        prefix = next((p for p in CHECKPOINT_PREFIXES if d.name.startswith(p)), "")
        suffix = d.name.removeprefix(prefix)
        if prefix and suffix.isdecimal() and not suffix.isascii():
            raise InputError(
                f"step {suffix!r} is not written in ASCII digits 0-9",
                path=d,
                hint="rename it checkpoint-<step> with digits 0-9",
            )
        if not (m := CHECKPOINT_RE.match(d.name)):
            if prefix and left_out is not None:
                left_out.append((ascii(d.name), _not_a_step(suffix, prefix)))
            continue
        step = int(m.group(1))
        if step in found:
            raise InputError(
                f"{found[step].name} and {d.name} are both step {step}",
                path=root,
                hint="keep one checkpoint directory per step",
            )
        found[step] = d
    return sorted(found.items())


def _not_a_step(suffix: str, prefix: str) -> str:
    """Why ``<prefix><suffix>`` names no step, in one line."""
    if suffix.strip() != suffix and suffix.strip().isdecimal():
        what = "white space around the step"
    elif suffix[:1] in "+-" and suffix[1:].isdecimal():
        what = f"a sign before the step ({suffix[0]!r})"
    elif "_" in suffix and suffix.replace("_", "").isdecimal():
        what = "an underscore in the step"
    else:
        what = f"{ascii(suffix)} is not a step in digits 0-9"
    return f"not audited: {what}; a checkpoint directory is named {prefix}<step>, the step in digits 0-9 alone"


EVENT_KEYS = frozenset({"step", "event", "note", "stage"})


def read_events(path: Path, hashed: Hashed | None = None) -> tuple[list[Event], str | None]:
    """The events and the run's stage (its latest statement by step); see :func:`_read_events`."""
    events, stage, _ = _read_events(path, hashed)
    return events, stage


def _read_events(path: Path, hashed: Hashed | None = None) -> tuple[list[Event], str | None, list[tuple[int, str]]]:
    """The events and the stage declared in ``events.jsonl``, read strictly: these lines decide
    which gates apply and where envelope windows break, so a line that two JSON parsers could read
    differently (a key named twice, NaN or Infinity) or that says more than moeaudit reads (an
    unknown key, a misspelt one) is refused, naming ``file:line`` (docs/decisions.md, "Strict `events.jsonl`").
    ``hashed`` is fed the bytes parsed (one read, :func:`moeaudit.limits.iter_lines`)."""
    events: list[Event] = []
    stated: list[tuple[int, str, int]] = []  # (step, stage, line); a metadata line is step -1
    for n, raw, _ in iter_lines(path, "events log", hashed=hashed):  # a regular file, lines ≤ 4 MiB
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        obj = _event_object(raw, where)
        if "stage" in obj and "event" not in obj:  # a metadata line: {"stage": "post-training"}
            if set(obj) != {"stage"}:
                raise InputError("a stage line holds only 'stage'", path=where, hint=_EVENTS_HINT)
            stated.append((-1, _stage(obj, where), n))
            continue
        step, event, note = obj.get("step"), obj.get("event"), obj.get("note", "")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InputError("'step' must be a non-negative integer", path=where)
        if event not in EVENTS:
            raise InputError(f"'event' must be one of {EVENTS}, got {event!r}", path=where)
        if not isinstance(note, str):
            raise InputError(f"'note' must be a string, got {type(note).__name__}", path=where)
        events.append(Event(step, event, note, f"{path.name}:{n}"))
        if "stage" in obj:  # the stage the run is in from this event on
            stated.append((step, _stage(obj, where), n))
    stage = _run_stage(stated, path)  # refuses two statements for one step that disagree
    timeline = sorted({s: st for s, st, _ in stated}.items())
    return sorted(events, key=lambda e: e.step), stage, timeline


def _run_stage(stated: list[tuple[int, str, int]], path: Path) -> str | None:
    """The stage the run is in: that of its latest statement by step (a stage-only line states the
    stage from the start), not by line. Two statements for one step that disagree are refused:
    whichever came last in the file would otherwise decide which gates apply."""
    by_step: dict[int, tuple[str, int]] = {}
    for step, stage, line in stated:
        if step in by_step and by_step[step][0] != stage:
            first = by_step[step]
            at = "from the start" if step < 0 else f"for step {step}"
            raise InputError(
                f"the stage {at} is stated as {first[0]!r} at line {first[1]} and as {stage!r} at line {line}",
                path=path,
                hint="state a stage once, on the event where it changes",
            )
        by_step.setdefault(step, (stage, line))
    return by_step[max(by_step)][0] if by_step else None


def _event_object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        obj = strict_loads(raw)
    except NotStrictJSON as exc:
        raise InputError(str(exc), path=where, hint=_EVENTS_HINT) from exc
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise InputError(f"line is not JSON ({why})", path=where) from exc
    if not isinstance(obj, dict):
        raise InputError("line is not a JSON object", path=where)
    unknown = sorted(set(obj) - EVENT_KEYS)
    if unknown:
        raise InputError(
            f"unknown key(s) {', '.join(map(repr, unknown))}; an events line has only {', '.join(sorted(EVENT_KEYS))}",
            path=where,
            hint=_EVENTS_HINT,
        )
    return obj


_EVENTS_HINT = 'one object per line: {"step": int, "event": "resume"|"regime_change", "note": str}'


def _stage(obj: dict[str, Any], where: str) -> str:
    if obj["stage"] not in STAGES:
        raise InputError(f"stage must be one of {STAGES}, got {obj['stage']!r}", path=where)
    return str(obj["stage"])
