"""The HTML certificate (README.md, "What a certificate proves, and what it does not"): a verified statement rendered
into one self-contained page.

``render_html`` takes the statement that :func:`moeaudit.attest.certificate.open_certificate` returned
(signature already checked) and renders ``templates/certificate.html.j2`` with Jinja2 —
autoescaped, ``StrictUndefined`` — into inline CSS and SVG, with no script and no URL. The page
is a pure function of its inputs: no clock, no locale, fixed number formats, and every
collection in the statement's own order (layers and series in numeric order), so the same
statement gives the same bytes.

The template sees only the view built here (:func:`page`), never the raw predicate: every field
it reads exists, and a missing or null one is already "—" with its reason.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.bccache

from moeaudit.cache import ReceiptsCache
from moeaudit.papers import GLOSSARY, PAPERS, legend, named
from moeaudit.records import (
    Check,
    DomainHeatmap,
    EnvelopeReport,
    EnvelopeSample,
    GateEntry,
    GatesPolicy,
    Heatmaps,
    Margins,
    Occupancy,
    PolicyRecord,
    RouterSection,
    RunRecord,
    SkippedCheck,
    Statement,
)
from moeaudit.report import charts, monitors, svg
from moeaudit.report.ablation import ablation_view
from moeaudit.report.readings import by_design, gate_note, plain_margin, verdict_reasons, worsened_by_design
from moeaudit.report.svg import num, sci, sig, signed
from moeaudit.resources import templates_dir

TEMPLATE = "certificate.html.j2"
VERIFY = "moeaudit verify certificate.json --pubkey KEY.pub [--recheck]"
CHECK_ORDER = ("health", "comparison", "envelope", "refinement", "handoff")
MAX_DOMAIN_PANELS = 8
Doc = Mapping[str, Any]


def render_html(
    statement: Statement, *, keyid: str, envelope_sha256: str, compiled: ReceiptsCache | None = None
) -> str:
    """The certificate page for a verified statement; ``envelope_sha256`` is the SHA-256 of the
    signed ``certificate.json`` file the page describes."""
    return _environment(compiled).get_template(TEMPLATE).render(page(statement, keyid, envelope_sha256))


class SignedBytecode(jinja2.BytecodeCache):
    """Jinja2's compiled templates kept in the receipts cache, under its HMAC: compiling the
    certificate template is a fifth of a fully cached certify, and marshalled code is loaded
    only if this machine's moeaudit wrote it (the MAC is checked before unmarshalling)."""

    def __init__(self, store: ReceiptsCache):
        self.store = store

    def _key(self, bucket: jinja2.bccache.Bucket) -> str:
        return self.store.key("jinja-bytecode", bucket.key, bucket.checksum, jinja2.__version__, sys.version)

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        data = self.store.get_bytes(self._key(bucket))
        if data is not None:
            bucket.bytecode_from_string(data)

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        self.store.put_bytes(self._key(bucket), bucket.bytecode_to_string())


@lru_cache(maxsize=4)
def _environment(compiled: ReceiptsCache | None = None) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        bytecode_cache=SignedBytecode(compiled) if compiled is not None else None,
        finalize=svg.page_text,
    )
    env.filters["num"] = num
    env.filters["sig"] = sig
    env.filters["cite"] = cite
    return env


def cite(text: Any) -> str:
    """Document text with each paper it cites by number named at its first mention in it."""
    return named(str(text))


def layer_key(key: Any) -> tuple[int, int | str]:
    """Numeric layers in numeric order, then any other key ("pooled") by name."""
    s = str(key)
    return (0, int(s)) if s.lstrip("-").isdigit() else (1, s)


def _get(doc: Any, *path: str) -> Any:
    for key in path:
        doc = doc.get(key) if isinstance(doc, Mapping) else None
    return doc


# --- the view ------------------------------------------------------------------------------------


def page(statement: Statement, keyid: str, envelope_sha256: str) -> dict[str, Any]:
    p = statement["predicate"]
    gates = list(p.get("gates") or [])
    checks = list(p.get("checks") or [])
    protected = [int(x) for x in p.get("protected_layers") or []]
    rules: GatesPolicy | None = _get(p, "policy", "gates") or None
    stage = str(_get(p, "run", "stage") or "")
    abandoned = {str(a.get("name")) for a in _get(p, "run", "abandoned") or [] if isinstance(a, Mapping)}
    return {
        "verdict": p["verdict"],
        "verdict_why": (
            [p["verdict_reason"]] if p.get("verdict_reason") else verdict_reasons(p["verdict"], gates, checks)
        ),
        "run": run_view(p.get("run") or {}, len(gates)),
        "policy_banner": policy_banner(p.get("policy") or {}),
        "preregistration": p["preregistration"]["summary"] if "preregistration" in p else None,
        "issued_at": p.get("issued_at") or "—",
        "checks": check_rows(checks),
        "margins": margin_rows(p.get("margins") or {}, stage, rules),
        "gates": [gate_row(g, rules, stage, abandoned) for g in gates],
        # a run judged under more than one stage shows each gate's under its trend
        "gate_stages": len({g.get("stage") for g in gates}) > 1,
        "by_design": by_design(gates, stage),
        "protected": protected,
        "figures": figures(gates, protected, rules),
        "envelope": envelope_view(p.get("envelope"), checks),
        "heatmaps": heatmap_view(p.get("heatmaps"), protected),
        "router": router_view(p.get("router")),
        "monitors": monitors.view(p.get("monitors"), monitors.heatmap_loads(p)),  # docs/monitors.md
        "ablation": ablation_view(p.get("ablation")),
        "gate_claims": [claims_row(g) for g in gates],
        "table4": [
            {k: str(row.get(k) or "—") for k in ("receipt", "measures", "licenses", "does_not_license")}
            for row in p.get("claims") or []
        ],
        "digests": digests(statement, keyid, envelope_sha256),
        "verify_command": VERIFY,
        "papers": [{"number": n, "short": short, "title": title} for n, (short, title) in PAPERS.items()],
        "papers_legend": legend(),
        "glossary": GLOSSARY,
    }


def router_view(router: RouterSection | None) -> dict[str, Any] | None:
    """The gate statement and, per routed layer, the selection bias at the last checkpoint and
    its drift over the run next to the occupancy it steers."""
    if not router:
        return None
    rows = []
    for layer in sorted(router.get("layers") or [], key=lambda e: layer_key(e["layer"])):
        cps = layer.get("checkpoints") or []
        if not cps:
            continue
        first, last = cps[0], cps[-1]
        drift = [d for c in cps if (d := c.get("bias_drift")) is not None]
        rows.append(
            {
                "layer": str(layer["layer"]),
                "bias": (
                    f"{num(last.get('bias_min'))} … {num(last.get('bias_max'))}"
                    if last.get("bias_min") is not None
                    else "—"
                ),
                "drift": num(sum(drift)) if drift else "—",
                "pi_min": f"{num(first.get('pi_min'))} → {num(last.get('pi_min'))}",
                "dead": f"{first.get('dead')} → {last.get('dead')}",
            }
        )
    note: Mapping[str, Any] = router  # an open record: the family's note (moeaudit.receipts.gate)
    return {
        "gate": note.get("gate") or "—",
        "why": note.get("why") or "",
        "holds": list(note.get("holds") or []),
        "changed": list(note.get("changed") or []),
        "not_certified": list(note.get("not_certified") or []),
        "rows": rows,
    }


def run_view(run: RunRecord, gates: int) -> dict[str, Any]:
    return {
        "name": str(run.get("name") or "unnamed run"),
        "stage": str(run.get("stage") or "—"),
        "checkpoints": len(run.get("checkpoints") or []) or gates,
        "skipped": [_named(s) for s in run.get("skipped") or []],
        "abandoned": [_named(a) for a in run.get("abandoned") or []],
        "events": [
            {"step": e.get("step", "—"), "event": e.get("event", "event"), "note": str(e.get("note") or "")}
            for e in run.get("events") or []
        ],
    }


def _named(item: Any) -> dict[str, str]:
    if isinstance(item, Mapping):
        return {"name": str(item.get("name") or item.get("path") or "—"), "reason": str(item.get("reason") or "")}
    return {"name": str(item), "reason": ""}


def check_rows(checks: Sequence[Check]) -> list[dict[str, Any]]:
    rank = {name: i for i, name in enumerate(CHECK_ORDER)}
    rows = []
    for c in sorted(checks, key=lambda c: rank.get(c.get("name", ""), len(rank))):
        result = str(c.get("status") or "no status") if c.get("evaluated") else "not evaluated"
        rows.append(
            {
                "name": str(c.get("name", "—")),
                "result": result,
                "css": result.lower().replace(" ", "-"),
                "value": _value(c.get("value")),
                "reason": str(c.get("reason") or "—"),
                "all": _all_reasons(c),
            }
        )
    return rows


def _all_reasons(c: Check) -> list[str]:
    """Every reason of a check whose one-line reason ends "(and N more)": the page lists them
    all in a <details> block (no script) instead of leaving them out (docs/decisions.md, "The certificate page is
    written for the operator who reads it")."""
    problems = [str(x) for x in c.get("problems") or []]
    return problems if " more)" in str(c.get("reason") or "") else []


def _value(v: float | None) -> str:
    if v is None:
        return "—"
    return sci(v, 2) if v != 0 and abs(v) < 1e-3 else signed(v, 4)


def margin_rows(margins: Margins, stage: str = "", rules: GatesPolicy | None = None) -> list[dict[str, str]]:
    """Each lifecycle margin as one plain sentence first, its symbols and numbers after it (in a
    <details> block on the page): an operator reads the sentence, an auditor opens the numbers."""
    rows = []
    for name, m in (("refinement", margins.get("refinement")), ("handoff", margins.get("handoff"))):
        if not isinstance(m, Mapping):
            why = f": {m}" if isinstance(m, str) else ""
            rows.append(
                {
                    "name": name,
                    "exact": "—",
                    "smooth": "—",
                    "note": f"not computed{why}",
                    "plain": f"Not computed{why}.",
                }
            )
            continue
        ci = m.get("ci95")
        # "base" is no field of the record: a v2 margin names its baseline "against_step", which
        # this line does not read (the page has never shown it); kept as it renders today
        unnamed: Doc = m
        note = [
            f"95% interval [{signed(ci[0], 4)}, {signed(ci[1], 4)}]" if ci else "",
            f"τ = {m['tau']:g}" if m.get("tau") is not None else "",
            f"against {m['reference']}" if m.get("reference") else "",
            f"against the baseline at step {unnamed['base']}" if unnamed.get("base") is not None else "",
            *[str(n) for n in m.get("notes") or []],
        ]
        rows.append(
            {
                "name": name,
                "exact": signed(m.get("exact"), 4),
                "smooth": signed(m.get("smooth"), 4),
                "note": "; ".join(n for n in note if n),
                "plain": plain_margin(name, m, stage, rules.get("inconclusive_band") if rules else None),
            }
        )
    return rows


def gate_row(
    g: GateEntry, rules: GatesPolicy | None, stage: str = "", abandoned: set[str] | frozenset[str] = frozenset()
) -> dict[str, Any]:
    r = g.get("receipts") or {}
    checkpoint = str(r.get("checkpoint") or "—")
    problems = [str(x) for x in (g.get("health") or {}).get("problems") or []]
    note = gate_note(g, rules)
    if worsened_by_design(g, stage):
        note += (
            "; the canary NLL worsened, which is expected in post-training: the new objective "
            "moves the held-out canary, so the refinement margin decides, not the loss "
            "(docs/policy.md, “scalar bad”)"
        )
    if checkpoint in abandoned:
        note = "abandoned: left from a branch a resume abandoned (audited, not the model's history); " + note
    return {
        "step": g["step"],
        "status": g["status"],
        "checkpoint": checkpoint,
        "scalar": g.get("scalar") or "—",
        "stage": g.get("stage") or stage,
        "nll": r.get("nll"),
        "c2": r.get("c2_mean"),
        "state1": r.get("state1_mean"),
        "dead": r.get("dead"),
        "cv": r.get("cv_mean"),
        "entropy": r.get("entropy_norm_min"),
        "note": note,
        "problems": problems if len(problems) > 2 else [],
    }


def claims_row(g: GateEntry) -> dict[str, Any]:
    c = g.get("claims") or {}
    licensed = [str(x) for x in c.get("licensed") or []]
    problems = [str(x) for x in (g.get("health") or {}).get("problems") or []]
    return {
        "step": g["step"],
        "status": g["status"],
        "checkpoint": _get(g, "receipts", "checkpoint") or "—",
        "licensed": licensed,
        "not_licensed": [str(x) for x in c.get("not_licensed") or []],
        "more": problems if any(" more)" in x for x in licensed) else [],
    }


# --- figures -------------------------------------------------------------------------------------


def figures(gates: Sequence[GateEntry], protected: Sequence[int], rules: GatesPolicy | None = None) -> dict[str, Any]:
    """Per-layer C2 at the last gate against its baseline (Fig. 5), each bar coloured by its drop
    against the allowed drop; NLL and C2 per gate (Fig. 4)."""
    if not gates:
        return {"c2_bars": None, "c2_caption": "no gates", "loss_c2": None}
    last = gates[-1]
    base = next((g for g in gates if g["step"] == last.get("baseline") and g is not last), None)
    per_layer = sorted(_get(last, "receipts", "per_layer") or [], key=lambda e: layer_key(e["layer"]))
    base_c2 = {e["layer"]: e.get("c2") for e in _get(base, "receipts", "per_layer") or []}
    caption = f"Per-layer C2 at step {last['step']} ({last['status']})"
    if base is not None:
        caption += f"; ticks: baseline at step {base['step']}"
    points = [
        {
            "step": g["step"],
            "status": g["status"],
            "nll": _get(g, "receipts", "nll"),
            "c2": _get(g, "receipts", "c2_mean"),
        }
        for g in gates
    ]
    bars = (
        charts.c2_bars(per_layer, base_c2, protected, caption, _allowed_drops(last, base_c2, rules))
        if per_layer
        else None
    )
    return {
        "c2_bars": bars,
        "c2_caption": caption,
        "loss_c2": charts.loss_c2(points, "Canary NLL and mean C2 at each gate"),
    }


def _allowed_drops(gate: GateEntry, base_c2: Mapping[Any, Any], rules: GatesPolicy | None) -> dict[int, float]:
    """Per layer, the C2 drop the gate rule allows against the baseline: the gate's own
    tolerance on a protected layer (noise included), else max(tol_c2, tol_c2_rel·|C2_b|)."""
    structural = gate.get("structural")
    tolerance = (structural.get("c2_tolerance") if structural else None) or {}
    signed_tol = {int(k): float(v) for k, v in tolerance.items()}
    tol_c2, rel = (rules.get("tol_c2"), rules.get("tol_c2_rel")) if rules else (None, None)
    out: dict[int, float] = {}
    for layer, b in base_c2.items():
        if int(layer) in signed_tol:
            out[int(layer)] = signed_tol[int(layer)]
        elif isinstance(b, (int, float)) and isinstance(tol_c2, (int, float)):
            out[int(layer)] = max(tol_c2, (rel if isinstance(rel, (int, float)) else 0.0) * abs(b))
    return out


def _thinned(report: EnvelopeReport) -> str:
    """A long series' rows are thinned (docs/envelope.md, "Long series"): say so by the charts."""
    shown = report.get("shown") or {}
    if not shown:
        return ""
    n = max(c["samples"]["evaluated"] for c in shown.values())
    rows = max(c["samples"]["shown"] for c in shown.values())
    return (
        f"; every one of the {n} samples per series is judged, the charts draw at most {rows} "
        "(an even grid, every violation up to 100, the smallest margins)"
    )


def envelope_view(report: EnvelopeReport | None, checks: Sequence[Check]) -> dict[str, Any]:
    """The envelope report (`moeaudit.envelope/v1`): pooled chart, per-layer panels, summary."""
    if not report:
        check: Mapping[str, Any] = next((c for c in checks if c.get("name") == "envelope"), {})
        return {"missing": check.get("reason") or "no envelope series in the certificate"}
    series = report.get("series") or {}
    keys = sorted(series, key=lambda k: (k != "pooled", layer_key(k)))
    const = report.get("constants") or {}
    first = report.get("first_violation")
    check = next((c for c in checks if c.get("name") == "envelope"), {})
    decided = check.get("reason") if check.get("status") == "FAIL" else None
    gated = bool(report.get("variance_gated", report.get("calibrated")))
    within = report.get("variance_within_bound", report.get("variance_compliant", report.get("compliant")))
    reported = first is not None and not gated and first.get("check") != "starvation"
    where = (
        None
        if not first or reported
        else f"first leaves the envelope at step {first.get('step')} on "
        f"{'all layers pooled' if first.get('layer') == 'pooled' else 'layer ' + str(first.get('layer'))} "
        f"({first.get('check')} check)"
    )
    return {
        "missing": None,
        "gated": gated,
        "variance_reported": None
        if gated
        else (
            "within the illustrative bound"
            if within
            else "above the illustrative bound"
            + (f" from step {first.get('step')} ({first.get('check')} check)" if first else "")
        ),
        "check_status": check.get("status") or "—",
        "panels": [_envelope_panel(k, series[k], report, i == 0, gated) for i, k in enumerate(keys)],
        # a probe over bf16/fp16 weights computed the series in that precision, a replay in float32
        "source": (report.get("source") or "—")
        + (f", computed in {p} (a replay computes in float32)" if (p := report.get("precision")) else ""),
        "variant": report.get("variant") or "—",
        "constants": {k: const.get(k) for k in ("delta", "epsilon", "window", "budget")},
        "calibration": ("calibrated" if report.get("calibrated") else "not calibrated")
        + (f": {report['provenance']}" if report.get("provenance") else ""),
        "compliant": bool(report.get("compliant")),
        "first_violation": decided or where,
        "deciding_check": None if not first else first.get("check"),
        "skipped": [_skipped(s) for s in report.get("skipped") or []],
        "counts": f"{len(report.get('alerts') or [])} alert(s), "
        f"{len(report.get('dead_experts') or [])} dead-expert finding(s), "
        f"{len(report.get('findings') or [])} log finding(s)" + _thinned(report),
        "nulls": [
            {"series": k, "step": r.get("step"), "reason": r.get("reason") or "no value"}
            for k in keys
            for r in series[k]
            if r.get("value") is None
        ],
    }


def _envelope_panel(
    key: str, samples: Sequence[EnvelopeSample], report: EnvelopeReport, main: bool, gated: bool = True
) -> dict[str, Any]:
    wins = [w for w in report.get("windows") or [] if w.get("series") == key]
    name = "pooled over all routed layers" if key == "pooled" else f"layer {key}"
    budget = _get(report, "constants", "budget")
    chart = charts.envelope_chart(
        samples,
        wins,
        budget,
        f"Envelope: {name}",
        width=svg.W if main else 470,
        height=300 if main else 200,
        show_legend=main,
        gated=gated,
    )
    margins = [m for r in samples if (m := r.get("margin")) is not None]
    outside = [r.get("step") for r in samples if not r.get("compliant", True)]
    discrete = [
        r.get("to_step")
        for r in report.get("discrete") or []
        if r.get("series") == key and not r.get("compliant", True)
    ]
    starved = [
        f"expert {r.get('expert')} from step {r.get('since')}"
        for r in report.get("starvation") or []
        if str(r.get("layer")) == key
    ]
    failing = bool(starved or (gated and (outside or discrete)))
    shown: Mapping[str, Any] = (report.get("shown") or {}).get(key, {})  # a long series' counts
    if failing:
        status = "leaves the envelope"
    elif outside or discrete:  # the variance bound under illustrative constants: reported only
        status = "above the illustrative variance bound (reported, not gated); no expert starved"
    else:
        status = "within every check"
    return {
        "gated": gated,
        "name": name,
        "svg": chart,
        "samples": shown.get("samples", {}).get("evaluated", len(samples)),
        "windows": shown.get("windows", {}).get("evaluated", len(wins)),
        "min_margin": min(margins) if margins else None,
        "outside": outside,
        "discrete": discrete,
        "starved": starved,
        "status": status,
    }


def _skipped(s: SkippedCheck) -> str:
    where = f" between steps {s['from_step']} and {s['to_step']}" if s.get("from_step") is not None else ""
    return f"{s.get('check', 'check')}{where} — {s.get('reason') or 'no reason given'}"


# --- heatmaps ------------------------------------------------------------------------------------


def heatmap_view(h: Heatmaps | None, protected: Sequence[int]) -> dict[str, Any]:
    if not h:
        return {"occupancy": None, "domains": None}
    return {"occupancy": _occupancy(h.get("occupancy"), protected), "domains": _domains(h.get("domains"), protected)}


def _is_protected(layer: Any, protected: Sequence[int]) -> bool:
    return layer_key(layer) in [(0, q) for q in protected]


def _occupancy(occ: Occupancy | None, protected: Sequence[int]) -> dict[str, Any] | None:
    """π[layer][expert]: a list aligned with ``layers`` or a map keyed by layer."""
    if not occ or not occ.get("layers"):
        return None
    pi = occ.get("pi") or []
    rows = []
    for i, layer in enumerate(occ["layers"]):
        row = pi.get(str(layer)) if isinstance(pi, Mapping) else (pi[i] if i < len(pi) else None)
        rows.append((f"layer {layer}" + (" (P)" if _is_protected(layer, protected) else ""), _shares(list(row or []))))
    return {
        "svg": charts.heatmap(
            rows, SHARE_SCALE, "Occupancy: π per layer and expert, in units of the uniform share k/E"
        ),
        "legend": _share_legend("Color scale of π / (k/E)"),
        "step": occ.get("step"),
    }


SHARE_SCALE = 2.0  # a fixed scale, so that any two certificates compare by eye (docs/glossary.md, "Occupancy")


def _shares(row: list[float | None]) -> list[float | None]:
    """π in units of the uniform share k/E. π sums to k over the E experts (top-k routing), so
    k/E = Σπ/E: 1 is a perfectly balanced expert, 0 an unused one, 2 or more saturates."""
    known = [v for v in row if v is not None]
    total = sum(known)
    if not known or total <= 0:
        return row
    return [None if v is None else v * len(row) / total for v in row]


def _share_legend(label: str) -> Any:
    return charts.heat_legend(
        SHARE_SCALE,
        1.0,
        label,
        caption="π / (k/E): an expert's share of the "
        "routed tokens against a uniform split (fixed scale 0–2; ≥ 2 saturates)",
        mean_label="uniform share",
    )


def _domains(dom: DomainHeatmap | None, protected: Sequence[int]) -> dict[str, Any] | None:
    """Small multiples of domain × expert π, one per layer (protected ones when there are many)."""
    if not dom or not dom.get("layers"):
        return None
    layers = sorted(dom["layers"], key=layer_key)
    shown = layers
    if len(layers) > MAX_DOMAIN_PANELS:
        shown = ([k for k in layers if _is_protected(k, protected)] or layers)[:MAX_DOMAIN_PANELS]
    names = [str(n) for n in dom.get("names") or []]
    grids = {k: [(n, _shares(list(dom["layers"][k].get(n) or []))) for n in names or dom["layers"][k]] for k in shown}
    panels = []
    for k, rows in grids.items():
        title = f"layer {k}" + (" · protected" if _is_protected(k, protected) else "")
        panels.append(
            charts.heatmap(
                rows, SHARE_SCALE, f"Domain routing: π / (k/E), {title}", width=470, left=80, cell_h=26, title=title
            )
        )
    legend = charts.heat_legend(
        SHARE_SCALE,
        1.0,
        "Color scale of π / (k/E)",
        caption="π / (k/E): the "
        "domain's share of an expert's routed tokens against a uniform split "
        "(fixed scale 0–2; ≥ 2 saturates)",
        mean_label="uniform share",
        zero_label="no tokens from this domain (π = 0)",
    )
    return {
        "panels": panels,
        "legend": legend,
        "step": dom.get("step"),
        "omitted": [k for k in layers if k not in shown],
    }


def policy_banner(policy: PolicyRecord) -> str:
    """Under which policy the verdict was reached: the built-in default (uncalibrated), or a
    policy file and what it was calibrated on (gate tolerances and envelope constants)."""
    source = str(policy.get("source") or "source not stated")
    gates, env = policy.get("gates") or {}, policy.get("envelope") or {}
    if source == "built-in default":
        return (
            "built-in default, uncalibrated: built-in gate tolerances; Gradient Starvation Envelope "
            "(000) Table 6 constants, so the variance bound is reported, not gated"
        )
    tol = f"gate tolerances {gates['provenance']}" if gates.get("calibrated") else "built-in gate tolerances"
    if env.get("calibrated"):
        where = str(env.get("provenance") or "").split(":")[0] or "a healthy run"
        constants = f"envelope constants {where}"
    else:
        constants = "envelope constants not calibrated (the variance bound is reported, not gated)"
    return f"{source}: {tol}; {constants}"


def digests(statement: Statement, keyid: str, envelope_sha256: str) -> dict[str, Any]:
    """Everything a reader needs to verify the certificate and re-run the audit."""
    p = statement["predicate"]
    canary, policy, tool = p.get("canary") or {}, p.get("policy") or {}, p.get("tool") or {}
    shape = (
        f"{canary['windows']} windows × {canary.get('window_len', '?')} tokens"
        if canary.get("windows") is not None
        else ""
    )
    if canary.get("domains"):
        shape += ("; " if shape else "") + "domains: " + ", ".join(map(str, canary["domains"]))
    calibrated = policy.get("calibrated")
    return {
        "subjects": [
            {"name": str(s.get("name", "—")), "sha256": str(_get(s, "digest", "sha256") or "—")}
            for s in statement.get("subject") or []
        ],
        "canary": _get(canary, "digest", "sha256") or "—",
        "canary_shape": shape,
        "policy": policy.get("digest") or "—",
        "policy_note": str(policy.get("source") or "source not stated")
        + ("" if calibrated is None else ", calibrated" if calibrated else ", not calibrated"),
        "keyid": keyid,
        "envelope": envelope_sha256,
        "statement_type": statement.get("_type") or "—",
        "predicate_type": statement.get("predicateType") or "—",
        "tool": f"{tool.get('name') or 'moeaudit'} {tool.get('version') or ''}".strip(),
        "environment": " · ".join(f"{k} {v}" for k, v in sorted((p.get("environment") or {}).items())) or "—",
    }
