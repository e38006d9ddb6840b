"""``moeaudit gate``: promote or hold a candidate over its base (README.md, "Promotion check in CI").

Within one run (BASE and CANDIDATE are ``checkpoint-<step>`` directories of the same run
directory) the candidate is judged exactly as ``certify`` would judge it on the run truncated
at the candidate: every checkpoint on disk up to it, the run's own baselines (its first
checkpoint and each event's), the envelope over the logs from the run's start (docs/decisions.md, "gate = certify
truncated").
Comparing only the two checkpoints given would let a gate promote what certify marks RED. A
candidate earlier than its base in the same run is a rollback and is held.

Across runs (a promotion from one run's checkpoint to another's) the gate is a two-checkpoint
run — the base a BASELINE, the candidate a gate against it — decided by the same check list
(:func:`moeaudit.judge.decide.decide`).

Decision: PROMOTE (exit 0) only when that verdict is PASS; HOLD (exit 1) on a FAIL or a
candidate that is not GREEN (README.md, "Promotion check in CI"); INCONCLUSIVE (exit 3) otherwise — evidence within
noise or tolerance of a threshold, a rule that could not be evaluated, a candidate that is itself a
new baseline, or a run whose earlier YELLOW has not been cleared (`003` Table 13: one rebound
is no all-clear).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from moeaudit.judge.decide import HOLD, PROMOTE, Evidence, decide, few_windows, resolve_stage
from moeaudit.judge.gates import (
    GREEN,
    INCONCLUSIVE,
    RED,
    YELLOW,
    Checkpointed,
    c2_status,
    drift_summary,
    evaluate_gates,
    nonfinite_findings,
)
from moeaudit.policy import GateSettings, Policy
from moeaudit.records import (
    Check,
    CompareDocument,
    Condition,
    ConditionFailure,
    EnvelopeReport,
    GateEntry,
    GateResult,
    Predicate,
    Promotion,
    Structural,
)
from moeaudit.run import read_logs, run_of, step_of

CONDITION_STATUS: dict[str | None, Literal["pass", "fail", "inconclusive", "skipped"]] = {
    "PASS": "pass",
    "FAIL": "fail",
    "INCONCLUSIVE": "inconclusive",
    None: "skipped",
}


def placement(base: Path, candidate: Path) -> tuple[Path | None, int | None, int | None]:
    """(run directory, base step, candidate step) when both are checkpoints of one run, else
    (None, …)."""
    b_run, c_run = run_of(base), run_of(candidate)
    if b_run is None or b_run != c_run:
        return None, step_of(base), step_of(candidate)
    return c_run, step_of(base), step_of(candidate)


def rollback(base: Path, candidate: Path, b_step: int, c_step: int) -> GateResult:
    """The held result for a candidate earlier than its base in the same run."""
    why = (
        f"{candidate.name} (step {c_step}) is earlier than {base.name} (step {b_step}) in the "
        "same run: a rollback, not a promotion"
    )
    cond: Condition = {
        "name": "candidate after base",
        "status": "fail",
        "value": c_step,
        "threshold": b_step,
        "detail": why,
    }
    return {
        "decision": HOLD,
        "verdict": None,
        "verdict_reason": why,
        "conditions": [cond],
        "base": base.name,
        "candidate": candidate.name,
        "stage": None,
        "stage_source": None,
        "gates": [],
        "checks": [],
        "envelope": None,
        "judged_in_run": None,
    }


def decision(verdict: str, gates: Sequence[GateEntry], checks: Sequence[Check] = ()) -> Promotion:
    """The promotion reading of a verdict, for the candidate (the last gate). On a canary of too
    few windows the candidate's colour rests on intervals that are no evidence
    (:func:`moeaudit.judge.decide.few_windows`): only a FAIL holds."""
    cand = gates[-1]["status"]
    if verdict == "FAIL" or (cand in (YELLOW, RED) and not few_windows(checks)):
        return HOLD
    if verdict == "PASS" and cand == GREEN:
        return PROMOTE
    return INCONCLUSIVE


def gate_from_audit(predicate: Predicate, *, base: Path, candidate: Path, b_step: int, policy: Policy) -> GateResult:
    """The promotion decision on certify's own evidence of the run truncated at the candidate."""
    gates = predicate["gates"]
    cand = gates[-1]
    result_decision = decision(predicate["verdict"], gates, predicate["checks"])
    notes = []
    if cand["baseline"] != b_step and cand.get("status") != "BASELINE":
        notes.append(
            f"judged against the run's active baseline at step {cand['baseline']} (as "
            f"certify would), with every checkpoint up to {candidate.name}; the base you "
            f"named is step {b_step}"
        )
    earlier = [g["step"] for g in gates[:-1] if g["status"] in (YELLOW, RED)]
    why: str | None = None
    if earlier and result_decision == INCONCLUSIVE and cand["status"] == GREEN:
        why = (
            f"the candidate is GREEN, but the run was YELLOW/RED at step(s) "
            f"{', '.join(map(str, earlier))}: one recovery is no all-clear (003 Table 13)"
        )
        notes.append(why)
    if result_decision == INCONCLUSIVE and cand["status"] == "BASELINE":
        why = (
            f"{candidate.name} is a fresh baseline ({cand.get('reason')}): nothing has been compared "
            "with it yet, so nothing licenses promoting it; gate a later checkpoint of the run against it"
        )
    result: GateResult = {
        "decision": result_decision,
        "verdict": predicate["verdict"],
        "verdict_reason": predicate["verdict_reason"],
        "conditions": conditions(cand, predicate["checks"], policy.gates),
        "base": base.name,
        "candidate": candidate.name,
        "stage": predicate["run"]["stage"],
        "stage_source": predicate["run"]["stage_source"],
        "gates": gates,
        "checks": predicate["checks"],
        "envelope": predicate["envelope"],
        "judged_in_run": {
            "run": predicate["run"]["path"],
            "checkpoints": predicate["run"]["checkpoints"],
            "baseline": cand["baseline"],
        },
        "notes": notes,
    }
    if why:
        result["decision_reason"] = why
    return result


def gate_candidate(
    compare_doc: CompareDocument, policy: Policy, *, base: Path, candidate: Path, spec: Any, stage: str | None = None
) -> GateResult:
    """The promotion decision across runs, on ``compare``'s evidence (``moeaudit.compare/v1``)."""

    b_step, c_step = step_of(base), step_of(candidate)
    run_dir = run_of(candidate)
    logs = read_logs(run_dir) if run_dir is not None else None
    stage, stage_source = resolve_stage(stage, policy.gates.stage, logs.stage if logs else None, "post-training")
    base_doc, cand_doc = compare_doc["base"], compare_doc["candidate"]
    known = b_step is not None and c_step is not None
    points = [
        Checkpointed(b_step if known else 0, base_doc, "base of the promotion"),  # type: ignore[arg-type]
        Checkpointed(c_step if known else 1, cand_doc),  # type: ignore[arg-type]
    ]
    gates = evaluate_gates(
        points,
        compare_doc["protected_layers"],
        policy.gates,
        resamples=policy.receipts.bootstrap,
        seed=policy.receipts.seed,
        stage=stage,
    )
    gates[1]["drift"] = drift_summary({"base_step": points[0].step, "layers": compare_doc["layers"]})
    env_report: EnvelopeReport | None = None
    env_why = (
        "base and candidate are checkpoints of different runs: the candidate run's logs "
        "before the base are not training from the base, so no envelope window is known"
    )
    bad = nonfinite_findings([cand_doc])
    decided = decide(
        Evidence(
            stage=stage,
            stage_source=stage_source,
            gates=gates,
            margins=compare_doc["margins"],
            envelope=env_report,
            envelope_reason=env_why,
            nonfinite=bad,
            band=policy.gates.inconclusive_band,
            canary_windows=cand_doc["canary"].get("distinct_windows", cand_doc["canary"]["windows"]),
        )
    )
    return {
        "decision": decision(decided["verdict"], gates, decided["checks"]),
        "verdict": decided["verdict"],
        "verdict_reason": decided["verdict_reason"],
        "conditions": conditions(gates[1], decided["checks"], policy.gates),
        "base": base_doc["checkpoint"]["name"],
        "candidate": cand_doc["checkpoint"]["name"],
        "stage": stage,
        "stage_source": stage_source,
        "gates": gates,
        "checks": decided["checks"],
        "envelope": env_report,
        "judged_in_run": None,
        "notes": [],
    }


def _structure_failures(st: Structural, g: GateSettings) -> list[ConditionFailure]:
    """Each structural condition that failed, with the value and threshold that failed."""
    out: list[ConditionFailure] = []
    for layer in st.get("c2_not_computed_layers") or []:
        out.append({"what": f"C2 on protected layer {layer} not computed", "value": None, "threshold": 0.0})
    if not st["c2_ok"]:
        tol = st["c2_tolerance"]
        for layer in st["c2_fallen_layers"]:
            out.append(
                {
                    "what": f"C2 change on protected layer {layer} against {st['against']}",
                    "value": (st.get("c2_deltas") or {}).get(str(layer), st["c2_min_delta"]),
                    "threshold": -tol[str(layer)],
                }
            )
    below = st.get("below_floor")  # below the floor beyond the bootstrap noise (gates.structural)
    if (below is None and st["pi_min_ratio"] < g.pi_min_ratio_floor) or (below and "π_min ratio" in below):
        out.append(
            {
                "what": f"π_min ratio against {st['against']}",
                "value": st["pi_min_ratio"],
                "threshold": g.pi_min_ratio_floor,
            }
        )
    if (below is None and st["entropy_ratio"] < g.entropy_ratio_floor) or (below and "entropy ratio" in below):
        out.append(
            {
                "what": f"entropy ratio against {st['against']}",
                "value": st["entropy_ratio"],
                "threshold": g.entropy_ratio_floor,
            }
        )
    if st["layers_with_more_dead"]:
        out.append(
            {
                "what": f"layers with more dead experts than {st['against']}",
                "value": len(st["layers_with_more_dead"]),
                "threshold": 0,
            }
        )
    return out


def candidate_condition(gate: GateEntry, g: GateSettings, few: bool = False) -> Condition:
    """The candidate's gate as a condition. On a canary of too few windows (``few``) a YELLOW or
    RED that no health floor's failure explains rests on intervals that are no evidence: inconclusive."""
    st = gate.get("structural") or gate.get("continuity")
    failed = [] if st is None else _structure_failures(st, g)
    failed += [
        {"what": f"layer {f['layer']} {f['what']} (absolute floor)", "value": f["value"], "threshold": f["threshold"]}
        for f in gate["health"].get("failed", [])
    ]
    parts = []
    if st is not None:
        tol = max(st["c2_tolerance"].values(), default=0.0)
        more = f", more dead experts on layers {st['layers_with_more_dead']}" if st["layers_with_more_dead"] else ""
        c2 = c2_status(st)
        parts = [
            f"C2 {c2} (smallest protected-layer change {_signed(st['c2_min_delta'])}, allowed drop {tol:.4f})"
            if c2 in ("held", "fell")
            else f"C2 {c2} on the protected layers"
            + (" (top-1 routing: structure judged on occupancy alone)" if c2 == "not applicable" else ""),
            f"occupancy {'held' if st['occupancy_ok'] else 'narrowed'} (π_min ratio "
            f"{_plain(st['pi_min_ratio'])}{_range(st, 'pi_min', ' over both bootstrap intervals')}, floor "
            f"{g.pi_min_ratio_floor:g}; entropy ratio {_plain(st['entropy_ratio'])}{_range(st, 'entropy')}, "
            f"floor {g.entropy_ratio_floor:g}{more})",
        ]
    if gate["health"]["problems"]:
        parts.append("below a health floor: " + "; ".join(gate["health"]["problems"][:2]))
    if st is None:
        parts.append("the candidate is a baseline: nothing to compare it with")
    status: Literal["pass", "inconclusive", "fail"] = (
        "pass" if gate["status"] == GREEN else "inconclusive" if gate["status"] == "BASELINE" else "fail"
    )
    if status == "fail" and few and not gate["health"].get("failed"):
        status = "inconclusive"
    first = failed[0] if failed else None
    return {
        "name": "candidate gate",
        "status": status,
        "value": first["value"] if first else (None if st is None else st["c2_min_delta"]),
        "threshold": first["threshold"]
        if first
        else (None if st is None else -max(st["c2_tolerance"].values(), default=0.0)),
        "failed": failed,
        "detail": f"{gate['status']} at step {gate['step']} — " + "; ".join(parts),
    }


def conditions(gate: GateEntry, checks: Sequence[Check], g: GateSettings) -> list[Condition]:
    out = [candidate_condition(gate, g, few_windows(checks))]
    for c in checks:
        value, threshold = c.get("value"), (0.0 if "value" in c else None)
        deciding = c.get("deciding")
        if deciding and deciding.get("value") is not None:
            value, threshold = deciding["value"], deciding.get("bound")
        out.append(
            {
                "name": c["name"],
                "status": CONDITION_STATUS[c["status"]],
                "value": value,
                "threshold": threshold,
                "detail": c["reason"] if c["evaluated"] else f"not evaluated: {c['reason']}",
            }
        )
    return out


def _signed(x: float | None) -> str:
    return "—" if x is None else f"{x:+.4f}"


def _range(st: Structural, ratio: Literal["pi_min", "entropy"], what: str = "") -> str:
    """A ratio's range over both checkpoints' bootstrap intervals, which the floor is judged on
    (docs/policy.md, "occupancy held"): a ratio under its floor whose range reaches it is held."""
    ci = (st.get("ratio_ci95") or {}).get(ratio)
    return "" if not ci else f", range {_plain(ci[0])}–{_plain(ci[1])}{what}"


def _plain(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"
