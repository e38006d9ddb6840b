"""Checkpoints a resume left behind (docs/decisions.md, "Abandoned checkpoints"): which saves belong to the branch the
run went on with, and which to the branch it abandoned.

A ``resume`` event at step S (``events.jsonl``) says training restarted from the checkpoint at
S. A save above S was written either by the resumed run (which overwrites ``checkpoint-<T>``
when it gets to T) or before the resume, by the branch the run abandoned — training that went
past S, was stopped, and is no longer the model's history. The files alone do not say which.

The run's ``metrics.jsonl`` does: the training hook rewinds it to S when the run resumes
(``moeaudit.integrations.hooks``), so it holds only the branch that went on. The rule (docs/decisions.md):

    checkpoint T is *abandoned* when some resume is at a step S < T and the log does not show
    the resumed run reaching T — its last logged step plus one logging interval (the largest gap
    between logged steps) is below T, or there is no log at all.

An abandoned checkpoint is still audited (a resume must never hide evidence: `003` Table 4;
docs/decisions.md, "Events cannot improve a verdict"); it is named in the certificate (``predicate.run.abandoned``), the
terminal and the HTML page, so nobody reads it as a state of the model that was kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from moeaudit.errors import InputError
from moeaudit.records import Abandoned as AbandonedRecord
from moeaudit.run import Run


@dataclass(frozen=True)
class Abandoned:
    name: str
    step: int
    resume_step: int  # the latest resume below it
    reason: str

    def to_json(self) -> AbandonedRecord:
        return {"name": self.name, "step": self.step, "resume_step": self.resume_step, "reason": self.reason}


def _reach(run: Run) -> tuple[int, int] | None:
    """(last logged step, largest gap between logged steps) of the log, or None without one.
    The log as the audit read it once (:meth:`Run.read_logs_once`) where it did."""
    if run.metrics is None:
        return None
    from moeaudit.metrics import read_metrics

    try:
        steps = run.parsed["metrics"].steps if "metrics" in run.parsed else read_metrics(run.metrics).steps
    except InputError:  # a log that does not read is reported by the envelope, not guessed at
        return None
    gaps = (b - a for a, b in zip(steps, islice(steps, 1, None)))  # streamed: a log may be long
    return steps[-1], max(gaps, default=1)


def abandoned(run: Run) -> list[Abandoned]:
    """The checkpoints of ``run`` left over from a branch a resume abandoned (module rule)."""
    resumes = sorted(e.step for e in run.events if e.event == "resume")
    if not resumes:
        return []
    reach = _reach(run)
    out = []
    for step, ckpt in run.checkpoints:
        before = [s for s in resumes if s < step]
        if not before:
            continue
        if reach is None:
            why = f"saved above the resume at step {before[-1]}, and no metrics.jsonl shows the resumed run reaching it"
        elif reach[0] + reach[1] < step:
            why = (
                f"saved above the resume at step {before[-1]}, but the resumed run's log ends at "
                f"step {reach[0]}: left from the branch the resume abandoned"
            )
        else:
            continue
        out.append(Abandoned(Path(ckpt.path).name, step, before[-1], why))
    return out
