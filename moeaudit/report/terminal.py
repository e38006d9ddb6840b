"""What the commands print on a terminal (rich), apart from the commands themselves.

Off a terminal (pipes, CI logs, tests) the consoles are a fixed 140 columns, so the output is
the same bytes everywhere. The library never prints; ``cli.py`` calls these with its results.

Text from a document (names, reasons, paths, domains) goes through :func:`esc` before rich sees
it: rich reads "[calibrated]" or "[/b]" as markup and would drop it or fail. A paper cited by
number is named at its first mention in each report (:func:`moeaudit.papers.named`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moeaudit.papers import named
from moeaudit.records import (
    CompareDocument,
    EnvelopeComparison,
    EnvelopeReport,
    GateResult,
    MonitorLayer,
    Predicate,
    Receipts,
    ReceiptsLayer,
)
from moeaudit.report.fit import Column, print_fitted


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader closed the output (``| head``). rich exits 1, which reads as a failed
        policy; this is an operating-system error (exit 4, one line on stderr) instead."""
        import errno
        import os
        import sys

        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        broken = sys.stderr if self.stderr else sys.stdout
        os.dup2(devnull, broken.fileno())  # nothing more reaches the closed pipe, at exit either
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def _console(stderr: bool = False) -> Console:
    """Rich console; off a terminal a fixed 140 columns."""
    probe = Console(stderr=stderr)
    return _Console(stderr=stderr, highlight=False, width=None if probe.is_terminal else 140)


out = _console()
err = _console(stderr=True)


def warn(message: str) -> None:
    """One line on stderr, never wrapped (warnings are grepped by CI logs and tests)."""
    err.print(named(message), soft_wrap=True, markup=False)


def esc(value: Any) -> str:
    """Any value as literal text for a rich markup string."""
    return escape(str(value))


def print_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False))


def fmt(x: Any, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec)


def _right(*headers: str) -> tuple[Column, ...]:
    return tuple(Column(h, "right") for h in headers)


RECEIPT_COLUMNS = _right("layer", "dead", "π_min", "CV", "H_norm", "State1", "flip", "C2", "C2~", "ḡ", "var_grad_norm")
ENVELOPE_COLUMNS = (
    Column("series"),
    *_right("samples", "min Grönwall margin"),
    Column("Grönwall (Eq. 12)"),
    Column("Δ-step (Eq. 11)"),
    Column("starved experts", "right"),
    Column("gated rules ok"),
)
COMPARE_COLUMNS = _right(
    "layer", "dead", "π_min", "State1", "C2", "coord", "boundary", "transition", "content", "router Δ"
)


def print_receipts(doc: Receipts) -> None:
    seen: set[str] = set()  # papers named so far in this report
    receipts_header(doc)
    rows, styles = [], []
    for layer in doc["layers"]:
        o, b, c = layer["occupancy"], layer["boundary"], layer["overlap"]
        g = layer.get("gradients", {})
        rows.append(
            [
                str(layer["layer"]),
                str(o["dead"]),
                fmt(o["pi_min"], ".3f"),
                fmt(o["cv"], ".3f"),
                fmt(o["entropy_norm"], ".3f"),
                fmt(b["margin_mean"], ".4f"),
                fmt(b["flip_rate"], ".3f"),
                fmt(c.get("c2"), "+.4f"),
                fmt(c.get("c2_smooth"), "+.4f"),
                fmt(g.get("grad_mean")),
                fmt(g.get("var_grad_norm")),
            ]
        )
        styles.append(["", "red" if o["dead"] else ""] + [""] * 9)
    print_fitted(out, "state receipts per routed layer", RECEIPT_COLUMNS, rows, styles)
    gated = [layer for layer in doc["layers"] if layer.get("gate")]
    if gated:
        g = gated[0]["gate"]
        out.print(
            f"gate of layers {esc(', '.join(str(x['layer']) for x in gated))}: {esc(g['gate'])}. "
            f"{esc(named(g['why'], seen))}: State1 and flip are on the selection scores, C2~ on the unbiased "
            "gate (see 'gate' in the JSON for what still holds)"
        )
        biased = [x for x in gated if (x["gate"].get("selection_bias") or {}).get("values")]
        for x in biased:
            b = x["gate"]["selection_bias"]
            out.print(
                f"  layer {esc(x['layer'])} selection bias: {fmt(b['min'], '+.4f')} … "
                f"{fmt(b['max'], '+.4f')} (std {fmt(b['std'], '.4f')})"
            )
    if "generation" in doc:
        gen = doc["generation"]
        out.print(
            f"generation ({gen['prompts']} prompts × {gen['new_tokens']} tokens): high-frequency "
            f"proportion {fmt(gen['high_frequency_proportion'], '.3f')}, distinct-2 "
            f"{fmt(gen['distinct_2'], '.3f')}, rep-4 {fmt(gen['rep_4'], '.3f')}"
        )
    if "conflict" in doc:
        # beyond MAX_PAIRWISE_DOMAINS only an upper bound on the pairwise maximum is known
        bounded = doc["conflict"]["layers"][0].get("max_conflict") is None
        field, rel = ("max_conflict_upper", "max ≤") if bounded else ("max_conflict", "max")
        worst = max(doc["conflict"]["layers"], key=lambda x: x[field])
        out.print(f"domain gradient conflict: {rel} {fmt(worst[field], '.4f')} (layer {esc(worst['layer'])})")
    print_monitors(doc["layers"])
    print_nonfinite(doc)


# --- the live monitors' metrics (docs/monitors.md) ------------------------------------------------
MONITOR_COLUMNS = (Column("monitor"), Column("metric"), *_right("p50", "p90", "p95", "worst", "at layer"))


def print_monitors(layers: Sequence[ReceiptsLayer | MonitorLayer] | None) -> None:
    """Megatron-Core's and NeMo's load metrics over the routed layers: p50 / p90 / p95 and the
    worst layer (↓: the lowest value is the worst)."""
    from moeaudit.report import monitors

    rows = [
        [r["source"], r["metric"] + (" ↓" if r["worst_is"] == "lowest" else "")]
        + [fmt(r[c], ".4f") for c in ("p50", "p90", "p95", "worst")]
        + [str(r["worst_layer"])]
        for r in monitors.rollups(layers or [])
    ]
    if rows:
        print_fitted(out, "live monitors' metrics over routed layers (docs/monitors.md)", MONITOR_COLUMNS, rows)


def print_nonfinite(doc: Receipts | CompareDocument) -> None:
    """One line, however many numbers a NaN weight spoils (the JSON lists every one)."""
    weights = doc.get("nonfinite_weights", []) if doc["schema"] == "moeaudit.receipts/v1" else []
    nulled = doc.get("nonfinite", [])
    if not weights and not nulled:
        return
    plural = "s" if len(weights) > 1 else ""
    parts = [f"NaN/Inf in weight{plural} {', '.join(weights)}"] if weights else []
    if nulled:
        first = ", ".join(item["path"] for item in nulled[:3]) + (", …" if len(nulled) > 3 else "")
        parts.append(
            f"{len(nulled)} receipt value{'s' if len(nulled) > 1 else ''} became null "
            f'({first}; all listed under "nonfinite" in the JSON)'
        )
    warn("warning: " + "; ".join(parts))


def receipts_header(doc: Receipts) -> None:
    ck, cn = doc["checkpoint"], doc["canary"]
    out.print(
        f"[bold]{esc(ck['name'])}[/] ({esc(ck['family'])}, {ck['experts']} experts, top-{ck['top_k']})  "
        f"canary {cn['windows']}×{cn['window_len']}  sha256:{ck['digest']['sha256'][:16]}…"
    )
    by_domain = "  ".join(f"{esc(k)} {fmt(v, '.3f')}" for k, v in doc["nll_by_domain"].items())
    out.print(f"NLL {fmt(doc['nll'], '.4f')} nats   ({by_domain})")


def print_compare(doc: CompareDocument, policy: Any) -> None:
    from moeaudit.judge.decide import margin_status
    from moeaudit.judge.gates import Checkpointed, evaluate_gates
    from moeaudit.margins import SMOOTH_NOTE

    base, cand = doc["base"], doc["candidate"]
    seen: set[str] = set()  # papers named so far in this report
    out.print(
        f"[bold]base[/] {esc(base['checkpoint']['name'])}  →  [bold]candidate[/] "
        f"{esc(cand['checkpoint']['name'])}   protected layers {esc(doc['protected_layers'])}"
    )
    out.print(f"NLL {fmt(base['nll'], '.4f')} → {fmt(cand['nll'], '.4f')} nats")
    by_layer = {entry["layer"]: entry for entry in cand["layers"]}
    rows = []
    for entry in doc["layers"]:
        i, d = entry["layer"], entry["drift"]
        st = by_layer[i]
        mark = "*" if i in doc["protected_layers"] else ""
        rows.append(
            [
                f"{i}{mark}",
                str(st["occupancy"]["dead"]),
                fmt(st["occupancy"]["pi_min"], ".3f"),
                fmt(st["boundary"]["margin_mean"], ".4f"),
                fmt(st["overlap"].get("c2"), "+.4f"),
                fmt(d["coordinate"], ".4f"),
                fmt(d["boundary"], ".3f"),
                fmt(d["transition"], ".4f"),
                fmt(d["content"], ".3f"),
                fmt(entry["weights"]["router_drift"], ".3f"),
            ]
        )
    print_fitted(out, "per routed layer (candidate state; drift from base)", COMPARE_COLUMNS, rows)
    for entry in doc["layers"]:
        b = entry.get("selection_bias")
        if b is not None:
            out.print(
                f"layer {esc(entry['layer'])} selection bias: ‖Δb‖ {fmt(b['l2'], '.4f')}, "
                f"max |Δb| {fmt(b['max_abs'], '.4f')}, corr(Δb, base load excess) "
                f"{fmt(b['corr_delta_bias_vs_load_excess'], '+.3f')}"
            )
    band = policy.gates.inconclusive_band
    words = {
        "refinement": {
            "PASS": "refinement (within the budget τ)",
            "FAIL": "repurposing (beyond τ)",
            "INCONCLUSIVE": "within noise of the budget τ — neither claim is licensed",
        },
        "handoff": {
            "PASS": "handoff licensed",
            "FAIL": "handoff not licensed",
            "INCONCLUSIVE": "within noise of the reference — neither claim is licensed",
        },
    }
    margins = doc["margins"]
    for name, symbol, m in (("refinement", "r_ex", margins["refinement"]), ("handoff", "h_ex", margins["handoff"])):
        if m is None:
            continue
        ci = m.get("ci95")
        interval = "" if not ci else f", 95% interval [{ci[0]:+.4f}, {ci[1]:+.4f}]"
        why = m["reason"] if m["exact"] is None else words[name][margin_status(m, band)]
        out.print(f"{name} margin {symbol} = {fmt(m['exact'], '+.4f')}{interval} — {esc(named(why, seen))}")
        out.print(f"[dim]  smooth {symbol} = {fmt(m['smooth'], '+.4f')}: {esc(named(SMOOTH_NOTE, seen))}[/]")
    gates = evaluate_gates(
        [Checkpointed(0, doc["base"], "base"), Checkpointed(1, doc["candidate"])],
        doc["protected_layers"],
        policy.gates,
        resamples=policy.receipts.bootstrap,
        seed=policy.receipts.seed,
    )
    claims = gates[1]["claims"]
    heading = named("What these receipts license (003 Table 4, computed from the numbers above):", seen)
    out.print(f"[dim]{esc(heading)}[/]")
    for text in claims["licensed"]:
        # licensed = the numbers support it, good news or bad ("the canary NLL worsened"): no ✓
        out.print(f"[dim]  • {esc(named(text, seen))}[/]")
    for text in claims["not_licensed"]:
        out.print(f"[dim]  ✗ not: {esc(named(text, seen))}[/]")
    print_nonfinite(doc)


def print_envelope(report: EnvelopeReport) -> None:
    k = report["constants"]
    seen: set[str] = set()  # papers named so far in this report
    kind = "calibrated" if report["calibrated"] else "illustrative (000 Table 6)"
    out.print(
        esc(
            named(
                f"envelope on {report['source']} ({report['variant']} variance) — δ = {k['delta']:.4g}, "
                f"ε = {k['epsilon']:.4g}, τ = {k['window']}, budget ε/δ = {k['budget']:.4g} "
                f"[{kind}]",
                seen,
            )
        )
    )
    cells, styles = [], []
    gated = report.get("variance_gated", report["calibrated"])
    over = "red" if gated else "dim"  # an excursion of a reported (not gated) bound is no failure
    for key, rows in report["series"].items():
        margins = [m for r in rows if (m := r.get("margin")) is not None]  # a long series keeps its worst
        gronwall = sum(not r["compliant"] for r in rows)
        discrete = sum(not d["compliant"] for d in report["discrete"] if d["series"] == key)
        counts = report.get("shown", {}).get(key)  # a long series: counted over every sample, rows thinned
        if counts is not None:
            gronwall, discrete = counts["samples"]["noncompliant"], counts["discrete"]["noncompliant"]
        starved = sum(str(s["layer"]) == key for s in report.get("starvation", []))
        ok = starved == 0 and (not gated or gronwall + discrete == 0)
        suffix = "" if gated else " (reported)"
        cells.append(
            [
                series_name(key),
                str(len(rows) if counts is None else counts["samples"]["evaluated"]),
                fmt(min(margins) if margins else None, ".4g"),
                _count(gronwall, "sample") + suffix,
                _count(discrete, "pair") + suffix,
                str(starved),
                "yes" if ok else "no",
            ]
        )
        styles.append(["", "", "", over if gronwall else "", over if discrete else "", "", "green" if ok else "red"])
    print_fitted(
        out,
        named("bounds of the Gradient Starvation Envelope (000), per series", seen),
        ENVELOPE_COLUMNS,
        cells,
        styles,
    )
    if report.get("precision"):
        out.print(
            f"[yellow]note:[/] the {esc(report['source'])} series was computed in {esc(report['precision'])} "
            "(its weights' precision); a replay computes in float32"
        )
    fv = report["first_violation"]
    if fv and not gated and fv["check"] != "starvation":  # the variance bound, reported only
        out.print(
            esc(
                f"the variance series first rises above the illustrative bound at step {fv['step']} "
                f"({series_name(fv['layer'])}, {fv['check']} check) — reported, not gated: the "
                "constants are not calibrated on this model (`moeaudit calibrate` to gate them)"
            ),
            style="dim",
        )
    elif fv:
        what = {
            "gronwall": "is above its Grönwall bound",
            "discrete": f"rose above the Δ-step bound from step {fv.get('from_step')}",
            "starvation": f"starves expert {fv.get('expert')} (share of the layer's gradient)",
        }.get(fv["check"], fv["check"])
        out.print(
            f"[red]first leaves the envelope at step {esc(fv['step'])}: {esc(series_name(fv['layer']))} "
            f"{esc(what)}[/] — {fmt(fv['value'], '.4g')} against a bound of {fmt(fv['bound'], '.4g')}"
        )
    for w in report.get("sampling", {}).get("warnings", []):
        out.print(f"[yellow]warning:[/] {esc(named(w, seen))}")
    for a in report["alerts"]:
        out.print(
            f"[yellow]alert[/] ({named('000 Eq. 21', seen)}) on {esc(series_name(a['series']))}: "
            "every expert's gradient "
            f"below {report['rules']['alert']['a']:g} with V above {report['rules']['alert']['b']:g} "
            f"for {a['samples']} samples, steps {a['since']}–{a['until']}"
        )
    for d in report["dead_experts"]:
        state = "recovered" if d.get("recovered") else "still dead at the last sample"
        out.print(
            f"[yellow]dead expert[/] ({named('000 §10.3', seen)}): layer {esc(d['layer'])} expert "
            f"{esc(d['expert'])} had a "
            f"gradient norm below {report['rules']['dead_expert']['grad']:g} for {d['steps']} steps "
            f"({d['since']}–{d['until']}), {state}"
        )
    for s in report.get("starvation", []):
        out.print(
            f"[yellow]starved expert[/] ({named('000 §8.1', seen)}): layer {esc(s['layer'])} expert "
            f"{esc(s['expert'])} got "
            f"under {report['rules']['starvation']['share']:.3g} of the mean expert gradient for "
            f"{s['steps']} steps ({s['since']}–{s['until']}; lowest share {s['share']:.3g})"
        )
    if report.get("comparison"):
        print_comparison(report["comparison"], seen)
    rules = "every gated rule" if gated else "the gated rule (starvation; the variance bound is reported, not gated)"
    if not report["compliant"]:
        out.print("[bold red]not compliant[/]")
    elif report.get("unevaluable"):
        out.print("[bold yellow]inconclusive[/]: " + esc("; ".join(u["reason"] for u in report["unevaluable"])))
    else:
        out.print(f"[bold green]compliant[/]: {esc(rules)} holds")


def series_name(key: Any) -> str:
    """ "pooled" and layer keys as a reader says them."""
    return "all layers pooled" if str(key) == "pooled" else f"layer {key}"


def _count(n: int, what: str) -> str:
    return "within" if n == 0 else f"{n} {what}{'s' if n > 1 else ''} over"


def print_comparison(c: EnvelopeComparison, seen: set[str] | None = None) -> None:
    mark = {True: "+", False: "-", None: "·"}
    k = c["constants"]
    probe = "probe" in k
    for view, v in (("replay", k["replay"]), ("logs", k["logs"]), ("logs_endpoints", k["logs_endpoints"])):
        out.print(f"{esc(view)}: δ = {v['delta']:.4g}, ε = {v['epsilon']:.4g}, budget {v['budget']:.4g}")
    if probe:
        v = k["probe"]
        out.print(f"probe: δ = {v['delta']:.4g}, ε = {v['epsilon']:.4g}, budget {v['budget']:.4g}")
    spans = list(dict.fromkeys((w["start"], w["end"]) for w in c["windows"]))
    title = " / ".join(("replay", "logs", "logs at the endpoints", "canary probe")[: 4 if probe else 3])
    table = Table("series", *[f"{a}–{b}" for a, b in spans], title=f"per window: {title} (+ complies, - leaves)")
    for key in dict.fromkeys(w["series"] for w in c["windows"]):
        cells = []
        for w in (w for w in c["windows"] if w["series"] == key):
            verdicts = [w["replay"]["compliant"], w["logs"]["compliant"], w["logs_endpoints"]["compliant"]]
            if probe:
                verdicts.append(w["probe"]["compliant"])
            cell = "/".join(mark[x] for x in verdicts)
            differ = False in (w["agree"], w["agree_endpoints"], w.get("agree_probe"))
            cells.append(f"[yellow]{cell}[/]" if differ else cell)
        table.add_row(esc(key), *cells)
    out.print(table)
    for s in c["skipped"]:
        where = f"{s.get('start')}–{s.get('end')}" if "start" in s else f"series {s.get('series')}"
        out.print(esc(named(f"not compared: {where} ({s['reason']})", seen)))
    ag = c["agreement"]
    rates = [("every logged step", ag["logs"]), ("logs at the checkpoints", ag["logs_endpoints"])]
    if "probe" in ag:
        rates.append(("the canary probe", ag["probe"]))
    for what, r in rates:
        rate = "—" if r["rate"] is None else f"{r['rate']:.0%}"
        out.print(f"replay and {what} agree on {r['agree']}/{r['compared']} windows × series ({rate})")
    pv = c.get("probe_vs_replay")
    if pv is not None and pv["max_rel_diff"] is not None:
        low = c["probe_report"].get("precision") if "probe_report" in c else None  # else the report's own note
        out.print(
            f"canary probe vs replay: V differs by at most {pv['max_rel_diff']:.2e} (relative) at the checkpoints"
            + (f" (the probe computed in {low}, the replay in float32)" if low else "")
        )
    note = c.get("note")
    if note:
        out.print(f"[yellow]note:[/] {esc(named(note, seen))}")


VERDICT_STYLE = {"PASS": "bold green", "FAIL": "bold red", "INCONCLUSIVE": "bold yellow"}


def print_gates(pred: Predicate) -> None:
    """The gate table at the console's width (never a cut number: :mod:`gate_table`), its legend,
    the checks and the verdict."""
    from moeaudit.report import gate_table

    seen: set[str] = set()  # papers named so far in this report
    title = f"{pred['run']['name']} ({pred['run']['stage']}) — gates"
    rows = [gate_table.gate_cells(g) for g in pred["gates"]]
    print_fitted(out, title, gate_table.COLUMNS, rows, [gate_table.gate_styles(r) for r in rows])
    if stages := gate_table.stages_line(pred["gates"]):  # a declared stage change within the run
        out.print(esc(stages))
    for a in pred["run"].get("abandoned") or []:  # audited, but not the model's history (lineage.py)
        out.print(esc(f"abandoned: {a['name']} (audited, not the model's history) — {a['reason']}"), style="yellow")
    out.print(gate_table.legend_grid(pred), style="dim")
    print_monitors(pred["monitors"]["layers"] if "monitors" in pred else None)
    for c in pred["checks"]:
        status = c["status"] if c["evaluated"] else "not evaluated"
        out.print(esc(named(f"  {c['name']}: {status} — {c['reason']}", seen)))
    for line in pred["ablation"]["sentences"] if "ablation" in pred else []:  # certify --ablate: reported, not gated
        out.print(esc(f"  ablation: {line}"))
    v = pred["verdict"]
    out.print(f"verdict: [{VERDICT_STYLE[v]}]{v}[/] — {esc(named(pred['verdict_reason'], seen))}")


def print_checkpoint(title: Any, summary: dict[str, Any]) -> None:
    """``moeaudit inspect``: a checkpoint's summary as a table; its warnings on stderr."""
    table = Table(title=esc(title), show_header=False)
    for key, value in summary.items():
        if key == "warnings":
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) or "—"
        table.add_row(esc(key), esc(value))
    out.print(table)
    for w in summary["warnings"]:
        err.print(f"warning: {w}", markup=False, soft_wrap=True)


def print_canary(title: Any, summary: dict[str, Any]) -> None:
    """``moeaudit canary show``: a canary's shape, domains and digest as a table."""
    table = Table(title=esc(title), show_header=False)
    for key, value in summary.items():
        table.add_row(esc(key), esc(json.dumps(value) if isinstance(value, (dict, list)) else value))
    out.print(table)


def print_calibration(result: Any, variant: str, written: Any) -> None:
    """``moeaudit calibrate``: what was fitted, on stderr (``result``: a
    ``moeaudit.calibrate.CalibrationResult``; ``written``: the policy file)."""
    env = result.policy.envelope
    fit = (
        f"c = {env.calibration_c:g}: δ = {env.delta:.6g}; ε = {env.epsilon:.6g}; budget ε/δ = "
        f"{env.epsilon / env.delta:.6g}; sampling {env.sampling_interval} steps"
        if env.calibrated
        else "variance bound not fitted (illustrative, not gated)"
    )
    err.print(
        f"calibrated the envelope on {env.source} ({variant}), {fit}; starve_share = "
        f"{env.starve_share:.4g} (steps {result.envelope_steps[0]}–{result.envelope_steps[1]})",
        markup=False,
        soft_wrap=True,
    )
    g = result.policy.gates
    err.print(
        f"calibrated the gates on checkpoints {result.steps[0]}–{result.steps[1]}: tol_c2_rel = "
        f"{g.tol_c2_rel:.4g}, pi_min_ratio_floor = {g.pi_min_ratio_floor:.4g}, entropy_ratio_floor "
        f"= {g.entropy_ratio_floor:.4g} (written into {written} with how each was fitted)",
        markup=False,
        soft_wrap=True,
    )


def print_gate(result: GateResult) -> None:
    """``moeaudit gate``: the decision, why, and each condition."""
    style = {"PROMOTE": "bold green", "HOLD": "bold red", "INCONCLUSIVE": "bold yellow"}[result["decision"]]
    seen: set[str] = set()  # papers named so far in this output
    if result["verdict"] is None:
        head = f"{result['candidate']} over {result['base']}: {result['verdict_reason']}"
    else:
        head = (
            f"{result['candidate']} over {result['base']} (stage {result['stage']}, from "
            f"{result['stage_source']}); run verdict up to the candidate {result['verdict']}: "
            f"{result['verdict_reason']}"
        )
    if result.get("decision_reason"):  # the decision is not the verdict's reading: say why first
        head = f"{result['candidate']} over {result['base']}: {result['decision_reason']}; {head}"
    # one line each, never wrapped: CI logs are not a terminal and are grepped line by line
    out.print(f"[{style}]{result['decision']}[/] " + esc(named(head, seen)), soft_wrap=True)
    for cond in result["conditions"]:
        mark = {"pass": "✓", "fail": "✗", "skipped": "·", "inconclusive": "?"}[cond["status"]]
        out.print(esc(named(f"  {mark} {cond['name']}: {cond['detail']}", seen)), soft_wrap=True)
    for note in result.get("notes", []):
        out.print(esc(named(f"  note: {note}", seen)), soft_wrap=True)
