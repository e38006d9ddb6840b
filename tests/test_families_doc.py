"""docs/families.md's inventory table says what the registry says: one row per replayed family
and refused model type, each refused one with the reason ``moeaudit`` gives, and every replayed
one with a measured oracle difference (``python tests/families_table.py`` rewrites it)."""

from __future__ import annotations

import re
from pathlib import Path

from families_table import DOC, _cells, render, split

from moeaudit.families import FAMILIES, REFUSED


def test_the_table_is_the_registry() -> None:
    doc = DOC.read_text(encoding="utf-8")
    assert render(doc) == doc, "run: python tests/families_table.py"
    _, rows, _ = split(doc)
    names = [_cells(r)[0] for r in rows]
    assert sorted(names) == sorted({*FAMILIES, *REFUSED}) and len(names) == len(set(names))


def test_every_replayed_family_has_a_measured_difference() -> None:
    _, rows, _ = split(DOC.read_text(encoding="utf-8"))
    unmeasured = [c[0] for c in map(_cells, rows) if c[1] == "replayed" and not any(ch.isdigit() for ch in c[3])]
    assert unmeasured == []


def test_every_replayed_family_names_its_oracle_module() -> None:
    """The "worst oracle difference" cell of each replayed family names the oracle module that
    measured it (``tests/test_oracle_<family>.py`` or its group's), the module exists and names
    the family in quotes: the promise of "Adding a family", checked family by family."""
    tests = Path(__file__).resolve().parent
    _, rows, _ = split(DOC.read_text(encoding="utf-8"))
    wrong = {}
    for name, status, _, worst in (c[:4] for c in map(_cells, rows)):
        if status != "replayed":
            continue
        cited = re.findall(r"\btest_oracle\w*\.py\b", worst)
        texts = [(tests / f).read_text(encoding="utf-8") for f in cited if (tests / f).is_file()]
        if not cited or len(texts) < len(cited) or not any(f'"{name}"' in t for t in texts):
            wrong[name] = cited
    assert wrong == {}
