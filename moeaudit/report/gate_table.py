"""The certify gate table: its cells, laid out by :mod:`moeaudit.report.fit` so that a number
or a status is never cut at any terminal width (docs/decisions.md, "Terminal tables never cut a number or a status"),
and a legend under it giving each column's threshold and which direction is good, from the policy signed into the
certificate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from moeaudit.judge.why import why
from moeaudit.records import GateEntry, Predicate
from moeaudit.report.fit import Column

STATUS_STYLE = {"BASELINE": "cyan", "GREEN": "green", "YELLOW": "yellow", "RED": "red"}

COLUMNS = (
    Column("step", "right"),
    Column("gate"),
    Column("vs", "right"),
    Column("canary NLL", "right"),
    Column("trend"),
    Column("C2 (mean)", "right"),
    Column("State1", "right"),
    Column("dead", "right"),
    Column("CV", "right"),
    Column("H_norm min", "right"),
    Column("why"),
)


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def gate_cells(g: GateEntry) -> list[str]:
    """One gate's cells as plain text, in ``COLUMNS`` order."""
    r = g["receipts"]
    return [
        str(g["step"]),
        str(g["status"]),
        str(g.get("baseline", "—")),
        _fmt(r.get("nll"), ".4f"),
        str(g.get("scalar") or "—"),
        _fmt(r.get("c2_mean"), "+.4f"),
        _fmt(r.get("state1_mean"), ".4f"),
        _fmt(r.get("dead"), "d"),
        _fmt(r.get("cv_mean"), ".3f"),
        _fmt(r.get("entropy_norm_min"), ".3f"),
        why(g),
    ]


def stages_line(gates: Sequence[GateEntry]) -> str | None:
    """Which gates each stage judged, when a declared stage changes within the run (each gate
    signs its own, ``gates[].stage``); None when one stage judged them all."""
    spans: list[tuple[str, int, int]] = []
    for g in gates:
        stage = g.get("stage")
        if stage is None:
            return None  # a statement from before gates signed their stage
        if spans and spans[-1][0] == stage:
            spans[-1] = (stage, spans[-1][1], g["step"])
        else:
            spans.append((stage, g["step"], g["step"]))
    if len({stage for stage, _, _ in spans}) < 2:
        return None
    parts = [f"{a}–{b}" if a != b else f"{a}" for _, a, b in spans]
    return "judged as: " + "; ".join(f"{stage} at step(s) {part}" for (stage, _, _), part in zip(spans, parts))


def gate_styles(cells: list[str]) -> list[str]:
    """The status cell in its colour; every other cell plain."""
    return ["", STATUS_STYLE.get(cells[1], "")] + [""] * (len(cells) - 2)


def legend(pred: Predicate) -> list[tuple[str, str]]:
    """(column, its threshold and which direction is good), from the certificate's policy."""
    g = (pred.get("policy") or {}).get("gates") or {}
    protected = ", ".join(map(str, pred.get("protected_layers") or [])) or "protected"
    tol_c2, rel, tol_dead = g.get("tol_c2", 0.02), g.get("tol_c2_rel", 0.5), g.get("tol_dead", 0)
    return [
        (
            "gate",
            "BASELINE is a reference point; GREEN is good; YELLOW is a bad gate; RED after "
            f"{g.get('escalate_after', 4)} bad gates in a row, or at once when structure and "
            "canary NLL are both bad",
        ),
        ("vs", "the baseline step the gate is compared with (the worst of every earlier baseline)"),
        (
            "canary NLL",
            f"nats, lower is better; a change counts only beyond {g.get('nll_tol', 1e-3):g} "
            "nats with its 95% interval excluding 0",
        ),
        (
            "trend",
            "canary NLL against the previous gate: improving is good; worsening makes a "
            "pretraining gate bad; no change = within noise (not improving)",
        ),
        (
            "C2 (mean)",
            "mean cosine between co-active experts' visible fields (how compatible the experts "
            "a token mixes are); its level is no score (a collapsed run's co-active experts are "
            "near-copies, C2 near 1), it is judged by its change: fallen when a protected layer "
            f"({protected}) drops by more than max({tol_c2:g}, {rel:g} × its baseline C2, the "
            "bootstrap noise); in pretraining a fall with occupancy held and the canary NLL "
            "improving is atlas motion, not a bad gate",
        ),
        ("State1", "mean router boundary margin; reported, not gated"),
        (
            "dead",
            "lower is better; no more than the baseline's"
            + (f" + {tol_dead}" if tol_dead else "")
            + f", and at most {g.get('floor_dead_fraction', 0.0):.0%} of a layer's experts",
        ),
        (
            "CV",
            "load imbalance across experts, lower is more even; reported, not gated (π_min is "
            f"gated: ≥ {g.get('pi_min_ratio_floor', 0.5):g} × the baseline's beyond the bootstrap noise, and ≥ "
            f"{g.get('floor_pi_share', 0.1):g} × k/E)",
        ),
        (
            "H_norm min",
            f"higher is better; ≥ {g.get('entropy_ratio_floor', 0.9):g} × the baseline's "
            f"and ≥ {g.get('floor_entropy_norm', 0.6):g}",
        ),
        (
            "why",
            "the quantity that made the gate what it is: an occupancy ratio below its floor "
            "beyond the bootstrap intervals of gate and baseline, C2 fallen, a health floor, the "
            "canary NLL worsening (L: layers)",
        ),
    ]


def legend_grid(pred: Predicate) -> Table:
    """The legend as two columns, the explanations wrapping under themselves."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column()
    grid.title, grid.title_justify = "columns: threshold, and which way is good", "left"
    for name, text in legend(pred):
        grid.add_row(escape(name), escape(text))
    return grid
