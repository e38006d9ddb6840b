"""docs/families.md's inventory table says what the registry says: one row per replayed family
and refused model type, each refused one with the reason ``moeaudit`` gives, and every replayed
one with a measured oracle difference (``python tests/families_table.py`` rewrites it)."""

from __future__ import annotations

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
