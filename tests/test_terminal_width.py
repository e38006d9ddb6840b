"""The certify gate table at 80, 90 and 120 columns (docs/decisions.md, "Terminal tables never cut a
number or a status"): a number or a status is never
cut ("0.92…", "BASELI…"); the layout drops borders, wraps headers or becomes a per-checkpoint
list instead, and a legend gives each column's threshold and which way is good."""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from moeaudit.report import gate_table, terminal

FIXTURE = Path(__file__).parent / "fixtures" / "statement_example.json"


@pytest.fixture()
def pred() -> dict[str, Any]:
    p = copy.deepcopy(json.loads(FIXTURE.read_text(encoding="utf-8"))["predicate"])
    p["verdict_reason"] = "a YELLOW gate at step 1500"
    # the widest cells a real run gives: a RED gate, a long step, a negative C2, "no change"
    last = p["gates"][-1]
    last.update(status="RED", step=1_250_000, scalar="no change")
    last["receipts"].update(c2_mean=-0.123456, nll=12.345678, dead=17)
    p["gates"][0]["status"] = "BASELINE"
    return p


def render(pred: dict[str, Any], width: int, monkeypatch: pytest.MonkeyPatch) -> str:
    buf = io.StringIO()
    monkeypatch.setattr(terminal, "out", Console(file=buf, width=width, highlight=False, color_system=None))
    terminal.print_gates(pred)
    return buf.getvalue()


@pytest.mark.parametrize("width", [80, 90, 120, 60])
def test_no_number_or_status_is_cut(pred: dict[str, Any], width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    text = render(pred, width, monkeypatch)
    table_part = text.split("columns: threshold")[0]
    assert "…" not in table_part, table_part
    assert max(len(line) for line in text.splitlines()) <= width
    for gate in pred["gates"]:
        for cell in gate_table.gate_cells(gate):
            assert cell in table_part, (width, cell, table_part)
    tokens = re.findall(r"[^\s│┃:·]+", table_part)  # each cell stands whole between separators
    for cell in ("BASELINE", "RED", "YELLOW", "12.3457", "-0.1235", "1250000"):
        assert cell in tokens, (width, cell)


def test_layout_degrades_from_boxed_to_borderless_to_list(
    pred: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "┃ canary NLL ┃" in render(pred, 120, monkeypatch)  # room for everything
    at_80 = render(pred, 100, monkeypatch)  # the "why" column: borderless below 120
    assert "┃" not in at_80 and "canary" in at_80 and "─" in at_80  # borderless, headers wrapped
    at_60 = render(pred, 60, monkeypatch)
    assert "step 1250000\n  gate RED · vs 500 · canary NLL 12.3457" in at_60  # one block per checkpoint
    assert "C2 (mean) -0.1235" in at_60


@pytest.mark.parametrize("width", [80, 120])
def test_legend_gives_each_threshold_and_direction(
    pred: dict[str, Any], width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pred["policy"]["gates"].update(
        tol_c2=0.02, tol_c2_rel=0.5, entropy_ratio_floor=0.9, floor_entropy_norm=0.6, nll_tol=0.001
    )
    text = " ".join(render(pred, width, monkeypatch).split())
    assert "columns: threshold, and which way is good" in text
    for column in ("gate", "vs", "canary NLL", "trend", "C2 (mean)", "State1", "dead", "CV", "H_norm min"):
        assert column in [name for name, _ in gate_table.legend(pred)]
    assert "nats, lower is better" in text and "beyond 0.001 nats" in text
    assert "max(0.02, 0.5 × its baseline C2, the bootstrap noise)" in text
    assert "≥ 0.9 × the baseline's and ≥ 0.6" in text
    assert "State1 mean router boundary margin; reported, not gated" in text


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_any_table_keeps_its_cells_whole(width: int) -> None:
    """The layout rule (moeaudit/report/fit.py) for the receipts, compare and envelope tables too:
    eleven numeric columns at any width, each cell whole or the table a list."""
    from moeaudit.report.fit import Column, print_fitted

    columns = [Column("layer", "right")] + [Column(f"receipt {j}", "right") for j in range(10)]
    rows = [[str(i)] + [f"{(-1) ** j * 1234.5678 / (j + 1):+.4f}" for j in range(10)] for i in range(3)]
    buf = io.StringIO()
    print_fitted(Console(file=buf, width=width, highlight=False, color_system=None), "t", columns, rows)
    text = buf.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    tokens = re.findall(r"[^\s│┃·]+", text)
    for row in rows:
        for cell in row[1:]:
            assert cell in tokens, (width, cell)


SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"


@pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")
@pytest.mark.parametrize(
    "argv",
    [
        ["envelope", "{s}/healthy", "--source", "logs"],
        ["receipts", "{s}/healthy/checkpoint-250"],
        ["compare", "{s}/sft-refine/checkpoint-0", "{s}/sft-refine/checkpoint-1000"],
    ],
)
def test_commands_at_80_columns_cut_no_number(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from moeaudit.cli import cli

    buf = io.StringIO()
    monkeypatch.setattr(terminal, "out", Console(file=buf, width=80, highlight=False, color_system=None))
    result = CliRunner().invoke(cli, [a.format(s=SAMPLES) for a in argv])
    assert result.exit_code in (0, 1), result.stderr
    text = re.sub(r"sha256:[0-9a-f]{16}…", "", buf.getvalue())  # a digest shortened on purpose
    assert text and "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80
