"""The live monitors' metrics in the certificate (golden statement of the healthy sample run):
the HTML block's roll-ups, the dashboards' own scalars and per-layer rows, the terminal table,
and the names on the wire (data keys: never camelCased)."""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from moeaudit.attest.naming import from_wire, to_wire
from moeaudit.report import monitors, terminal
from moeaudit.report.html import render_html

GOLDEN = Path(__file__).parent / "golden" / "healthy.statement.json"


@pytest.fixture()
def statement() -> dict[str, Any]:
    stmt = json.loads(GOLDEN.read_text(encoding="utf-8"))
    stmt["predicate"] = from_wire(stmt["predicate"])
    return stmt


def _cell(html: str, label: str) -> str:
    m = re.search(rf"<code>{re.escape(label)}</code>(?: ↓)?</th>(.*?)</tr>", html, re.S)
    assert m, label
    return m.group(1)


def test_the_names_are_signed_as_the_monitors_spell_them(statement: dict[str, Any]) -> None:
    wire = json.loads(GOLDEN.read_text(encoding="utf-8"))["predicate"]["monitors"]["layers"][0]
    assert "topk-boundary-relative-margin" in wire["megatron"] and "dead_expert_frac" in wire["nemo"]
    assert to_wire(statement["predicate"])["monitors"]["layers"][0] == wire


def test_html_shows_rollups_scalars_and_layers(statement: dict[str, Any]) -> None:
    html = render_html(statement, keyid="k" * 64, envelope_sha256="0" * 64)
    layers = statement["predicate"]["monitors"]["layers"]
    margins = {e["layer"]: e["megatron"]["topk-boundary-relative-margin"] for e in layers}
    worst = min(margins, key=margins.__getitem__)
    row = _cell(html, "topk-boundary-relative-margin")  # the roll-up row
    cells = re.findall(r'<td class="num">([^<]*)</td>', row)
    assert cells[3:] == [format(margins[worst], ".4f"), str(worst)]
    scalar = _cell(html, "tensor-metrics/layer-router-health/worst-layer/topk-boundary-relative-margin")
    assert format(margins[worst], ".4f") in scalar
    cv = [e["nemo"]["cv"] for e in layers]
    assert format(sum(cv) / len(cv), ".4f") in _cell(html, "moe/cv_mean")
    pooled = monitors.nemo_utilization(statement["predicate"]["heatmaps"]["occupancy"]["pi"])
    assert format(pooled["moe/expert_utilization_median"], ".4f") in _cell(html, "moe/expert_utilization_median")
    section = html.split('<section id="monitors">')[1].split("</section>")[0]
    assert section.count('<tr><th scope="row" class="num">') == len(layers)  # one row per layer


def test_html_without_monitors_has_no_block(statement: dict[str, Any]) -> None:
    old = copy.deepcopy(statement)
    del old["predicate"]["monitors"]  # certificates signed before the section
    assert 'id="monitors"' not in render_html(old, keyid="k" * 64, envelope_sha256="0" * 64)


def test_terminal_prints_the_rollups(statement: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.StringIO()
    monkeypatch.setattr(terminal, "out", Console(file=buf, width=120, highlight=False, color_system=None))
    terminal.print_gates(statement["predicate"])
    text = buf.getvalue()
    assert "live monitors' metrics over routed layers" in text
    rows = monitors.rollups(statement["predicate"]["monitors"]["layers"])
    for r in rows:
        line = next(ln for ln in text.splitlines() if f" {r['metric']} " in ln)
        assert format(r["worst"], ".4f") in line and format(r["p90"], ".4f") in line
    assert text.rstrip().splitlines()[-1].startswith("verdict:")
