"""The evidence model of the compliance export: aspects, items, frameworks, and the selectors
that read one verified statement into :class:`Evidence` (docs/compliance.md).

A selector checks that a result was actually produced, not just that a field exists: it
returns ``shown=False`` with the reason when the certificate does not back the aspect. The
frameworks built from these records are data (:mod:`moeaudit.report.frameworks`); the export
and its renderers are :mod:`moeaudit.report.export`. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moeaudit.records import VerifiedStatement

COVERED, PARTIAL, NOT_COVERED = "covered", "partial", "not covered"
OUTSIDE = "no field of a training-health certificate records this"


@dataclass(frozen=True)
class Evidence:
    field: str  # where in the statement, e.g. "predicate.gates[].status"
    summary: str  # the value; or, when not shown, why the field does not back the aspect
    shown: bool = True


Selector = Callable[[VerifiedStatement], Evidence]


# The Model Documentation Form marks each field with who it is for (the AI Office, national
# competent authorities, downstream providers); an aspect of another framework carries none.
AIO, NCA, DP = "AI Office", "national competent authorities", "downstream providers"


@dataclass(frozen=True)
class Aspect:
    what: str
    selectors: tuple[Selector, ...] = ()  # empty: no certificate field can show this
    audiences: tuple[str, ...] = ()  # the Form's audience flags (empty: not an audience form)
    fields: tuple[str, ...] = ()  # the Form's fields the aspect answers (keys of FORM_FIELDS)


@dataclass(frozen=True)
class Item:
    id: str
    requirement: str  # one-sentence paraphrase
    aspects: tuple[Aspect, ...]
    context: tuple[tuple[Selector, str], ...] = ()  # (related field, why it is not evidence)
    note: str = ""


@dataclass(frozen=True)
class Framework:
    key: str
    title: str
    source: str
    note: str
    items: tuple[Item, ...]
    audience: str = ""  # the Form's audience this view is for (empty: the whole framework)


# --- selectors: verified statement → evidence -------------------------------------------------


def _p(stmt: VerifiedStatement) -> Mapping[str, Any]:
    return stmt.get("predicate") or {}


def _g(x: Any) -> str:
    return "—" if x is None else (format(x, ".4g") if isinstance(x, float) else str(x))


def _gates(stmt: VerifiedStatement) -> list[Mapping[str, Any]]:
    return list(_p(stmt).get("gates") or [])


def _check(stmt: VerifiedStatement, name: str) -> Mapping[str, Any]:
    return next((c for c in _p(stmt).get("checks") or [] if c.get("name") == name), {})


def _find(obj: Any, key: str) -> list[Any]:
    """Every non-empty value of ``key`` anywhere inside ``obj``."""
    if isinstance(obj, Mapping):
        here = [obj[key]] if obj.get(key) else []
        return here + [x for v in obj.values() for x in _find(v, key)]
    if isinstance(obj, list):
        return [x for v in obj for x in _find(v, key)]
    return []


def signature(stmt: VerifiedStatement) -> Evidence:
    keyid, at, field = stmt.get("_keyid"), _p(stmt).get("issued_at"), "DSSE signature, predicate.issued_at"
    if not keyid or not at:
        return Evidence(field, "no verified signature or issue time", False)
    return Evidence(field, f"DSSE signature over the whole statement, verified against key {keyid[:16]}…; issued {at}")


def subjects(stmt: VerifiedStatement) -> Evidence:
    subs = stmt.get("subject") or []
    if not subs:
        return Evidence("subject[]", "no checkpoint is named", False)
    named = ", ".join(f"{s.get('name')} ({str((s.get('digest') or {}).get('sha256'))[:12]}…)" for s in subs[:6]) + (
        f", and {len(subs) - 6} more" if len(subs) > 6 else ""
    )
    return Evidence(
        "subject[].digest.sha256",
        f"{len(subs)} checkpoint(s) pinned by their OpenSSF model-signing root digest: {named}",
    )


def gate_progression(stmt: VerifiedStatement) -> Evidence:
    gates = _gates(stmt)
    if not gates:
        return Evidence("predicate.gates[]", "the certificate has no gates", False)
    seq = " → ".join(f"{g['step']} {g['status']}" for g in gates[:12])
    seq += " → …" if len(gates) > 12 else ""
    skipped = (_p(stmt).get("run") or {}).get("skipped") or []
    tail = f"; {len(skipped)} skipped checkpoint(s) named in run.skipped" if skipped else ""
    return Evidence("predicate.gates[].status", f"{len(gates)} gate(s): {seq}{tail}")


def compared_gates(stmt: VerifiedStatement) -> Evidence:
    field = "predicate.gates[].structural"
    compared = [
        g
        for g in _gates(stmt)
        if "structural" in g or "continuity" in g or (g.get("status") != "BASELINE" and "new_baseline" not in g)
    ]
    if not compared:
        return Evidence(field, "every gate is a baseline: nothing was compared", False)
    bad = [f"{g['step']} {g['status']}" for g in compared if g.get("status") != "GREEN"]
    return Evidence(
        field,
        f"{len(compared)} gate(s) compared with their active baseline (C2 on "
        "protected layers, dead experts, π_min and entropy floors); "
        + (f"not GREEN: {', '.join(bad)}" if bad else "all GREEN"),
    )


def gate_metrics(stmt: VerifiedStatement) -> Evidence:
    gates = [g for g in _gates(stmt) if g.get("receipts")]
    if not gates:
        return Evidence("predicate.gates[].receipts", "no receipts at any gate", False)
    last = gates[-1]
    r = last["receipts"]
    return Evidence(
        "predicate.gates[].receipts",
        f"at each of {len(gates)} gate(s): canary NLL, "
        "C2, State1 margin, dead experts, CV, normalised entropy, per layer; at step "
        f"{last['step']}: NLL {_g(r.get('nll'))}, mean C2 {_g(r.get('c2_mean'))}, "
        f"dead experts {_g(r.get('dead'))}",
    )


def nll_series(stmt: VerifiedStatement) -> Evidence:
    pts = [(g["step"], (g.get("receipts") or {}).get("nll")) for g in _gates(stmt)]
    pts = [(s, v) for s, v in pts if v is not None]
    if not pts:
        return Evidence("predicate.gates[].receipts.nll", "no canary NLL recorded", False)
    return Evidence(
        "predicate.gates[].receipts.nll",
        f"canary NLL {_g(pts[0][1])} at step {pts[0][0]} → {_g(pts[-1][1])} at step {pts[-1][0]} ({len(pts)} gate(s))",
    )


def nll_by_domain(stmt: VerifiedStatement) -> Evidence:
    found = _find(_gates(stmt), "nll_by_domain")
    if not found:
        return Evidence(
            "predicate.gates[].receipts",
            "the gates carry the overall canary NLL "
            "only; NLL by domain is in receipts/*.json, outside the signed payload",
            False,
        )
    return Evidence("predicate.gates[].receipts.nll_by_domain", f"NLL by domain at {len(found)} gate(s)")


def ci95(stmt: VerifiedStatement) -> Evidence:
    found = _find(_gates(stmt), "ci95")
    boot = _g(((_p(stmt).get("policy") or {}).get("receipts") or {}).get("bootstrap"))
    if not found:
        return Evidence(
            "predicate.gates[].receipts",
            "the gates carry point values only; the "
            f"window-bootstrap ci95 intervals ({boot} resamples per the policy) are in "
            "receipts/*.json, outside the signed payload",
            False,
        )
    return Evidence(
        "predicate.gates[].receipts.*.ci95",
        f"95% window-bootstrap intervals on {len(found)} receipt group(s), {boot} resamples",
    )


def verdict(stmt: VerifiedStatement) -> Evidence:
    p = _p(stmt)
    checks = [
        f"{c.get('name')} {c.get('status') if c.get('evaluated') else 'not evaluated'}" for c in p.get("checks") or []
    ]
    return Evidence(
        "predicate.verdict, predicate.checks[]",
        f"verdict {p.get('verdict')}" + (f"; checks: {', '.join(checks)}" if checks else ""),
        p.get("verdict") is not None,
    )


def canary(stmt: VerifiedStatement) -> Evidence:
    c = _p(stmt).get("canary") or {}
    digest = (c.get("digest") or {}).get("sha256")
    if not digest:
        return Evidence("predicate.canary", "no canary digest", False)
    domains = ", ".join(map(str, c.get("domains") or [])) or "—"
    mismatches = c.get("mismatches") or []
    where = ", ".join(str(m.get("source")) for m in mismatches if isinstance(m, Mapping))
    return Evidence(
        "predicate.canary",
        f"{_g(c.get('windows'))} token windows × "
        f"{_g(c.get('window_len'))} tokens, domains {domains}; SHA-256 {digest[:16]}…"
        + (f"; NOT the run's canary (recorded otherwise in {where}; accepted as a finding)" if mismatches else ""),
    )


def policy(stmt: VerifiedStatement) -> Evidence:
    pol = _p(stmt).get("policy") or {}
    if not pol.get("digest"):
        return Evidence("predicate.policy", "no policy digest", False)
    g, m = pol.get("gates") or {}, pol.get("margins") or {}
    cal = "calibrated" if pol.get("calibrated") else "illustrative (not calibrated)"
    return Evidence(
        "predicate.policy",
        f"{pol.get('source')}, digest {pol['digest'][:16]}…, every "
        f"constant included (tol_c2 {_g(g.get('tol_c2'))}, escalate_after "
        f"{_g(g.get('escalate_after'))}, τ {_g(m.get('tau'))}); envelope constants "
        f"{cal}",
    )


def tool(stmt: VerifiedStatement) -> Evidence:
    t = _p(stmt).get("tool") or {}
    return Evidence(
        "predicate.tool",
        f"{t.get('name')} {t.get('version')}: the receipt definitions and their oracle tests belong to this version",
        bool(t.get("version")),
    )


def environment(stmt: VerifiedStatement) -> Evidence:
    e = _p(stmt).get("environment") or {}
    low = e.get("precision")  # a replay below fp32 (absent: fp32, the reference)
    return Evidence(
        "predicate.environment",
        f"torch {_g(e.get('torch'))}, device {_g(e.get('device'))}, dtype {_g(e.get('dtype'))}"
        + (f", computed in {low} (its agreement with fp32: predicate.precisionAgreement)" if low else ""),
        bool(e),
    )


def run_steps(stmt: VerifiedStatement) -> Evidence:
    run = _p(stmt).get("run") or {}
    steps = ", ".join(map(str, run.get("checkpoints") or []))
    return Evidence(
        "predicate.run", f"stage {run.get('stage') or '—'}, checkpoints at steps {steps or '—'}", bool(steps)
    )


def events(stmt: VerifiedStatement) -> Evidence:
    evs = (_p(stmt).get("run") or {}).get("events")
    if not isinstance(evs, list):
        return Evidence("predicate.run.events", "events were not recorded", False)
    told = "; ".join(f"{e.get('event')} at step {e.get('step')}" for e in evs)
    bases = ", ".join(
        f"{g['step']} ({g.get('reason') or 'baseline'})" for g in _gates(stmt) if g.get("status") == "BASELINE"
    )
    told = told or "no resume or regime change recorded"
    return Evidence("predicate.run.events, baseline gates", f"{told}; baselines at {bases or '—'}")


def claims(stmt: VerifiedStatement) -> Evidence:
    rows = _p(stmt).get("claims") or []
    if not rows:
        return Evidence("predicate.claims", "no claims table", False)
    gated = sum(len((g.get("claims") or {}).get("not_licensed") or []) for g in _gates(stmt))
    text = (
        f"{len(rows)} receipts, each with what it measures, licenses and does not license "
        f"(003 Table 4); {gated} not-licensed claim(s) written at the gates"
    )
    where = "predicate.claims, predicate.gates[].claims"
    router = _p(stmt).get("router")
    if router:  # a biased or group-limited gate: the certificate narrows what it covers
        text += (
            f"; router gate '{router.get('gate')}' is outside 003 Theorem 1's bias-free "
            f"linear assumption: {len(router.get('not_certified') or [])} statement(s) "
            "not certified for it"
        )
        where += ", predicate.router"
    return Evidence(where, text)


def envelope(stmt: VerifiedStatement) -> Evidence:
    env, chk = _p(stmt).get("envelope"), _check(stmt, "envelope")
    if not env or not chk.get("evaluated"):
        why = str(chk.get("reason") or "no series")
        return Evidence("predicate.envelope", f"not evaluated: {why}", False)
    wins = env.get("windows") or []
    shown = env.get("shown") or {}  # a long series: windows thinned, counted over all of them
    count = sum(c["windows"]["evaluated"] for c in shown.values()) if shown else len(wins)
    low = min((w["min_margin"] for w in wins if w.get("min_margin") is not None), default=None)
    k = env.get("constants") or {}
    cal = "calibrated" if env.get("calibrated") else "illustrative"
    gated = env.get("variance_gated", env.get("calibrated"))
    if gated:
        rules = f"{'compliant' if env.get('compliant') else 'NOT compliant'} (every gated rule)"
    else:  # a quantity reported, not gated, is named so (docs/policy.md, "envelope")
        within = env.get("variance_within_bound", env.get("variance_compliant"))
        rules = (
            f"{'compliant' if env.get('compliant') else 'NOT compliant'} on the gated level check "
            f"(starvation); variance bound reported, not gated: "
            f"{'within' if within else 'above'} the illustrative bound"
        )
    return Evidence(
        "predicate.envelope",
        f"{env.get('source')} series ({env.get('variant')} variance), {rules} over "
        f"{count} window(s), min Grönwall margin {_g(low)}, δ "
        f"{_g(k.get('delta'))}, ε {_g(k.get('epsilon'))} ({cal}); check "
        f"{chk.get('status')}",
    )


def routed_shape(stmt: VerifiedStatement) -> Evidence:
    occ = (_p(stmt).get("heatmaps") or {}).get("occupancy") or {}
    layers, pi = occ.get("layers") or [], occ.get("pi") or []
    rows = list(pi.values()) if isinstance(pi, Mapping) else list(pi)
    experts = sorted({len(r) for r in rows if isinstance(r, list)})
    if not layers or not experts:
        return Evidence("predicate.heatmaps.occupancy", "no occupancy heatmap", False)
    return Evidence(
        "predicate.heatmaps.occupancy",
        f"{len(layers)} routed layer(s) × {'/'.join(map(str, experts))} experts, as replayed",
    )


def _margin(stmt: VerifiedStatement, name: str, gated_only: bool) -> Evidence:
    m, chk = (_p(stmt).get("margins") or {}).get(name), _check(stmt, name)
    field = f"predicate.margins.{name}"
    if not isinstance(m, Mapping) or (gated_only and not chk.get("evaluated")):
        return Evidence(field, "not evaluated: " + str(chk.get("reason") or "no margin"), False)
    how = (
        f"gated: {chk.get('status')}"
        if chk.get("evaluated")
        else f"reported, not gated: {chk.get('reason') or 'not evaluated'}"
    )
    return Evidence(field, f"exact {_g(m.get('exact'))}, smooth {_g(m.get('smooth'))}; {how}")


def refinement(stmt: VerifiedStatement) -> Evidence:
    return _margin(stmt, "refinement", gated_only=False)


def refinement_gated(stmt: VerifiedStatement) -> Evidence:
    return _margin(stmt, "refinement", gated_only=True)


def handoff(stmt: VerifiedStatement) -> Evidence:
    return _margin(stmt, "handoff", gated_only=True)


# --- measured quantities: parameters from the weights, the audit's own compute --------------------


def two_significant(n: float) -> str:
    """``n`` to two significant figures as the Model Documentation Form writes it
    (``7.3*10^10``); below 100 the number itself."""
    if n == 0:
        return "0"
    exp = math.floor(math.log10(abs(n)))
    mant = round(n / 10**exp, 1)
    if mant >= 10:  # 9.96 rounds to 10.0
        mant, exp = mant / 10, exp + 1
    if exp < 2:
        return f"{mant * 10**exp:.{max(0, 1 - exp)}f}"
    return f"{mant:.1f}*10^{exp}"


def parameters(stmt: VerifiedStatement) -> Evidence:
    c = _p(stmt).get("parameters")
    if not isinstance(c, Mapping) or not isinstance(c.get("total"), int):
        return Evidence("predicate.parameters", "not counted: this certificate predates parameter counts", False)
    shared = c.get("shared_experts")
    shared = f", shared experts ({two_significant(shared)}) counted as active" if shared else ""
    return Evidence(
        "predicate.parameters",
        f"{two_significant(c['total'])} parameters in total ({c['total']}), "
        f"{two_significant(c['active'])} active per token ({c['active']}): every parameter outside the "
        f"routed experts plus top-{c.get('top_k')}/{c.get('num_experts')} of the routed experts' "
        f"{two_significant(c['routed_experts'])}{shared}; counted from the safetensors headers of "
        f"{c.get('checkpoint')}, a signed subject",
    )


def _replays(c: Mapping[str, Any]) -> str:
    names = [str(r.get("receipt")) for r in c.get("replays") or []]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def audit_flops(stmt: VerifiedStatement) -> Evidence:
    c = _p(stmt).get("compute")
    if not isinstance(c, Mapping):
        return Evidence("predicate.compute.flops", "not counted: this certificate predates compute counts", False)
    if c.get("flops") is None:
        why = "not counted: the receipts came from a cache made before their replays' cost was recorded"
        return Evidence("predicate.compute.flops", why, False)
    ranks = (_p(stmt).get("environment") or {}).get("world_size")
    lower = f"; rank 0's share of a {ranks}-rank replay: a lower bound" if isinstance(ranks, int) and ranks > 1 else ""
    replays = c.get("replays") or []
    carried = sum(1 for r in replays if r.get("flops_from"))
    how = (
        f" ({len(replays) - carried} metered; {carried} ran the same products on the same shapes as a metered "
        "one and carry its count)"
        if carried
        else ""
    )
    return Evidence(
        "predicate.compute.flops",
        f"{two_significant(c['flops'])} FLOPs ({c['flops']}){lower} used by the audit's "
        f"{len(replays)} replay(s){how}, receipts {_replays(c)}; counted by {c.get('counted_by')}. "
        "The audit's compute, not the training's",
    )


def audit_energy(stmt: VerifiedStatement) -> Evidence:
    c = _p(stmt).get("compute")
    if not isinstance(c, Mapping):
        return Evidence("predicate.compute.energy_joules", "not measured: this certificate predates it", False)
    joules = c.get("energy_joules")
    if joules is None:
        return Evidence("predicate.compute.energy_joules", str(c.get("energy_reason") or "not measured"), False)
    return Evidence(
        "predicate.compute.energy_joules",
        f"{two_significant(joules / 3.6e9)} MWh ({joules:.6g} J) used by the GPU during the audit's "
        f"{len(c.get('replays') or [])} replay(s), receipts {_replays(c)}; measured by {c.get('energy_by')}. "
        "The audit's energy, not the training's",
    )


def monitoring_logs(stmt: VerifiedStatement) -> Evidence:
    inputs = _p(stmt).get("inputs") or {}
    logs = [f"{k} {str((inputs[k] or {}).get('sha256'))[:12]}…" for k in ("metrics", "probe") if inputs.get(k)]
    if not logs:
        return Evidence("predicate.inputs", "no training log or canary probe log was bound", False)
    return Evidence(
        "predicate.inputs.metrics, predicate.inputs.probe",
        "the training callback's logs, hashed as parsed and signed: " + ", ".join(logs),
    )


def checkpoint_files(stmt: VerifiedStatement) -> Evidence:
    files = _p(stmt).get("checkpoint_files") or []
    if not files:
        return Evidence("predicate.checkpoint_files", "the certificate does not list the checkpoints' files", False)
    count = sum(len(f.get("resources") or []) for f in files)
    return Evidence(
        "predicate.checkpoint_files",
        f"{count} file(s) of {len(files)} checkpoint(s), each with its size and SHA-256, signed",
    )


def preregistration(stmt: VerifiedStatement) -> Evidence:
    pre = _p(stmt).get("preregistration")
    if not pre:
        why = "no preregistration: the certificate does not show when the criteria were fixed"
        return Evidence("predicate.preregistration", why, False)
    # Shown only when certify found the criteria matched and preregistered before the first
    # audited checkpoint (docs/security.md, "Preregistered criteria"); absent, mismatch and
    # after are findings, named with the signed summary.
    summary = str(pre.get("summary") or "")
    if pre.get("status") == "absent":
        return Evidence("predicate.preregistration", f"no preregistration: {summary}", False)
    shown = pre.get("status") == "matched" and pre.get("ordering") == "before"
    return Evidence("predicate.preregistration", summary, shown)
