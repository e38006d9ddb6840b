"""``moeaudit calibrate``: fit every tolerance the verdict uses on a healthy run and write a
policy — the envelope (Gradient Starvation Envelope (000) Eq. 16) and the gate tolerances
(docs/policy.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moeaudit.commands.common import QUIET, Hooks, check_output, load_policy, refuse_inside, run_layout

if TYPE_CHECKING:
    from moeaudit.calibrate import CalibrationResult


def calibrate(
    run_dir: Path,
    out: Path,
    *,
    canary_path: Path | None = None,
    policy_path: Path | None = None,
    source: str = "auto",
    variant: str = "normalized",
    since: int | None = None,
    force: bool = False,
    hooks: Hooks = QUIET,
) -> CalibrationResult:
    """Fit on ``run_dir`` (from ``policy_path``'s or the found policy's other settings) and write
    the policy TOML to ``out``; the fit's warnings go to ``hooks.warn`` before it is written."""
    from moeaudit import canary as canary_mod
    from moeaudit.cache import ReceiptsCache
    from moeaudit.calibrate import calibrate_run, write_policy
    from moeaudit.locate import require_canary

    refuse_inside("--out", out, run_dir)
    check_output(out, force)
    run_layout(run_dir)
    base = load_policy(policy_path, run_dir, hooks)
    probe = canary_mod.load(require_canary(canary_path and str(canary_path), run_dir))
    with hooks.progress() as tick:
        result = calibrate_run(
            run_dir,
            base,
            probe,
            source=source,
            variant=variant,
            since=since,
            cache=ReceiptsCache(warn=hooks.warn),
            say=hooks.warn,
            progress=tick,
        )
    for w in result.warnings:
        hooks.warn(f"warning: {w}")
    write_policy(result, run_dir, out)
    return result
