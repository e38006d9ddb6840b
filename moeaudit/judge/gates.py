"""Gates and the run verdict (`003` §7–8, Tables 4, 11, 13; SPEC §8). Torch-free.

A run is a sequence of gates, one per checkpoint. The first checkpoint, and the first
checkpoint at or after every ``resume`` / ``regime_change`` event, is a BASELINE: measured,
with no preservation claim. Every other gate is compared with the active baseline:
GREEN when its structure holds, YELLOW on a bad gate, RED when bad for ``escalate_after``
consecutive gates (Table 13: YELLOW at 500, 1000, 1500, RED at 2000 on Distill-640) or at
once when structure and scalar are both bad (Table 11, last row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moeaudit.judge.policy import GateSettings

BASELINE, GREEN, YELLOW, RED = "BASELINE", "GREEN", "YELLOW", "RED"
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"


@dataclass(frozen=True)
class Checkpointed:
    """One audited checkpoint: its step, receipts document, and why it is a baseline (if)."""

    step: int
    receipts: Mapping[str, Any]
    baseline_reason: str | None = None
    objective: float | None = None  # the run's training loss at this gate (logs), when known


def _layers(doc: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    return {entry["layer"]: entry for entry in doc["layers"]}


def baselines(steps: Sequence[int], events: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """step → reason, for the first checkpoint and the first one at or after each event."""
    out = {steps[0]: "first checkpoint of the run"}
    for ev in events:
        later = [s for s in steps if s >= ev["step"]]
        if later and later[0] not in out:
            note = f": {ev['note']}" if ev.get("note") else ""
            out[later[0]] = f"{ev['event']} at step {ev['step']}{note}"
    return out


def _ratio(now: float | None, then: float | None) -> float:
    """now / then; 1 when the baseline is 0 (nothing to lose); 0 when a value is not finite
    (null in the receipts): unknown occupancy never passes a floor."""
    if now is None or then is None:
        return 0.0
    return now / then if then > 0 else 1.0


def _half_width(entry: Mapping[str, Any]) -> float:
    ci = entry["overlap"].get("ci95", {}).get("c2")
    return 0.5 * (ci[1] - ci[0]) if ci else 0.0


def structural(gate: Mapping[str, Any], base: Mapping[str, Any], protected: Sequence[int],
               g: GateSettings) -> dict[str, Any]:
    """c2_ok and occupancy_ok of a gate against its active baseline (SPEC §8).

    A protected layer's C2 counts as fallen when ΔC2 < −max(tol_c2, noise), where noise is the
    95% half-width of the difference from the two window-bootstrap intervals (√(hw_j² + hw_b²)):
    a drop inside the canary's own sampling noise is not evidence of damage (`003` §5).
    """
    now, then = _layers(gate), _layers(base)
    c2_deltas, slack = {}, {}
    for layer in protected:
        a, b = now[layer]["overlap"].get("c2"), then[layer]["overlap"].get("c2")
        if a is not None and b is not None:
            c2_deltas[layer] = a - b
            noise = (_half_width(now[layer]) ** 2 + _half_width(then[layer]) ** 2) ** 0.5
            slack[layer] = max(g.tol_c2, noise)
    fallen = [layer for layer, d in c2_deltas.items() if d < -slack[layer]]
    c2_min = min(c2_deltas.values()) if c2_deltas else None
    dead_up, pi_ratio, h_ratio = [], [], []
    for layer, entry in now.items():
        o, ob = entry["occupancy"], then[layer]["occupancy"]
        if o["dead"] > ob["dead"] + g.tol_dead:
            dead_up.append(layer)
        pi_ratio.append(_ratio(o["pi_min"], ob["pi_min"]))
        h_ratio.append(_ratio(o["entropy_norm"], ob["entropy_norm"]))
    occupancy_ok = not dead_up and min(pi_ratio) >= g.pi_min_ratio_floor and min(h_ratio) >= g.entropy_ratio_floor
    return {
        "c2_ok": not fallen,
        "c2_min_delta": c2_min,
        "c2_tolerance": {str(k): v for k, v in slack.items()},
        "c2_fallen_layers": fallen,
        "occupancy_ok": occupancy_ok,
        "layers_with_more_dead": dead_up,
        "pi_min_ratio": min(pi_ratio),
        "entropy_ratio": min(h_ratio),
        "ok": not fallen and occupancy_ok,
    }


def scalar_trend(nll: float | None, previous: float | None, tol: float) -> str:
    if previous is None or nll is None:
        return "first" if previous is None else "unknown"
    if nll < previous - tol:
        return "improving"
    if nll > previous + tol:
        return "worsening"
    return "stalling"


def claims(status: str, trend: str, st: Mapping[str, Any] | None) -> dict[str, list[str]]:
    """What this gate's receipts license and what they do not (Table 4, Table 11)."""
    lic, not_lic = [], []
    if trend == "improving":
        lic.append("the objective improved on the visited region (canary NLL fell)")
        not_lic.append("the routed model (atlas) was preserved — falling NLL alone never licenses it")
    elif trend in ("stalling", "worsening"):
        lic.append(f"canary NLL is {trend}")
    if status == BASELINE:
        lic.append("this is the state of the routed model at this reference point")
        not_lic.append("any preservation claim about training after this point (needs the next gate)")
        return {"licensed": lic, "not_licensed": not_lic}
    assert st is not None
    if st["occupancy_ok"]:
        lic.append("expert usage stayed within the occupancy floors of the baseline")
    else:
        lic.append("expert usage narrowed against the baseline (occupancy degeneration)")
    if st["c2_ok"]:
        lic.append("co-active overlap compatibility (C2) held on the protected layers")
    else:
        lic.append("co-active overlap compatibility (C2) fell on a protected layer")
    if not st["ok"] and trend == "improving":
        lic.append("scalar improvement without geometric recovery")
        not_lic.append("structural health or preservation of the routed model")
    if st["ok"]:
        lic.append("structure preserved against the active baseline at this gate")
    not_lic.append("compatibility of co-active experts from occupancy alone, or broad usage from C2 alone")
    return {"licensed": lic, "not_licensed": not_lic}


def evaluate_gates(points: Sequence[Checkpointed], protected: Sequence[int], g: GateSettings) -> list[dict[str, Any]]:
    gates: list[dict[str, Any]] = []
    base: Checkpointed | None = None
    previous_nll: float | None = None
    bad_streak = 0
    previous_objective: float | None = None
    for p in points:
        nll = p.receipts["nll"]
        if p.objective is not None and previous_objective is not None:
            # the objective the run optimises (`003` Table 3 "Loss"): mean logged training loss
            # over this interval vs the previous one
            trend = scalar_trend(p.objective, previous_objective, g.nll_tol)
        else:
            trend = scalar_trend(nll, previous_nll, g.nll_tol)
        previous_nll, previous_objective = nll, p.objective
        summary = gate_summary(p.receipts)
        summary["training_loss"] = p.objective
        if p.baseline_reason is not None or base is None:
            base, bad_streak = p, 0
            gates.append({"step": p.step, "status": BASELINE, "baseline": p.step,
                          "reason": p.baseline_reason or "first checkpoint of the run",
                          "scalar": trend, "receipts": summary, "claims": claims(BASELINE, trend, None)})
            continue
        st = structural(p.receipts, base.receipts, protected, g)
        bad_streak = 0 if st["ok"] else bad_streak + 1
        if st["ok"]:
            status = GREEN
        elif bad_streak >= g.escalate_after or trend == "worsening":  # SPEC §8: structure and scalar both bad
            status = RED
        else:
            status = YELLOW
        gates.append({"step": p.step, "status": status, "baseline": base.step, "scalar": trend,
                      "structural": st, "consecutive_bad": bad_streak, "receipts": summary,
                      "claims": claims(status, trend, st)})
    return gates


def gate_summary(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The receipts a gate rests on (`003` Table 3 columns), per layer and in aggregate."""
    layers = doc["layers"]
    c2 = [e["overlap"].get("c2") for e in layers if e["overlap"].get("c2") is not None]
    state1 = [e["boundary"]["margin_mean"] for e in layers if e["boundary"].get("margin_mean") is not None]
    cvs = [e["occupancy"]["cv"] for e in layers if e["occupancy"].get("cv") is not None]
    ents = [e["occupancy"]["entropy_norm"] for e in layers if e["occupancy"].get("entropy_norm") is not None]
    return {
        "checkpoint": doc["checkpoint"]["name"],
        "digest": doc["checkpoint"]["digest"],
        "nll": doc["nll"],
        "c2_mean": sum(c2) / len(c2) if c2 else None,
        "state1_mean": sum(state1) / len(state1) if state1 else None,
        "dead": sum(e["occupancy"]["dead"] for e in layers),
        "cv_mean": sum(cvs) / len(cvs) if cvs else None,
        "entropy_norm_min": min(ents) if ents else None,
        "nll_by_domain": doc.get("nll_by_domain", {}),
        "per_layer": [{"layer": e["layer"], "c2": e["overlap"].get("c2"),
                       "c2_ci95": e["overlap"].get("ci95", {}).get("c2"), "dead": e["occupancy"]["dead"],
                       "pi_min": e["occupancy"]["pi_min"], "state1": e["boundary"]["margin_mean"]}
                      for e in layers],
    }


def verdict(gates: Sequence[Mapping[str, Any]], checks: Sequence[Mapping[str, Any]]) -> str:
    """FAIL on any RED or failed evaluated check; PASS when all BASELINE/GREEN and all evaluated
    checks pass; otherwise INCONCLUSIVE (a YELLOW revokes the success claim)."""
    evaluated = [c for c in checks if c.get("evaluated")]
    if any(g["status"] == RED for g in gates) or any(c["status"] == FAIL for c in evaluated):
        return FAIL
    if all(g["status"] in (BASELINE, GREEN) for g in gates) and all(c["status"] == PASS for c in evaluated):
        return PASS
    return INCONCLUSIVE
