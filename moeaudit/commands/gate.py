"""``moeaudit gate``: the CI promotion decision of CANDIDATE over BASE (README.md, "Promotion check in CI"). Within one
run the candidate is judged exactly as certify of the run truncated at it would judge it; across
runs on ``compare``'s evidence; a candidate earlier than its base is a rollback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit.commands.common import (
    QUIET,
    Hooks,
    check_output,
    check_reference,
    load_policy,
    one_checkpoint,
    open_checkpoint,
    ranks,
    refuse_inside,
    run_layout,
    signing_key,
)
from moeaudit.errors import UsageError

if TYPE_CHECKING:
    from moeaudit.policy import Policy
    from moeaudit.records import GateResult, Subject

EXIT = {"PROMOTE": 0, "HOLD": 1, "INCONCLUSIVE": 3}


@dataclass(frozen=True)
class Gated:
    """The decision; the policy it was judged by (None for a rollback); the candidate checkpoint
    and, within a run, its subject as the audit named it (name and root digest); the key that
    will sign ``--attest-test-result``."""

    result: GateResult
    policy: Policy | None
    candidate: Any
    subject: Subject | None = None
    signing_key: Any = None


def gate(
    base: Path,
    candidate: Path,
    *,
    canary_path: Path | None = None,
    policy_path: Path | None = None,
    reference: Path | None = None,
    stage: str | None = None,
    junit: Path | None = None,
    json_out: Path | None = None,
    attest: Path | None = None,
    key: Path | None = None,
    force: bool = False,
    nproc: int | None = None,
    hooks: Hooks = QUIET,
) -> Gated:
    """The decision. The outputs (``junit``, ``json_out``, ``attest``) are checked here, before
    any work, and written by :func:`write_outputs` once the decision is shown."""
    from moeaudit.judge.promote import placement, rollback

    if base.exists() and base.resolve() == candidate.resolve():  # a CI job that names one path twice
        raise UsageError(
            "the base and the candidate are the same checkpoint: a promotion from it to itself decides nothing",
            path=candidate,
            hint="name the checkpoint in service as BASE and the one to promote as CANDIDATE",
        )
    refuse_inside("--junit", junit, base, candidate, reference)
    refuse_inside("--json", json_out, base, candidate, reference)
    refuse_inside("--attest-test-result", attest, base, candidate, reference)
    check_output(junit, force)  # every output is checked before any work
    check_output(json_out, force, stdout=True)
    check_output(attest, force)
    check_reference(reference)
    if key is not None and attest is None:
        raise UsageError("--key signs the --attest-test-result file", hint="add --attest-test-result FILE")
    key_ = signing_key(key, hooks) if attest is not None else None
    one_checkpoint(base, "moeaudit gate {ckpt} CANDIDATE")
    one_checkpoint(candidate, "moeaudit gate BASE {ckpt}")
    b, c = open_checkpoint(base, hooks), open_checkpoint(candidate, hooks)
    run_dir, b_step, c_step = placement(base, candidate)
    if run_dir is not None:
        run_layout(run_dir)
    policy, subject = None, None
    with ranks(nproc):
        if run_dir is not None and b_step is not None and c_step is not None and c_step < b_step:
            result = rollback(base, candidate, b_step, c_step)
        elif run_dir is not None and b_step is not None and c_step is not None:
            result, policy, subject = _in_run(
                run_dir, base, candidate, b_step, c_step, canary_path, policy_path, reference, stage, hooks
            )
        else:
            result, policy = _across_runs(b, c, base, candidate, canary_path, policy_path, reference, stage, hooks)
    return Gated(result, policy, c, subject, key_)


def _in_run(
    run_dir: Path,
    base: Path,
    candidate: Path,
    b_step: int,
    c_step: int,
    canary_path: Path | None,
    policy_path: Path | None,
    reference: Path | None,
    stage: str | None,
    hooks: Hooks,
) -> tuple[GateResult, Policy, Any]:
    """The candidate as certify of the run truncated at it would judge it; with the policy and
    the candidate's subject in the audit (name and root digest)."""
    from moeaudit import canary as canary_mod
    from moeaudit.cache import ReceiptsCache
    from moeaudit.certify import audit_run
    from moeaudit.judge.promote import gate_from_audit
    from moeaudit.locate import require_canary

    probe = canary_mod.load(require_canary(canary_path and str(canary_path), base, (candidate,)))
    policy = load_policy(policy_path, base, hooks, (candidate,))
    with hooks.progress() as tick:
        audit = audit_run(
            run_dir,
            probe,
            policy,
            reference=reference,
            say=hooks.warn,
            cache=ReceiptsCache(warn=hooks.warn),
            stage=stage,
            progress=tick,
            until=c_step,
        )
    subject = next((s for s in audit.statement["subject"] if s["name"] == candidate.name), None)
    return (
        gate_from_audit(audit.statement["predicate"], base=base, candidate=candidate, b_step=b_step, policy=policy),
        policy,
        subject,
    )


def _across_runs(
    b: Any,
    c: Any,
    base: Path,
    candidate: Path,
    canary_path: Path | None,
    policy_path: Path | None,
    reference: Path | None,
    stage: str | None,
    hooks: Hooks,
) -> tuple[GateResult, Policy]:
    from moeaudit import canary as canary_mod
    from moeaudit.commands.compare import compare_checkpoints
    from moeaudit.judge.promote import gate_candidate
    from moeaudit.locate import require_canary

    probe = canary_mod.load(require_canary(canary_path and str(canary_path), base, (candidate,)))
    policy = load_policy(policy_path, base, hooks, (candidate,))
    with hooks.progress() as tick:
        doc = compare_checkpoints(b, c, probe, policy, reference=reference, progress=tick)
    return gate_candidate(doc, policy, base=base, candidate=candidate, spec=c.spec, stage=stage), policy


def write_outputs(
    gated: Gated,
    *,
    junit: Path | None = None,
    json_out: Path | None = None,
    attest: Path | None = None,
    step_summary: str | None = None,
    force: bool = False,
    hooks: Hooks = QUIET,
) -> None:
    """The decision as a signed in-toto Test Result (``attest``), JUnit XML, the
    ``moeaudit.gate/v1`` JSON and a Markdown summary appended to ``step_summary`` (GitHub's
    $GITHUB_STEP_SUMMARY); each file is written whole (temp file, then rename)."""
    from moeaudit.jsonio import atomic_write
    from moeaudit.report.ci import junit_xml, markdown_summary

    result = gated.result
    if attest is not None and gated.signing_key is not None:
        _attest_promotion(attest, gated, force, hooks)
        result["attestation"] = str(attest)
    if junit is not None:
        atomic_write(junit, junit_xml(result), force=force)
        hooks.note(f"wrote {junit} (JUnit XML)")
    if json_out is not None:
        atomic_write(json_out, gate_json(result), force=force)
        hooks.note(f"wrote {json_out} (moeaudit.gate/v1)")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as f:
            f.write(markdown_summary(result))


def gate_json(result: Any) -> str:
    """The ``moeaudit.gate/v1`` document of a decision (``--json FILE`` or ``--json -``)."""
    from moeaudit.jsonio import dumps

    return dumps({"schema": "moeaudit.gate/v1", **result})


def _attest_promotion(path: Path, gated: Gated, force: bool, hooks: Hooks) -> None:
    """``--attest-test-result``: the decision as a signed in-toto Test Result (atomic write)."""
    from moeaudit.attest.intoto import policy_configuration, promotion_result, sign
    from moeaudit.jsonio import atomic_write
    from moeaudit.policy import BUILTIN

    policy, c = gated.policy, gated.candidate
    subject: Subject = gated.subject or {"name": c.path.name, "digest": {"sha256": c.digest}}
    configuration = (
        []
        if policy is None
        else policy_configuration(  # a rollback is judged by no policy
            policy.source,
            policy.to_json(),
            Path(policy.source) if policy.source != BUILTIN and Path(policy.source).is_file() else None,
        )
    )
    atomic_write(path, sign(promotion_result(gated.result, subject, configuration), gated.signing_key), force=force)
    hooks.note(f"wrote {path} (in-toto Test Result, {gated.result['decision']})")
