"""``moeaudit gate``: promote or hold a candidate checkpoint against its base (SPEC §9, CI gate).

Promote (exit 0) when the candidate's gate against the base is GREEN, its exact refinement
margin is ≥ 0 (dropped for a pretraining policy), its handoff margin is ≥ 0 when a reference
is given, the envelope holds when training logs are available, and no weight is non-finite;
otherwise hold (exit 1), naming the failed conditions. Evidence within the policy's
``inconclusive_band`` of a threshold is INCONCLUSIVE (exit 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from moeaudit.judge.gates import structural
from moeaudit.judge.policy import Policy

PROMOTE, HOLD, INCONCLUSIVE = "PROMOTE", "HOLD", "INCONCLUSIVE"


def _condition(name: str, ok: bool | None, value: float | None, threshold: float | None, band: float,
               detail: str) -> dict[str, Any]:
    near = value is not None and threshold is not None and abs(value - threshold) < band
    status = "skipped" if ok is None else ("inconclusive" if near else ("pass" if ok else "fail"))
    return {"name": name, "status": status, "value": value, "threshold": threshold, "detail": detail}


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:+.4f}"


def decide(compare_doc: dict[str, Any], policy: Policy, envelope: dict[str, Any] | str | None) -> dict[str, Any]:
    g, band = policy.gates, policy.gates.inconclusive_band
    base, cand = compare_doc["base"], compare_doc["candidate"]
    st = structural(cand, base, compare_doc["protected_layers"], g)
    conds = [
        _condition("gate GREEN (C2)", st["c2_ok"], st["c2_min_delta"],
                   -max(st["c2_tolerance"].values(), default=g.tol_c2), band,
                   f"min protected-layer ΔC2 {_f(st['c2_min_delta'])}; allowed drop per layer "
                   f"{ {k: round(v, 4) for k, v in st['c2_tolerance'].items()} } (max of tol_c2 and the "
                   f"bootstrap noise); fallen on {st['c2_fallen_layers'] or 'none'}"),
        _condition("gate GREEN (occupancy)", st["occupancy_ok"], None, None, band,
                   f"more dead experts on layers {st['layers_with_more_dead']}, π_min ratio "
                   f"{_r(st['pi_min_ratio'])} (floor {g.pi_min_ratio_floor}), entropy ratio "
                   f"{_r(st['entropy_ratio'])} (floor {g.entropy_ratio_floor})"),
    ]
    ref = compare_doc["margins"]["refinement"]
    stage = g.stage or "post-training"  # a promotion is post-training unless the policy says otherwise
    if stage == "pretraining":
        conds.append(_condition("refinement r_ex ≥ 0", None, ref["exact"], 0.0, band,
                                "pretraining policy: refinement is reported, not gated"))
    elif ref["exact"] is None:
        conds.append(_condition("refinement r_ex ≥ 0", False, None, None, band, ref.get("reason", "undefined")))
    else:
        conds.append(_condition("refinement r_ex ≥ 0", ref["exact"] >= 0, ref["exact"], 0.0, band,
                                f"r_ex = {ref['exact']:+.4f} (τ = {ref['tau']})"))
    hand = compare_doc["margins"]["handoff"]
    if hand is not None and hand["exact"] is None:
        conds.append(_condition("handoff h_ex ≥ 0", False, None, None, band, hand.get("reason", "undefined")))
    else:
        conds.append(_condition("handoff h_ex ≥ 0", None if hand is None else hand["exact"] >= 0,
                                None if hand is None else hand["exact"], 0.0, band,
                                "no --reference" if hand is None else f"h_ex = {hand['exact']:+.4f}"))
    if envelope is None or isinstance(envelope, str):
        conds.append(_condition("envelope holds", None, None, None, band,
                                envelope or "no training logs (metrics.jsonl) beside the candidate"))
    else:
        conds.append(_condition("envelope holds", envelope["compliant"], None, None, band,
                                f"first violation: {envelope['first_violation']}"))
    bad = cand["nonfinite_weights"] + [f["path"] for f in cand.get("nonfinite", [])]
    conds.append(_condition("all weights finite", not bad, None, None, band,
                            "; ".join(bad[:5]) if bad else "every weight and receipt is finite"))
    statuses = {c["status"] for c in conds}
    decision = HOLD if "fail" in statuses else INCONCLUSIVE if "inconclusive" in statuses else PROMOTE
    return {"decision": decision, "conditions": conds, "base": base["checkpoint"]["name"],
            "candidate": cand["checkpoint"]["name"], "stage": stage}


def junit_xml(result: dict[str, Any]) -> str:
    cases = []
    for c in result["conditions"]:
        inner = ""
        if c["status"] == "fail":
            inner = f"<failure message={quoteattr(c['detail'])}/>"
        elif c["status"] in ("skipped", "inconclusive"):
            inner = f"<skipped message={quoteattr(c['status'] + ': ' + c['detail'])}/>"
        cases.append(f'  <testcase classname="moeaudit.gate" name={quoteattr(c["name"])}>{inner}</testcase>')
    failures = sum(c["status"] == "fail" for c in result["conditions"])
    skipped = sum(c["status"] in ("skipped", "inconclusive") for c in result["conditions"])
    name = escape(f"{result['base']} → {result['candidate']}")
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name="moeaudit gate: {name}" '
            f'tests="{len(cases)}" failures="{failures}" skipped="{skipped}">\n' + "\n".join(cases)
            + "\n</testsuite>\n")


def markdown_summary(result: dict[str, Any]) -> str:
    icon = {"PROMOTE": "✅", "HOLD": "⛔", "INCONCLUSIVE": "⚠️"}[result["decision"]]
    lines = [f"### {icon} moeaudit gate: {result['decision']} — `{result['base']}` → `{result['candidate']}`",
             "", "| condition | status | detail |", "|---|---|---|"]
    lines += [f"| {c['name']} | {c['status']} | {c['detail'].replace('|', '/')} |" for c in result["conditions"]]
    return "\n".join(lines) + "\n"


def logs_envelope(candidate: Path, policy: Policy, spec: Any = None) -> dict[str, Any] | str | None:
    """The envelope over the candidate's run logs, when its run directory has metrics.jsonl
    (canary_probe.jsonl when the policy's source is ``probe``); a string when the policy's
    calibrated constants do not apply to this promotion."""
    from moeaudit.run import PROBE_FILE

    probe = policy.envelope.source == "probe"
    metrics = candidate.resolve().parent / (PROBE_FILE if probe else "metrics.jsonl")
    if not metrics.is_file():
        return None
    if spec is not None:
        from moeaudit.series import envelope_applies

        why = envelope_applies(policy.envelope, policy.gates.stage or "post-training", spec)
        if why:
            return why
    from moeaudit.judge import envelope as env
    from moeaudit.metrics import read_metrics

    series = env.from_metrics(read_metrics(metrics), policy.envelope.variant,
                              "probe" if probe else "logs")
    return env.evaluate(series.since(policy.envelope.warmup_steps), policy.envelope, policy_path=policy.source)
