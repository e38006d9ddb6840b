"""``moeaudit envelope``: Gradient Starvation Envelope compliance of a run, as certify's
envelope check reads it (docs/envelope.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moeaudit.commands.common import QUIET, Hooks, check_output, load_policy, refuse_inside, run_layout

if TYPE_CHECKING:
    from moeaudit.records import EnvelopeReport


def envelope(
    source_path: Path,
    *,
    policy_path: Path | None = None,
    source: str | None = None,
    canary_path: Path | None = None,
    compare: bool = False,
    calibrate_on: Path | None = None,
    json_out: Path | None = None,
    force: bool = False,
    no_cache: bool = False,
    hooks: Hooks = QUIET,
) -> EnvelopeReport:
    """The ``moeaudit.envelope/v1`` report of a run directory or a bare metrics.jsonl (``source``:
    logs, replay, probe or auto; default the policy's), non-finite values made JSON-safe.
    ``json_out`` is only checked here, before any work: the caller writes it."""
    from moeaudit.cache import ReceiptsCache
    from moeaudit.jsonio import finite_document
    from moeaudit.series import evaluate_run

    refuse_inside("--json", json_out, source_path, calibrate_on)
    check_output(json_out, force, stdout=True)
    run_layout(source_path)
    policy = load_policy(policy_path, source_path, hooks)
    with hooks.progress() as tick:
        report = evaluate_run(
            source_path,
            policy.envelope,
            source=source or policy.envelope.source,
            canary_path=canary_path and str(canary_path),
            compare=compare,
            calibrate_on=calibrate_on,
            policy_path=policy.source,
            progress=tick,
            warn=hooks.warn,
            cache=ReceiptsCache(enabled=not no_cache, warn=hooks.warn),
        )
    return finite_document(report)


def exit_code(report: EnvelopeReport) -> int:
    """0 compliant, 1 not, 3 compliant on what could be evaluated but a gated rule could not be."""
    return 1 if not report["compliant"] else 3 if report.get("unevaluable") else 0
