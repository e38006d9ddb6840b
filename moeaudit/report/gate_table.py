"""The certify gate table on a terminal of any width: numbers and statuses are never cut.

rich shrinks a table that is too wide by cutting every column's cells ("0.92…", "BASELI…"),
which turns evidence into guesses. Here the layout is chosen before rich sees it, from the
widest cell of each column (issue 25 §2):

1. the boxed table with one-line headers;
2. the boxed table with headers wrapped at their spaces ("canary" over "NLL");
3. a borderless table with wrapped headers (two spaces between columns);
4. a per-checkpoint list, one block per gate, its "name value" items packed into lines.

Every column width is fixed at its widest cell, so rich never has to shrink anything; the
first layout whose rendered width fits the console wins. A legend under the table gives each
column's threshold and which direction is good, from the policy signed into the certificate.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

STATUS_STYLE = {"BASELINE": "cyan", "GREEN": "green", "YELLOW": "yellow", "RED": "red"}


@dataclass(frozen=True)
class Column:
    header: str  # its words may wrap onto lines of their own; cells never wrap
    justify: JustifyMethod = "left"


COLUMNS = (Column("step", "right"), Column("gate"), Column("vs", "right"), Column("canary NLL", "right"),
           Column("trend"), Column("C2 (mean)", "right"), Column("State1", "right"),
           Column("dead", "right"), Column("CV", "right"), Column("H_norm min", "right"))


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def gate_cells(g: Mapping[str, Any]) -> list[str]:
    """One gate's cells as plain text, in ``COLUMNS`` order."""
    r = g["receipts"]
    return [str(g["step"]), str(g["status"]), str(g.get("baseline", "—")), _fmt(r.get("nll"), ".4f"),
            str(g.get("scalar") or "—"), _fmt(r.get("c2_mean"), "+.4f"),
            _fmt(r.get("state1_mean"), ".4f"), _fmt(r.get("dead"), "d"), _fmt(r.get("cv_mean"), ".3f"),
            _fmt(r.get("entropy_norm_min"), ".3f")]


def _table(title: str, rows: Sequence[Sequence[str]], *, wrap_headers: bool, boxed: bool) -> Table:
    table = Table(title=escape(title), box=box.HEAVY_HEAD if boxed else box.SIMPLE_HEAD,
                  show_edge=boxed, pad_edge=boxed, collapse_padding=not boxed)
    for i, col in enumerate(COLUMNS):
        header = col.header.replace(" ", "\n") if wrap_headers else col.header
        width = max([cell_len(line) for line in header.split("\n")] + [cell_len(r[i]) for r in rows])
        table.add_column(escape(header), justify=col.justify, no_wrap=True, width=width,
                         min_width=width)
    for r in rows:
        style = STATUS_STYLE.get(r[1], "")
        cells = [escape(c) for c in r]
        cells[1] = f"[{style}]{cells[1]}[/]" if style else cells[1]
        table.add_row(*cells)
    return table


def rendered_width(table: Table) -> int:
    """The width ``table`` takes when nothing constrains it."""
    probe = Console(file=io.StringIO(), width=10_000, highlight=False, color_system=None)
    with probe.capture() as cap:
        probe.print(table)
    return max((cell_len(line.rstrip()) for line in cap.get().splitlines()), default=0)


def fitted_table(title: str, rows: Sequence[Sequence[str]], width: int) -> Table | None:
    """The first table layout that fits ``width`` columns whole, or None (then a list)."""
    for wrap, boxed in ((False, True), (True, True), (True, False)):
        table = _table(title, rows, wrap_headers=wrap, boxed=boxed)
        if rendered_width(table) <= width:
            return table
    return None


def gate_list(title: str, rows: Sequence[Sequence[str]], width: int) -> list[str]:
    """The gates as a per-checkpoint list of rich markup lines: "name value" items packed into
    lines no wider than ``width``, never broken inside an item."""
    lines = [f"[bold]{escape(title)}[/]"]
    for r in rows:
        style = STATUS_STYLE.get(r[1], "")
        status = f"[{style}]{escape(r[1])}[/]" if style else escape(r[1])
        lines.append(f"step {escape(r[0])}: {status} vs {escape(r[2])}")
        items = [f"{c.header} {v}" for c, v in zip(COLUMNS[3:], r[3:], strict=True)]
        line = ""
        for item in items:
            if line and cell_len(line) + 3 + cell_len(item) > width:
                lines.append(escape(line))
                line = ""
            line = f"{line} · {item}" if line else f"  {item}"
        if line:
            lines.append(escape(line))
    return lines


def legend(pred: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(column, its threshold and which direction is good), from the certificate's policy."""
    g = (pred.get("policy") or {}).get("gates") or {}
    protected = ", ".join(map(str, pred.get("protected_layers") or [])) or "protected"
    tol_c2, rel, tol_dead = g.get("tol_c2", 0.02), g.get("tol_c2_rel", 0.5), g.get("tol_dead", 0)
    return [
        ("gate", "BASELINE is a reference point; GREEN is good; YELLOW is a bad gate; RED after "
                 f"{g.get('escalate_after', 4)} bad gates in a row, or at once when structure and "
                 "canary NLL are both bad"),
        ("vs", "the baseline step the gate is compared with (the worst of every earlier baseline)"),
        ("canary NLL", f"nats, lower is better; a change counts only beyond {g.get('nll_tol', 1e-3):g} "
                       "nats with its 95% interval excluding 0"),
        ("trend", "canary NLL against the previous gate: improving is good; worsening makes a "
                  "pretraining gate bad; no change = within noise (not improving)"),
        ("C2 (mean)", f"higher is better; fallen when a protected layer ({protected}) drops by more "
                      f"than max({tol_c2:g}, {rel:g} × its baseline C2, the bootstrap noise)"),
        ("State1", "mean router boundary margin; reported, not gated"),
        ("dead", "lower is better; no more than the baseline's" + (f" + {tol_dead}" if tol_dead else "")
                 + f", and at most {g.get('floor_dead_fraction', 0.0):.0%} of a layer's experts"),
        ("CV", "load imbalance across experts, lower is more even; reported, not gated (π_min is "
               f"gated: ≥ {g.get('pi_min_ratio_floor', 0.5):g} × the baseline's and ≥ "
               f"{g.get('floor_pi_share', 0.1):g} × k/E)"),
        ("H_norm min", f"higher is better; ≥ {g.get('entropy_ratio_floor', 0.9):g} × the baseline's "
                       f"and ≥ {g.get('floor_entropy_norm', 0.6):g}"),
    ]


def legend_grid(pred: Mapping[str, Any]) -> Table:
    """The legend as two columns, the explanations wrapping under themselves."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column()
    grid.title, grid.title_justify = "columns: threshold, and which way is good", "left"
    for name, text in legend(pred):
        grid.add_row(escape(name), escape(text))
    return grid
