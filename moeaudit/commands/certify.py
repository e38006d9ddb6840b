"""``moeaudit certify``: audit a training run and write its signed certificate (docs/envelope.md; docs/policy.md, "The
rules in one place"). The audit itself is :func:`moeaudit.certify.audit_run`; this is the command around it: the
refusals before any work, the output locked before the replay, the outputs written as one set."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moeaudit.commands.common import (
    QUIET,
    Hooks,
    check_reference,
    load_policy,
    ranks,
    refuse_inside,
    run_layout,
    signing_key,
    torch_device,
)

if TYPE_CHECKING:
    from moeaudit.certify import Audit


@dataclass(frozen=True)
class Certified:
    """The audit, the paths written (certificate, bundle, html, receipts: a directory) and the
    line saying whether the criteria were preregistered."""

    audit: Audit
    paths: dict[str, Path]
    criteria: str  # the preregistration's one line (docs/security.md, "Preregistered criteria")


def certify(
    run_dir: Path,
    *,
    canary_path: Path | None = None,
    policy_path: Path | None = None,
    reference: Path | None = None,
    key: Path | None = None,
    out: Path | None = None,
    force: bool = False,
    no_cache: bool = False,
    device: str = "cpu",
    stage: str | None = None,
    accept_canary_mismatch: bool = False,
    preregistration: Path | None = None,
    preregistration_pubkey: tuple[Path, ...] = (),
    ablate: str | None = None,
    nproc: int | None = None,
    hooks: Hooks = QUIET,
) -> Certified:
    """Audit ``run_dir`` and write the signed outputs to ``out`` (default:
    ./moeaudit-certificates/<run name>), whatever the verdict."""
    from moeaudit import canary as canary_mod
    from moeaudit.cache import ReceiptsCache
    from moeaudit.certify import audit_run, write_outputs
    from moeaudit.locate import locate_canary
    from moeaudit.output import OutputSet

    dev = None if device == "cpu" else torch_device(device)  # before anything is read or written
    if not run_dir.exists():
        from moeaudit.errors import InputError

        raise InputError("no such run directory", path=run_dir)
    from moeaudit.run_names import run_name

    run_layout(run_dir)
    # named after the run (a torchtitan run after its dump folder, not "checkpoint")
    named_out, out = out is not None, out or Path("moeaudit-certificates") / run_name(run_dir)
    if str(out) == "-":
        from moeaudit.errors import UsageError

        raise UsageError("--out is the directory the certificate is written to, not stdout", path="-")
    refuse_inside("--out" if named_out else "the default --out", out, run_dir, reference, whole_run=True)
    check_reference(reference)
    canary_file, canary_origin = locate_canary(canary_path and str(canary_path), run_dir)
    if canary_path:  # where it was, for `verify --recheck` (a found canary's origin says it)
        canary_origin = f"{canary_origin} at {canary_file}"
    probe = canary_mod.load(canary_file)
    policy = load_policy(policy_path, run_dir, hooks)
    from moeaudit.receipts.reference import open_reference

    # a receipts file is read and checked before the replay and before anything is written
    ref = None if reference is None else open_reference(reference, probe, policy)
    key_ = signing_key(key, hooks)
    from moeaudit.commands.preregister import attach, load_for_certify

    prereg = load_for_certify(run_dir, preregistration, preregistration_pubkey, key_)  # before the replay
    # the output is locked, checked and proven writable before the replay (docs/security.md, integrity of outputs)
    with OutputSet(out, force, warn=hooks.warn) as target, ranks(nproc), hooks.progress() as tick:
        # the absolute path goes into the certificate, so `verify --recheck` works from anywhere
        cache = ReceiptsCache(enabled=not no_cache, warn=hooks.warn)
        audit = audit_run(
            run_dir.resolve(),
            probe,
            policy,
            reference=ref,
            say=hooks.warn,
            cache=cache,
            device=dev,
            stage=stage,
            canary_origin=canary_origin,
            progress=tick,
            accept_canary_mismatch=accept_canary_mismatch,
            ablate=ablate,
        )
        criteria = attach(audit, prereg)
        paths = write_outputs(audit, key_, out, target=target, compiled=cache)
    return Certified(audit, paths, criteria)


def fail_on_code(verdict: str, fail_on: str | None) -> int:
    """``--fail-on``: the verdict as an exit code once the certificate is written (0: none)."""
    code = {"FAIL": 1, "INCONCLUSIVE": 3 if fail_on == "inconclusive" else 0}.get(verdict, 0)
    return code if fail_on is not None else 0
