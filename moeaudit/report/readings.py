"""What the certificate's numbers say, in words: the verdict's reasons, each gate's reading of
the gate rule, the lifecycle margins as one plain sentence an operator can act on, and the
surprises that are the policy working as designed (docs/decisions.md, "The certificate page is written for the
operator who reads it"). Plain data in, strings out;
:mod:`moeaudit.report.html` puts them on the page."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moeaudit.records import Check, GateEntry, GatesPolicy, Margin
from moeaudit.report.svg import num, signed

Doc = Mapping[str, Any]


def verdict_reasons(verdict: str, gates: Sequence[GateEntry], checks: Sequence[Check]) -> list[str]:
    """Why the verdict is what it is (docs/policy.md, "The rules in one place"), in the order the rule reads."""
    if verdict == "PASS":
        return ["every gate is BASELINE or GREEN and every evaluated check passed"]
    out = [f"{g['status']} gate at step {g['step']}" for g in gates if g["status"] not in ("BASELINE", "GREEN")]
    out += [
        f"{c.get('name')} check {c.get('status') or 'without a status'}"
        for c in checks
        if c.get("evaluated") and c.get("status") != "PASS"
    ]
    if any(g["status"] == "YELLOW" for g in gates) and verdict == "INCONCLUSIVE":
        out.append("a YELLOW gate revokes the success claim without calling for intervention")
    return out or ["the evidence does not support PASS"]


def plain_margin(name: str, m: Margin, stage: str, band: Any) -> str:
    """One sentence an operator can act on (docs/policy.md, "The rules in one place": refinement gated in post-training
    only)."""
    exact, ci = m.get("exact"), m.get("ci95")
    near = isinstance(band, (int, float)) and exact is not None and abs(exact) < band
    unsure = near or (ci is not None and ci[0] < 0 < ci[1])
    if exact is None:
        return "Not computed: " + "; ".join(str(n) for n in m.get("notes") or []) + "."
    if name == "handoff":
        return (
            "Too close to the healthy reference to call either way."
            if unsure
            else "The protected layers are at least as healthy as the reference: the handoff is licensed."
            if exact >= 0
            else "The protected layers fall short of the healthy reference: the handoff is not licensed."
        )
    if stage == "pretraining":
        return (
            "Reported, not gated. In pretraining the routed layers are meant to change as they "
            "learn, so moving beyond the refinement budget (a negative margin) is expected on a "
            "healthy run; the margin matters for a fine-tune (post-training), where it is gated "
            "(MoE atlas (003) Table 5)."
        )
    if unsure:
        return "Too close to the drift budget to call: neither refinement nor repurposing is licensed."
    return (
        "The fine-tune stayed within its drift budget: the protected layers were refined, not repurposed."
        if exact >= 0
        else "The fine-tune moved the protected layers beyond its "
        "drift budget: it repurposed them rather than refining them."
    )


def worsened_by_design(g: GateEntry, stage: str) -> bool:
    """A GREEN gate whose canary NLL worsened because it was judged as post-training: by the
    stage the gate signs (``stage``, the run's, for statements from before gates carried it)."""
    judged_as = g.get("stage") or stage
    return judged_as == "post-training" and g.get("scalar") == "worsening" and g.get("status") == "GREEN"


def by_design(gates: Sequence[GateEntry], stage: str) -> list[str]:
    """The surprises that are the policy working as designed, said where the table shows them."""
    out = []
    worse = [g["step"] for g in gates if worsened_by_design(g, stage)]
    if worse:
        first = (gates[0].get("receipts") or {}).get("nll")
        last = (gates[-1].get("receipts") or {}).get("nll")
        rise = (
            f" ({signed(100 * (last - first) / first, 1)} % from the first checkpoint)"
            if isinstance(first, (int, float)) and isinstance(last, (int, float)) and first
            else ""
        )
        out.append(
            f"The canary NLL worsens at step(s) {', '.join(map(str, worse))}{rise} while "
            "those gates stay GREEN. This is by design in post-training: a fine-tune trades "
            "loss on the pretraining canary for its new objective, so a rising canary NLL "
            "alone never makes a post-training gate bad; the refinement margin decides "
            "whether the routed structure was refined or repurposed."
        )
    return out


def _floor(rules: GatesPolicy | None, name: str) -> str:
    value = rules.get(name) if rules else None
    return f", floor {value:g}" if isinstance(value, (int, float)) else ""


def gate_note(g: GateEntry, rules: GatesPolicy | None) -> str:
    """The gate rule's reading of this gate (docs/policy.md, "The rules in one place"), in words, with the policy's
    thresholds (``rules``: the certificate's ``policy.gates``)."""
    tol_c2 = rules.get("tol_c2") if rules else None
    held = "; structure held vs the baseline before it" if g.get("continuity", {}).get("ok") else ""
    if g["status"] == "BASELINE":
        return f"baseline: {g.get('reason') or 'reference point'}{held}"
    st: Doc = g.get("structural") or g.get("continuity") or {}  # the deciding comparison, if any
    base = g.get("baseline")
    notes = [f"new baseline ({g.get('reason')}), compared with the one before it"] if g.get("new_baseline") else []
    if st.get("c2_status") == "not computed":
        notes.append(f"protected-layer C2 not computed on layer(s) {st.get('c2_not_computed_layers')}")
    elif st.get("c2_ok") is False:
        tol = f" (tolerance −{tol_c2:g})" if tol_c2 is not None else ""
        moved = signed(st.get("c2_min_delta"))
        notes.append(f"protected-layer C2 moved {moved} vs step {base}{tol}")
        if any(c.startswith("atlas motion") for c in (g.get("claims") or {}).get("licensed", [])):
            notes.append("atlas motion in pretraining (occupancy held, canary NLL improved): not a bad gate")
    if st.get("occupancy_ok") is False:
        more = ", ".join(map(str, st.get("layers_with_more_dead") or []))
        notes.append(
            f"occupancy narrowed: more dead experts on layers {more}"
            if more
            else f"occupancy narrowed (π_min ratio {num(st.get('pi_min_ratio'), '.2f')}"
            f"{_floor(rules, 'pi_min_ratio_floor')}; entropy ratio "
            f"{num(st.get('entropy_ratio'), '.2f')}{_floor(rules, 'entropy_ratio_floor')})"
        )
    if st.get("ok"):
        k1 = " (occupancy alone: C2 not applicable, top-1 routing)" if st.get("c2_status") == "not applicable" else ""
        notes.append(f"structure held vs baseline at step {base}{k1}")
    if g.get("consecutive_bad"):
        notes.append(f"{g['consecutive_bad']} consecutive bad gate(s)")
    problems = (g.get("health") or {}).get("problems") or []
    if problems:
        notes.append("below a health floor: " + "; ".join(problems[:2]) + (" …" if len(problems) > 2 else ""))
    unresolved = (g.get("health") or {}).get("unresolved") or []
    if unresolved:
        notes.append("a floor the canary does not resolve (not evidence): " + "; ".join(unresolved[:2]))
    return "; ".join(notes) or "—"
