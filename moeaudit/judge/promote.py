"""``moeaudit gate``: promote or hold a candidate over its base (SPEC §9, CI gate).

The gate is a two-checkpoint run — the base a BASELINE, the candidate a gate against it —
decided by the same check list as ``certify`` (:func:`moeaudit.judge.decide.decide`): promote
(exit 0) only when that verdict is PASS, hold (exit 1) on a FAIL or a candidate that is not
GREEN, INCONCLUSIVE (exit 3) when the evidence is within noise or tolerance of a threshold.

Stage: ``--stage``, else the candidate run's ``events.jsonl``, else the policy's, else
pretraining when base and candidate are checkpoints of one run (a step of that run, as
``certify`` would judge it) and post-training when they are not (a promotion, SPEC §9).
The envelope window is (base, candidate] of the candidate's run logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.judge.decide import Evidence, decide, resolve_stage
from moeaudit.judge.gates import GREEN, Checkpointed, drift_summary, evaluate_gates, nonfinite_findings
from moeaudit.judge.policy import GateSettings, Policy
from moeaudit.run import read_logs, run_of, step_of

CONDITION_STATUS = {"PASS": "pass", "FAIL": "fail", "INCONCLUSIVE": "inconclusive", None: "skipped"}


def _steps(base: Path, candidate: Path) -> tuple[int, int, Path | None, bool]:
    """(base step, candidate step, candidate run directory, same run?)."""
    b_step, c_step = step_of(base), step_of(candidate)
    b_run, c_run = run_of(base), run_of(candidate)
    same = b_run is not None and b_run == c_run
    if b_step is None or c_step is None or (same and c_step <= b_step):
        return 0, 1, c_run, same  # no usable steps: no envelope window
    return b_step, c_step, c_run, same


def gate_candidate(compare_doc: dict[str, Any], policy: Policy, *, base: Path, candidate: Path,
                   spec: Any, stage: str | None = None) -> dict[str, Any]:
    """The promotion decision on ``compare``'s evidence (a ``moeaudit.compare/v1`` document)."""
    from moeaudit.series import envelope_evidence

    b_step, c_step, run_dir, same_run = _steps(base, candidate)
    logs = read_logs(run_dir) if run_dir is not None else None
    stage, stage_source = resolve_stage(stage, policy.gates.stage, logs.stage if logs else None,
                                        "pretraining" if same_run else "post-training")
    base_doc, cand_doc = compare_doc["base"], compare_doc["candidate"]
    points = [Checkpointed(b_step, base_doc, "base of the promotion"), Checkpointed(c_step, cand_doc)]
    gates = evaluate_gates(points, compare_doc["protected_layers"], policy.gates,
                           resamples=policy.receipts.bootstrap, seed=policy.receipts.seed)
    gates[1]["drift"] = drift_summary({"base_step": b_step, "layers": compare_doc["layers"]})
    env_report: dict[str, Any] | None
    env_why: str | None
    if (b_step, c_step) == (0, 1) and step_of(candidate) != 1:
        env_report, env_why = None, ("base and candidate are not checkpoint-<step> directories of "
                                     "increasing steps; the envelope window is unknown")
    else:
        breaks = [e.step for e in logs.events] if logs else []
        env_report, env_why = envelope_evidence(logs, {b_step: base_doc, c_step: cand_doc}, policy,
                                                stage, spec, start=b_step, end=c_step, breaks=breaks,
                                                origin=str(run_dir or candidate))
    bad = nonfinite_findings([cand_doc])
    decision = decide(Evidence(stage=stage, stage_source=stage_source, gates=gates,
                               margins=compare_doc["margins"], envelope=env_report,
                               envelope_reason=env_why, nonfinite=bad,
                               band=policy.gates.inconclusive_band))
    return {"decision": decision["promotion"], "verdict": decision["verdict"],
            "verdict_reason": decision["verdict_reason"],
            "conditions": conditions(gates[1], decision["checks"], policy.gates),
            "base": base_doc["checkpoint"]["name"], "candidate": cand_doc["checkpoint"]["name"],
            "stage": stage, "stage_source": stage_source, "gates": gates,
            "checks": decision["checks"], "envelope": env_report}


def candidate_condition(gate: dict[str, Any], g: GateSettings) -> dict[str, Any]:
    st = gate["structural"]
    tol = max(st["c2_tolerance"].values(), default=0.0)
    parts = [f"C2 {'held' if st['c2_ok'] else 'fell'} (smallest protected-layer change "
             f"{_signed(st['c2_min_delta'])}, allowed drop {tol:.4f})",
             f"occupancy {'held' if st['occupancy_ok'] else 'narrowed'} (π_min ratio "
             f"{_plain(st['pi_min_ratio'])}, floor {g.pi_min_ratio_floor:g}; entropy ratio "
             f"{_plain(st['entropy_ratio'])}, floor {g.entropy_ratio_floor:g}"
             + (f", more dead experts on layers {st['layers_with_more_dead']}" if st['layers_with_more_dead'] else "")
             + ")"]
    if gate["health"]["problems"]:
        parts.append("below a health floor: " + "; ".join(gate["health"]["problems"][:2]))
    return {"name": "candidate gate GREEN", "status": "pass" if gate["status"] == GREEN else "fail",
            "value": st["c2_min_delta"], "threshold": -tol,
            "detail": f"{gate['status']}: " + "; ".join(parts)}


def conditions(gate: dict[str, Any], checks: list[dict[str, Any]], g: GateSettings) -> list[dict[str, Any]]:
    out = [candidate_condition(gate, g)]
    for c in checks:
        out.append({"name": c["name"], "status": CONDITION_STATUS[c["status"]],
                    "value": c.get("value"), "threshold": 0.0 if "value" in c else None,
                    "detail": c["reason"] if c["evaluated"] else f"not evaluated: {c['reason']}"})
    return out


def _signed(x: float | None) -> str:
    return "—" if x is None else f"{x:+.4f}"


def _plain(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"
