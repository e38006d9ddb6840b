"""How runs and their checkpoints are named (README.md, "Logging from your training loop"), and the mistakes named back
to the user.

* A checkpoint directory is ``checkpoint-<step>`` (Hugging Face Trainer) or ``step-<step>``
  (torchtitan's DCP saves); :data:`moeaudit.run.CHECKPOINT_RE` is the rule. A directory that
  looks like one under another name (``step_250``, ``ckpt-250``, ``global_step250``) is refused,
  naming the accepted forms: left out silently, it would be a checkpoint the certificate never
  mentions (docs/decisions.md, "Misnamed checkpoint directories").
* A run directory given where one checkpoint belongs (``inspect RUN``, ``gate RUN …``) is
  refused with the run's checkpoints listed, so the user can pick one.
* A run is named after its directory, except torchtitan's checkpoint folder
  (``<dump>/checkpoint/step-N``), which is named after its dump folder (or the folder above a
  dump folder left at torchtitan's default name, ``outputs``): every torchtitan run would
  otherwise be "checkpoint", and a second run's default output would collide with the first's
  (docs/decisions.md, "Misnamed checkpoint directories").
"""

from __future__ import annotations

import re
from pathlib import Path

from moeaudit.errors import InputError
from moeaudit.run import CHECKPOINT_RE

ACCEPTED = "checkpoint-<step> (Hugging Face Trainer) or step-<step> (torchtitan)"
# a checkpoint under another tool's or a typo's name: a word for "checkpoint" or "step", an
# optional separator, digits (Megatron's iter_0000250, DeepSpeed's global_step250, step_250)
NEAR_MISS = re.compile(
    r"^(?:checkpoints?|ckpts?|steps?|global[-_]?step|iter(?:ation)?)[-_. ]?([0-9]+)$", re.ASCII | re.IGNORECASE
)
TORCHTITAN_PREFIX = "step-"


def _entries(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir())
    except OSError:
        return []


def checkpoint_dirs(root: Path) -> list[Path]:
    """The checkpoint directories directly under ``root``, by step."""
    found = [(int(m.group(1)), p) for p in _entries(root) if (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def refuse_misnamed(root: Path) -> None:
    """A directory under a run that looks like a checkpoint but is not named as one is an error."""
    for entry in _entries(root):
        m = NEAR_MISS.match(entry.name)
        if m and not CHECKPOINT_RE.match(entry.name) and entry.is_dir():
            raise InputError(
                f"{entry.name}/ looks like a checkpoint but is not named as one",
                path=entry,
                hint=f"moeaudit reads {ACCEPTED} directories: rename it checkpoint-{int(m.group(1))}",
            )


def listing(dirs: list[Path], limit: int = 6) -> str:
    """``checkpoint-250, checkpoint-500, …, checkpoint-1500 (6 checkpoints)``."""
    names = [d.name for d in dirs]
    shown = names if len(names) <= limit else [*names[:3], "…", *names[-2:]]
    return f"{', '.join(shown)} ({len(names)} checkpoint{'s' if len(names) != 1 else ''})"


def refuse_run_as_checkpoint(path: Path, example: str) -> None:
    """``path`` must be one checkpoint; a run directory is refused with its checkpoints listed.
    ``example`` is the command with ``{ckpt}`` where a checkpoint of the run goes."""
    dirs = checkpoint_dirs(path) if path.is_dir() and not (path / "config.json").is_file() else []
    if dirs:
        raise InputError(
            f"this is a run directory, not a checkpoint; its checkpoints are {listing(dirs)}",
            path=path,
            hint="name one of them, e.g. " + example.format(ckpt=dirs[-1]),
        )


# what torchtitan calls its folders by default (job.dump_folder "./outputs", checkpoint.folder
# "checkpoint"): names every run shares, so they cannot name one
GENERIC = frozenset({"checkpoint", "checkpoints", "ckpt", "ckpts", "outputs", "output", "out", "dump"})


def run_name(root: str | Path) -> str:
    """The run's name: its directory's; for a torchtitan checkpoint folder (``step-N`` children)
    under a shared name (``checkpoint``), the nearest folder above it whose name is its own —
    ``exp7/outputs/checkpoint`` is the run "exp7"."""
    here = Path(root).resolve()
    titan = any(d.name.startswith(TORCHTITAN_PREFIX) for d in checkpoint_dirs(here))
    if not titan or here.name.lower() not in GENERIC:
        return here.name
    named = next((p for p in here.parents if p.name and p.name.lower() not in GENERIC), None)
    return named.name if named is not None else here.name
