"""``moeaudit samples build``: the sample training runs, trained on generated data."""

from __future__ import annotations

from pathlib import Path

from moeaudit.commands.common import QUIET, Hooks


def build(out: Path, *, tiny: bool = False, force: bool = False, hooks: Hooks = QUIET) -> None:
    """Train the sample runs into ``out`` (deterministic, CPU; ``tiny``: the tests' scale). Run
    directories already there are replaced only with ``force``: an existing output is never
    overwritten without it (docs/security.md)."""
    from moeaudit.errors import InputError
    from moeaudit.samples import build as samples

    there = [name for name in samples.RUNS if (out / name).exists()]
    if there and not force:
        raise InputError(
            f"already holds sample runs ({', '.join(there)})",
            path=out,
            hint="pass --force to replace them (other files stay)",
        )
    with hooks.progress() as tick:
        samples.build_samples(out, scale="tiny" if tiny else "full", progress=tick)
