"""Tables that fit the terminal without cutting a number (docs/decisions.md, "Terminal tables never cut a
number or a status").

rich shrinks a table that is too wide by cutting every column's cells ("0.92…", "BASELI…"),
which turns evidence into guesses. Here the layout is chosen before rich sees it, from the
widest cell of each column:

1. the boxed table with one-line headers;
2. the boxed table with headers wrapped at their spaces ("canary" over "NLL");
3. a borderless table with wrapped headers (two spaces between columns);
4. a list, one block per row, its "name value" items packed into lines and never split.

Every column width is fixed at its widest cell, so rich never has to shrink anything; the
first layout whose rendered width fits the console wins. Cells are plain text (escaped here),
each with an optional rich style.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.cells import cell_len
from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

Rows = Sequence[Sequence[str]]
Styles = Sequence[Sequence[str]] | None  # per row, per column: a rich style or ""


@dataclass(frozen=True)
class Column:
    header: str  # its words may wrap onto lines of their own; cells never wrap
    justify: JustifyMethod = "left"


def _styled(text: str, style: str) -> str:
    return f"[{style}]{escape(text)}[/]" if style else escape(text)


def _style(styles: Styles, i: int, j: int) -> str:
    return styles[i][j] if styles is not None else ""


def _table(
    title: str, columns: Sequence[Column], rows: Rows, styles: Styles, *, wrap_headers: bool, boxed: bool
) -> Table:
    table = Table(
        title=escape(title),
        box=box.HEAVY_HEAD if boxed else box.SIMPLE_HEAD,
        show_edge=boxed,
        pad_edge=boxed,
        collapse_padding=not boxed,
    )
    for j, col in enumerate(columns):
        header = col.header.replace(" ", "\n") if wrap_headers else col.header
        width = max([cell_len(line) for line in header.split("\n")] + [cell_len(r[j]) for r in rows])
        table.add_column(escape(header), justify=col.justify, no_wrap=True, width=width, min_width=width)
    for i, r in enumerate(rows):
        table.add_row(*(_styled(c, _style(styles, i, j)) for j, c in enumerate(r)))
    return table


def rendered_width(table: Table) -> int:
    """The width ``table`` takes when nothing constrains it."""
    probe = Console(file=io.StringIO(), width=10_000, highlight=False, color_system=None)
    with probe.capture() as cap:
        probe.print(table)
    return max((cell_len(line.rstrip()) for line in cap.get().splitlines()), default=0)


def fitted_table(title: str, columns: Sequence[Column], rows: Rows, width: int, styles: Styles = None) -> Table | None:
    """The first table layout that fits ``width`` columns whole, or None (then :func:`as_list`)."""
    for wrap, boxed in ((False, True), (True, True), (True, False)):
        table = _table(title, columns, rows, styles, wrap_headers=wrap, boxed=boxed)
        if rendered_width(table) <= width:
            return table
    return None


def as_list(title: str, columns: Sequence[Column], rows: Rows, width: int, styles: Styles = None) -> list[str]:
    """Rich markup lines: per row, "<first header> <value>" and then the other "name value"
    items packed into lines no wider than ``width``, never broken inside an item."""
    lines = [f"[bold]{escape(title)}[/]"]
    for i, r in enumerate(rows):
        lines.append(f"{escape(columns[0].header)} {_styled(r[0], _style(styles, i, 0))}")
        line, width_now = "", 0
        for j, (col, value) in enumerate(zip(columns[1:], r[1:], strict=True), start=1):
            item = f"{escape(col.header)} {_styled(value, _style(styles, i, j))}"
            size = cell_len(f"{col.header} {value}")
            if line and width_now + 3 + size > width:
                lines.append(line)
                line, width_now = "", 0
            line, width_now = (f"{line} · {item}", width_now + 3 + size) if line else (f"  {item}", 2 + size)
        if line:
            lines.append(line)
    return lines


def print_fitted(console: Console, title: str, columns: Sequence[Column], rows: Rows, styles: Styles = None) -> None:
    """The table at ``console``'s width, or the list when no table layout fits."""
    table = fitted_table(title, columns, rows, console.width, styles)
    if table is not None:
        console.print(table)
        return
    for line in as_list(title, columns, rows, console.width, styles):
        console.print(line, soft_wrap=True)
