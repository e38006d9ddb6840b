"""The one decision path: evidence → check list → verdict (certify) and promotion (gate).

``certify`` (a whole run) and ``gate`` (a base and a candidate) gather the same kind of
evidence — gates, margins, an envelope report over a window, finiteness, coverage — and both
call :func:`decide`; neither computes a verdict of its own, so they cannot disagree on the same
evidence (docs/policy.md, "The rules in one place"; ``tests/test_decide.py``). Torch-free.

Checks, each evaluated only where it is the relevant question (`003` Table 5):

* ``health`` — absolute floors on every checkpoint, baselines included (judge.health); a
  reading below a floor that the canary cannot resolve is INCONCLUSIVE, not FAIL;
* ``comparison`` — at least one checkpoint was compared with a baseline; a baseline-only run
  has no preservation evidence, so its verdict is INCONCLUSIVE, never PASS;
* ``envelope`` — evaluated when a series exists, the policy's constants apply, and the series
  can fail at its sampling at all (a vacuous envelope is "not evaluated", never PASS);
* ``refinement`` — gated for post-training, reported for pretraining;
* ``handoff`` — gated when a reference is given;
* ``coverage`` — only when a checkpoint had to be skipped;
* ``canary`` — only when the canary has too few windows for the gates' intervals;
* ``finite`` — every weight and receipt finite.

A margin is INCONCLUSIVE when its 95% interval contains 0 or the value is within the policy's
``inconclusive_band`` of 0; PASS/FAIL only when the evidence clears the threshold.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, TypedDict

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

from moeaudit.judge.gates import BASELINE, FAIL, GREEN, INCONCLUSIVE, PASS, RED, YELLOW
from moeaudit.judge.why import why
from moeaudit.records import (
    Check,
    CheckpointAgreement,
    Decision,
    EnvelopeReport,
    GateEntry,
    Interval,
    Margin,
    Margins,
    Promotion,
    Status,
    Unevaluable,
    Violation,
)

PROMOTE: Final = "PROMOTE"
HOLD: Final = "HOLD"
STAGES = ("pretraining", "post-training")
# Canary windows below which the 95% window-bootstrap intervals the gates stand on are not 95%
# ones: over n windows a percentile interval covers the mean of normal window means 50% of the
# time at n = 2, 81% at 4, 88% at 8, 91% at 16 (docs/decisions.md, "A canary too small for its
# intervals"). The windows are the resampled units (`003` §5), whatever their length.
MIN_CANARY_WINDOWS: Final = 8


class NotEvaluable(str):
    """Why an envelope series that exists could not be judged (a policy's warm-up covering the
    whole window): the check is INCONCLUSIVE, never "not evaluated" and so never a pass. A
    plain string reason is a window with no series at all (docs/policy.md, "The rules in one place": not gated)."""


@dataclass(frozen=True)
class Evidence:
    """Everything a verdict is made of; plain data."""

    stage: str
    gates: Sequence[GateEntry]
    margins: Margins
    envelope: EnvelopeReport | None  # a moeaudit.envelope/v1 report over the window
    envelope_reason: str | None = None  # why there is no report
    skipped: Sequence[str] = ()  # checkpoints that could not be read
    nonfinite: Sequence[str] = ()  # "checkpoint: what" for NaN/Inf weights or receipts
    band: float = 0.0
    stage_source: str = ""
    notes: Sequence[str] = field(default_factory=tuple)
    # per checkpoint replayed below fp32: its measured agreement with fp32 (receipts' precision_agreement)
    precision_agreement: Sequence[CheckpointAgreement] = ()
    canary_windows: int | None = None  # the canary's distinct windows, the bootstrap's units


def resolve_stage(flag: str | None, policy_stage: str | None, run_stage: str | None, default: str) -> tuple[str, str]:
    """(stage, where it came from): --stage, then the run's own events.jsonl (run metadata,
    more specific than a shared policy), then the policy, then the command's default
    (docs/policy.md, "The rules in one place": pretraining for a run, post-training for a promotion between runs)."""
    for value, source in (
        (flag, "--stage"),
        (run_stage, "the run's events.jsonl"),
        (policy_stage, "policy gates.stage"),
    ):
        if value:
            return value, source
    return default, "default"


# --- checks ---------------------------------------------------------------------------------------


class _CheckFields(TypedDict, total=False):
    """The fields of a :class:`~moeaudit.records.Check` that not every check has."""

    value: float | None
    ci95: Interval | None
    problems: list[str]
    basis: str
    deciding: Violation
    unevaluable: list[Unevaluable]


def _check(name: str, status: Status | None, reason: str, **extra: Unpack[_CheckFields]) -> Check:
    return {"name": name, "evaluated": status is not None, "status": status, "reason": reason, **extra}


def health_check(gates: Sequence[GateEntry]) -> Check:
    bad = [f"{g['receipts']['checkpoint']}: {p}" for g in gates for p in g["health"]["problems"]]
    if bad:
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        return _check("health", FAIL, "below an absolute health floor — " + "; ".join(bad[:4]) + more, problems=bad)
    unresolved = [f"{g['receipts']['checkpoint']}: {p}" for g in gates for p in g["health"].get("unresolved", [])]
    if unresolved:
        more = f" (and {len(unresolved) - 3} more)" if len(unresolved) > 3 else ""
        why = next(str(g["health"]["resolution"]) for g in gates if g["health"].get("unresolved"))
        return _check(
            "health",
            INCONCLUSIVE,
            "a floor the canary does not resolve, no evidence either way — "
            + "; ".join(unresolved[:3])
            + f"{more}; {why}",
            problems=unresolved,
            basis="canary-resolution",
        )
    return _check(
        "health", PASS, f"every checkpoint ({len(gates)}) clears the dead-expert, π_min and load-entropy floors"
    )


def comparison_check(gates: Sequence[GateEntry]) -> Check:
    """At least one checkpoint compared with a baseline it is not a byte-identical copy of: two
    step names with the same digest are one checkpoint of evidence (docs/decisions.md, "Duplicates")."""
    compared = [g for g in gates if ("structural" in g or "continuity" in g) and g.get("duplicate_of") is None]
    if compared:
        return _check("comparison", PASS, f"{len(compared)} checkpoint(s) compared with a baseline")
    copies = [g for g in gates if g.get("duplicate_of") is not None]
    why = f"; {len(copies)} later checkpoint(s) are byte-identical copies of earlier ones" if copies else ""
    return _check(
        "comparison",
        INCONCLUSIVE,
        "baseline only: every distinct checkpoint is a baseline, so nothing was compared "
        f"and no preservation claim can be made (add a later checkpoint){why}",
        basis="baseline-only",
    )


def duplicates_check(gates: Sequence[GateEntry]) -> Check | None:
    """Reported, not gated: checkpoints under two step names with one digest."""
    copies = [f"step {g['step']} = step {g['duplicate_of']}" for g in gates if g.get("duplicate_of") is not None]
    if not copies:
        return None
    return _check(
        "distinct",
        None,
        "the same checkpoint digest under two step names (one "
        "checkpoint of evidence, counted once): " + ", ".join(copies),
    )


def _series_name(key: str) -> str:
    return "all layers pooled" if key == "pooled" else f"layer {key}"


def _violation_text(fv: Violation) -> str:
    what = {
        "gronwall": "exceeds its Grönwall bound (000 Eq. 12)",
        "discrete": f"exceeds the Δ-step bound from step {fv.get('from_step')} (000 Eq. 11)",
        "starvation": "has an expert starved of gradient (000 §8.1 level side)",
    }.get(fv["check"], fv["check"])
    value = "" if fv.get("value") is None else f": value {fv['value']:.4g} vs bound {fv['bound']:.4g}"
    if fv["check"] == "starvation":
        value = (
            f": expert {fv['expert']} share below {fv['bound']:.3g} on "
            f"{fv.get('fraction', 1.0):.0%} of the samples of a {fv['steps']}-step window "
            f"(lowest {fv['value']:.3g})"
        )
    return f"{_series_name(fv['layer'])} {what} at step {fv['step']}{value}"


def envelope_check(report: EnvelopeReport | None, why_not: str | None) -> Check:
    """The envelope as a PASS/FAIL gate (docs/envelope.md; docs/policy.md, "The rules in one place").

    The level (starvation) rule is scale-free and always gated. The variance bound is gated
    only under calibrated constants: Table 6's ε and δ are illustrative and raw variance has
    the model's units, so under the built-in default it is reported, never a FAIL of a run it
    was not fitted on (docs/policy.md). A gated rule the series cannot fire (too short a span)
    makes the check INCONCLUSIVE, never PASS (docs/decisions.md, "Illustrative envelope constants are reported,
    not gated")."""
    if report is None:
        status: Status | None = INCONCLUSIVE if isinstance(why_not, NotEvaluable) else None
        return _check("envelope", status, why_not or "no gradient series for this window")
    check = _policy_envelope_check(report)
    if report.get("fallback"):  # the policy's own envelope could not be evaluated here
        reason = f"built-in rules (the policy's envelope does not apply here: {report['fallback']}): {check['reason']}"
        return {**check, "reason": reason}
    return check


def _policy_envelope_check(report: EnvelopeReport) -> Check:
    window = report.get("window")
    span = f" over steps {window['from']}–{window['to']}" if window else ""
    starved = report.get("starvation") or []
    vacuous = report.get("sampling", {}).get("vacuous", [])
    if vacuous and set(vacuous) >= set(report["series"]) and not starved:  # a found starvation still fails
        return _check("envelope", None, report["sampling"]["warnings"][-1])
    gated_variance = bool(report.get("calibrated"))
    variance_ok = report.get("variance_within_bound", report.get("variance_compliant", report["compliant"]))
    if starved:
        first = min(starved, key=lambda r: (r["step"], r["layer"] == "pooled"))
        fv: Violation = {
            "layer": first["layer"],
            "step": first["step"],
            "check": "starvation",
            "expert": first["expert"],
            "value": first["share"],
            "bound": report["rules"]["starvation"]["share"],
            "steps": first["steps"],
            "fraction": first.get("fraction", 1.0),
        }
        return _check("envelope", FAIL, _violation_text(fv) + span, deciding=fv)
    first_violation = report.get("first_violation")
    if gated_variance and not variance_ok and first_violation:
        return _check("envelope", FAIL, _violation_text(first_violation) + span, deciding={**first_violation})
    unevaluable = report.get("unevaluable") or []
    if unevaluable:
        return _check(
            "envelope",
            INCONCLUSIVE,
            "not every envelope rule could be evaluated"
            f"{span}: " + "; ".join(f"{u['check']}: {u['reason']}" for u in unevaluable),
            unevaluable=list(unevaluable),
        )
    if not gated_variance:
        bound = ("within" if variance_ok else "outside") + " the illustrative variance bound"
        return _check(
            "envelope",
            PASS,
            f"no expert starved of gradient (level check){span}; the "
            f"variance series stays {bound} (000 Table 6 constants, not calibrated on this "
            f"model: reported, not gated — `moeaudit calibrate` to gate it) ({report['source']})",
        )
    return _check("envelope", PASS, f"compliant on every window and level check{span} ({report['source']})")


def margin_status(margin: Margin, band: float) -> Status:
    value, ci = margin.get("exact"), margin.get("ci95")
    if value is None:
        return FAIL
    if abs(value) < band or (ci is not None and ci[0] < 0 <= ci[1]):
        return INCONCLUSIVE
    return PASS if value >= 0 else FAIL


def _margin_text(name: str, symbol: str, m: Margin) -> str:
    if m.get("exact") is None:
        return f"{name} margin undefined: {m.get('reason', 'a receipt is not finite')}"
    ci = m.get("ci95")
    interval = "" if ci is None else f", 95% interval [{ci[0]:+.4f}, {ci[1]:+.4f}]"
    return f"{symbol} = {m['exact']:+.4f}{interval}"


def refinement_check(margin: Margin | None, stage: str, band: float) -> Check:
    if margin is None:
        return _check("refinement", None, "the last checkpoint is a baseline; nothing to compare")
    text = _margin_text("refinement", "r_ex", margin)
    value: _CheckFields = {"value": margin.get("exact"), "ci95": margin.get("ci95")}
    if stage != "post-training":
        where = (
            "pretraining run" if "stage" not in margin else f"pretraining at its base step {margin.get('against_step')}"
        )
        return _check("refinement", None, f"{where}: reported, not gated ({text})", **value)
    status = margin_status(margin, band)
    verdict = {
        PASS: "refined, not repurposed: the protected layers stayed within the budget τ",
        FAIL: "repurposing: a protected layer exceeds the budget τ",
        INCONCLUSIVE: "within noise of the budget τ",
    }[status]
    return _check("refinement", status, f"{verdict} ({text}, τ = {margin.get('tau')})", **value)


def handoff_check(margin: Margin | None, band: float) -> Check:
    if margin is None:
        return _check("handoff", None, "no --reference given")
    status = margin_status(margin, band)
    verdict = {
        PASS: "clears the reference's overlap-and-occupancy floor",
        FAIL: "falls below the reference on a protected layer",
        INCONCLUSIVE: "within noise of the reference",
    }[status]
    return _check(
        "handoff",
        status,
        f"{verdict} against {margin.get('reference')} ({_margin_text('handoff', 'h_ex', margin)})",
        value=margin.get("exact"),
        ci95=margin.get("ci95"),
    )


def _margin_stage(margin: Margin | None, stage: str) -> str:
    """The stage a refinement margin is judged by: the stage in force at its base step, where
    certify recorded it (a pair is judged by the stage at its base), else the run's."""
    return str((margin or {}).get("stage") or stage)


def checks(ev: Evidence) -> list[Check]:
    out = [
        health_check(ev.gates),
        comparison_check(ev.gates),
        envelope_check(ev.envelope, ev.envelope_reason),
        refinement_check(ev.margins.get("refinement"), _margin_stage(ev.margins.get("refinement"), ev.stage), ev.band),
        handoff_check(ev.margins.get("handoff"), ev.band),
    ]
    low = precision_check(ev.precision_agreement)
    if low is not None:
        out.append(low)
    small = canary_check(ev.canary_windows)
    if small is not None:
        out = [_on_few_windows(c, ev.canary_windows) for c in out]
        out.append(small)
    dup = duplicates_check(ev.gates)
    if dup is not None:
        out.append(dup)
    if ev.skipped:
        out.append(
            _check(
                "coverage",
                INCONCLUSIVE,
                f"checkpoint(s) skipped as unreadable or still being written: {', '.join(ev.skipped)}",
            )
        )
    bad = list(dict.fromkeys(ev.nonfinite))  # weights first, then receipts, each once
    out.append(
        _check(
            "finite",
            FAIL if bad else PASS,
            ("NaN/Inf found: " + "; ".join(bad[:5])) if bad else "every weight and receipt is finite",
        )
    )
    return out


# Checks whose FAIL rests on a window-bootstrap interval: a margin's 95% interval excluding 0.
ON_INTERVALS: Final = ("refinement", "handoff")


def _on_few_windows(check: Check, windows: int | None) -> Check:
    """A margin check's FAIL on a canary of too few windows is no evidence (its interval is not a
    95% one: :func:`canary_check`): INCONCLUSIVE, saying so. Every other check stands — the
    health floors are read on tokens, with their own resolution, and the rest on exact evidence."""
    if check["name"] not in ON_INTERVALS or check["status"] != FAIL or check.get("value") is None:
        return check  # an undefined margin (a receipt not finite) is no interval's reading
    return {
        **check,
        "status": INCONCLUSIVE,
        "reason": f"{check['reason']} — on intervals over {windows} canary window(s), which is no evidence",
    }


def few_windows(check_list: Sequence[Check]) -> bool:
    """Is the canary too small for the intervals the gates read (:func:`canary_check`)?"""
    return any(c["name"] == "canary" and c.get("basis") == "canary-size" for c in check_list)


def canary_check(windows: int | None) -> Check | None:
    """A canary of fewer than ``MIN_CANARY_WINDOWS`` distinct windows (a repeated window is no
    further unit; moeaudit/canary_units.py): every interval a gate reads (the
    canary NLL's change, C2's noise, the occupancy floors' bootstrap ranges) rests on too few
    independent units to be a 95% one, so the verdict cannot be PASS; a small canary is no
    evidence of damage, so neither is it FAIL. Not a check at all for a canary of enough windows."""
    if windows is None or windows >= MIN_CANARY_WINDOWS:
        return None
    return _check(
        "canary",
        INCONCLUSIVE,
        f"the canary has {windows} window(s) of distinct content: the 95% intervals the gates read are "
        f"window-bootstrap intervals over {windows} independent unit(s), which cover far less than 95% below "
        f"{MIN_CANARY_WINDOWS} windows; build a canary of at least {MIN_CANARY_WINDOWS} windows "
        "(`moeaudit canary build`)",
        basis="canary-size",
    )


def precision_check(agreements: Sequence[CheckpointAgreement]) -> Check | None:
    """Replays below fp32 (docs/policy.md, "Reduced precision"): the boundary evidence is INCONCLUSIVE where the
    precision's own top-k flip rate against fp32 exceeds the boundary receipts' resolution on a
    routed layer (docs/policy.md "Reduced precision"); not a check at all for fp32 certificates."""
    if not agreements:
        return None
    precision = "/".join(sorted({str(a["precision"]) for a in agreements}))
    outside = [
        (a["checkpoint"], layer, flip, a["resolution"]["layers"][layer])
        for a in agreements
        for layer, flip in a["topk_flip_rate"]["layers"].items()
        if layer in a["resolution"]["layers"] and flip > a["resolution"]["layers"][layer]
    ]
    if outside:
        shown = "; ".join(f"{c} layer {ly}: {f:.4g} > {r:.4g}" for c, ly, f, r in outside[:4])
        more = f" (and {len(outside) - 4} more)" if len(outside) > 4 else ""
        return _check(
            "precision",
            INCONCLUSIVE,
            f"{precision} replay: its top-k flip rate against fp32 exceeds the boundary receipts' resolution "
            f"({shown}{more}), so the boundary evidence lies inside the precision's disagreement",
            basis="precision-agreement",
        )
    worst = max(f for a in agreements for f in a["topk_flip_rate"]["layers"].values())
    return _check(
        "precision",
        PASS,
        f"{precision} replay: its top-k flip rate against fp32 (at most {worst:.4g}) is within the boundary "
        f"receipts' resolution on every routed layer of {len(agreements)} checkpoint(s)",
        basis="precision-agreement",
    )


# --- verdict and promotion ------------------------------------------------------------------------


def verdict(gates: Sequence[GateEntry], check_list: Sequence[Check]) -> tuple[Status, str]:
    """(verdict, why): FAIL on any RED (but on a canary of too few windows, where a RED rests on
    intervals that are no evidence: INCONCLUSIVE) or failed evaluated check; PASS when every gate is
    BASELINE/GREEN and every evaluated check passes (comparison included, so never on a
    baseline-only run); otherwise INCONCLUSIVE (a YELLOW revokes the success claim)."""
    evaluated = [c for c in check_list if c["evaluated"]]
    red = [g["step"] for g in gates if g["status"] == RED]
    failed = [c["name"] for c in evaluated if c["status"] == FAIL]
    few = few_windows(check_list)  # a RED on intervals over too few windows is no evidence
    if (red and not few) or failed:
        parts = ([f"RED at step(s) {_steps_why(gates, red)}"] if red and not few else []) + [
            f"{name} failed" for name in failed
        ]
        return FAIL, "; ".join(parts)
    yellow = [g["step"] for g in gates if g["status"] == YELLOW]
    open_checks = [c["name"] for c in evaluated if c["status"] != PASS]
    if not red and not yellow and not open_checks:
        assert all(g["status"] in (BASELINE, GREEN) for g in gates)
        return PASS, "every gate BASELINE or GREEN and every evaluated check passes"
    parts = (
        ([f"RED at step(s) {_steps_why(gates, red)} on intervals over too few canary windows"] if red else [])
        + ([f"YELLOW at step(s) {_steps_why(gates, yellow)}"] if yellow else [])
        + [f"{name} inconclusive" for name in open_checks]
    )
    return INCONCLUSIVE, "; ".join(parts)


def _steps_why(gates: Sequence[GateEntry], steps: Sequence[int], shown: int = 3) -> str:
    """ "120, 160 (120: π_min ratio 0.19 (L0); …)": the steps, and what made the first ``shown``
    of them bad (:func:`moeaudit.judge.why.why`), so a verdict names the collapse, not only where."""
    reasons = [f"{g['step']}: {w}" for g in gates if g["step"] in steps and (w := why(g))][:shown]
    more = "; …" if len([g for g in gates if g["step"] in steps]) > shown else ""
    return ", ".join(map(str, steps)) + (f" ({'; '.join(reasons)}{more})" if reasons else "")


def promotion(verdict_: str, gates: Sequence[GateEntry], few: bool = False) -> Promotion:
    """The CI gate's reading of the same verdict: promote only on PASS; a FAIL or a candidate
    that is not GREEN (README.md, "Promotion check in CI") holds; anything else (evidence within noise or tolerance of a
    threshold) is INCONCLUSIVE. On a canary of too few windows (``few``) a gate's colour rests on
    intervals that are no evidence, so only a FAIL holds."""
    if verdict_ == PASS:
        return PROMOTE
    if verdict_ == FAIL or (not few and any(g["status"] in (YELLOW, RED) for g in gates)):
        return HOLD
    return INCONCLUSIVE


def decide(ev: Evidence) -> Decision:
    check_list = checks(ev)
    v, why = verdict(ev.gates, check_list)
    return {
        "verdict": v,
        "verdict_reason": why,
        "promotion": promotion(v, ev.gates, few_windows(check_list)),
        "checks": check_list,
        "stage": ev.stage,
        "stage_source": ev.stage_source,
    }
