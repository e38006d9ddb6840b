"""The test suite's own layout: test modules import nothing from one another (shared code lives
in ``tests/support/`` and the tiny models in ``tests/hfmodels/``), the tiny-model groups only
declare tables and functions (``hfmodels.REGISTRY`` is merged explicitly, no import registers
anything), and the files the tests cite exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
OURS = sorted(p for p in TESTS.rglob("*.py") if not {"sigstore_js", "node_modules"} & set(p.parts))


def test_no_module_imports_a_test_module() -> None:
    """Also in the source of child scripts kept in strings (a subprocess imports as a library
    whatever a module imports)."""
    found = [
        f"{p.relative_to(TESTS)}:{i}"
        for p in OURS
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"\s*(from|import)\s+test_\w+", line)
    ]
    assert found == []


def test_tiny_model_groups_register_nothing_on_import() -> None:
    """A module of ``tests/hfmodels/`` holds imports, definitions and assignments to its own names:
    no statement at import time writes into another module (``hfmodels/__init__.py`` merges the
    tables into ``REGISTRY`` itself)."""
    allowed = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
    wrong = []
    for p in sorted((TESTS / "hfmodels").glob("*.py")):
        body = ast.parse(p.read_text(encoding="utf-8")).body
        bound = (t for n in body for t in getattr(n, "targets", [getattr(n, "target", None)]))
        own = {t.id for t in bound if isinstance(t, ast.Name)}
        for node in body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            mine = all(
                isinstance(t, ast.Name) or (isinstance(t, ast.Subscript) and getattr(t.value, "id", None) in own)
                for t in targets
                if t is not None
            )
            if not docstring and not (isinstance(node, allowed) and mine):
                wrong.append(f"{p.name}:{node.lineno}")
    assert wrong == []


def test_every_replayed_family_has_a_tiny_model() -> None:
    pytest.importorskip("transformers")
    import hfmodels

    from moeaudit.families import FAMILIES

    assert hfmodels.ALL == tuple(FAMILIES)
    assert sorted(set(FAMILIES) - set(hfmodels.REGISTRY) - set(hfmodels.SAVERS)) == []


# a path from the repository root (tests, docs, moeaudit, sample_checkpoints) ending in a file name
CITED = re.compile(r"(?<![\w/.-])((?:tests|docs|moeaudit|sample_checkpoints)/[\w./-]*\.[A-Za-z]+)\b")
# made-up paths the checkers' own tests feed them (tests/test_docs_links.py, test_citations.py)
MADE_UP = {"moeaudit/nope.py", "docs/absent.md", "docs/in_a_fence.md", "docs/x.md"}


def test_files_the_tests_cite_exist() -> None:
    missing = [
        f"{p.relative_to(TESTS)}:{i}: {m.group(1)}"
        for p in OURS
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        for m in CITED.finditer(line)
        if not (ROOT / m.group(1)).exists() and m.group(1) not in MADE_UP
    ]
    assert missing == []
