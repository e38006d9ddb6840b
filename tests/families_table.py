"""The docs/families.md inventory table, from the registry: every replayed family and every
refused model type with its reason as ``moeaudit.families`` states it. The "what is audited"
and "worst oracle difference" columns of replayed families are kept from the document (they
are measured by the oracle tests and written by whoever ran them).

    python tests/families_table.py          # rewrite the table in docs/families.md
tests/test_families_doc.py fails when the table and the registry disagree."""

from __future__ import annotations

import sys
from pathlib import Path

from moeaudit.families import FAMILIES, REFUSED

DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"
HEADER = "| model_type | status | what is audited / why refused | worst oracle difference |"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def split(doc: str) -> tuple[str, list[str], str]:
    """(text before the table, its rows, text after)."""
    lines = doc.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == HEADER)
    end = start + 2
    while end < len(lines) and lines[end].startswith("| "):
        end += 1
    return "".join(lines[:start]), [ln.rstrip("\n") for ln in lines[start + 2 : end]], "".join(lines[end:])


def _cells(row: str) -> list[str]:
    parts, cur, esc = [], "", False
    for ch in row.strip()[1:-1]:
        if ch == "|" and not esc:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
        esc = ch == "\\"
    parts.append(cur.strip())
    return parts


def table(old_rows: list[str]) -> list[str]:
    kept = {c[0]: c for c in map(_cells, old_rows)}
    rows = []
    for name in sorted({*FAMILIES, *REFUSED}):
        if name in FAMILIES:
            old = kept.get(name)
            audited = old[2] if old and old[1] == "replayed" else "—"
            worst = old[3] if old and old[1] == "replayed" else "see its oracle test"
            rows.append(f"| {name} | replayed | {audited} | {worst} |")
        else:
            rows.append(f"| {name} | refused | {_cell(REFUSED[name])} | — |")
    return rows


def render(doc: str) -> str:
    before, rows, after = split(doc)
    return before + HEADER + "\n|---|---|---|---|\n" + "\n".join(table(rows)) + "\n" + after


if __name__ == "__main__":
    text = DOC.read_text(encoding="utf-8")
    new = render(text)
    if "--check" in sys.argv:
        sys.exit(0 if new == text else 1)
    DOC.write_text(new, encoding="utf-8")
