"""``moeaudit samples build``: the sample training runs, trained on generated data."""

from __future__ import annotations

from pathlib import Path

from moeaudit.commands.common import QUIET, Hooks


def build(out: Path, *, tiny: bool = False, hooks: Hooks = QUIET) -> None:
    """Train the sample runs into ``out`` (deterministic, CPU; ``tiny``: the tests' scale)."""
    from moeaudit.samples.build import build_samples

    with hooks.progress() as tick:
        build_samples(out, scale="tiny" if tiny else "full", progress=tick)
