"""Code cites what the package ships (docs/decisions.md, "Citations"): a paper by number, or a
design note by file and heading — never an issue number, a work session, or a section of the
product specification, which the package does not ship.

* no comment, docstring or message in ``moeaudit/``, ``benchmarks/``, ``templates/`` or
  ``tests/`` cites an issue (``issue 27``, ``issues 14 and 24``, ``issue #4``) or a SPEC section
  (``SPEC §3``);
* every ``docs/<file>.md, "Heading"`` or ``README.md, "Heading"`` a file cites names a document
  that exists and a heading, bold lead or table row name that the document has, and every
  ``docs/benchmarks.md §N`` a numbered section of it, so a renamed heading fails here, not in a
  reader's hands.

Reads source text only: no import of moeaudit, no torch, under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(
    {
        *(ROOT / "moeaudit").rglob("*.py"),
        *(ROOT / "moeaudit" / "schemas").glob("*.json"),
        *(ROOT / "benchmarks").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.sh"),
        *(p for p in (ROOT / "templates").rglob("*") if p.is_file()),
        *(ROOT / "tests").rglob("*.py"),
    }
    - {Path(__file__).resolve()}  # this file names the patterns it refuses
)

# Lines that name the word without citing it: tests that the rendered pages never say "SPEC".
NOT_CITATIONS = {
    "tests/test_papers.py": ('"SPEC" in text', '"SPEC" not in text'),
}

ISSUE = re.compile(r"\bissues? ?#?\d+", re.I)
SESSION = re.compile(r"\bsession \d+\b", re.I)
SPEC = re.compile(r"\bSPEC\b")
# `docs/decisions.md, "The canary must be the run's canary"` or (docs/policy.md "Reduced precision");
# not a path in a string literal (``ROOT / "README.md").read_text(...)``, ``"docs/x.md"``)
DOC_CITE = re.compile(r"(?<![\"'/\w])((?:docs/[\w/.-]+|README)\.md)(?![\"'])\s*[,(]?\s*\"([^\"]{3,})\"")
# docs/benchmarks.md §10, docs/benchmarks.md §1d
DOC_SECTION = re.compile(r"(docs/[\w/.-]+\.md) §(\d+[a-z]?)\b")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _flat(text: str) -> str:
    """Comment markers and line breaks out, so a citation wrapped over lines reads as one; a
    comment that ends before a line of code ends there (¶), so the code's strings are not read
    as the heading it cites."""
    text = re.sub(r"(#[^\n]*)\n(?=[ \t]*[^\s#])", "\\1 ¶\n", text)
    text = re.sub(r"\n\s*#\s?", " ", text)
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_no_issue_session_or_spec_section_is_cited(path: Path) -> None:
    allowed = NOT_CITATIONS.get(_rel(path), ())
    bad = [
        f"{_rel(path)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if (ISSUE.search(line) or SESSION.search(line) or SPEC.search(line)) and not any(a in line for a in allowed)
    ]
    assert not bad, "cite the paper or the design note instead:\n" + "\n".join(bad)


def _headings(doc: Path) -> str:
    """The headings, bold leads and table row names (first cells) of ``doc``, flattened and
    without backticks, for a substring test."""
    text = doc.read_text(encoding="utf-8")
    heads = re.findall(r"^#+ (.+)$", text, re.M)
    leads = re.findall(r"\*\*(.+?)\*\*", text, re.S)
    rows = re.findall(r"^\| ([^|]+?) \|", text, re.M)
    return " ¶ ".join(_flat(h).replace("`", "") for h in (*heads, *leads, *rows))


def cited_notes(path: Path) -> list[tuple[str, str]]:
    return [(doc, _flat(title)) for doc, title in DOC_CITE.findall(_flat(path.read_text(encoding="utf-8")))]


def _sections(doc: Path) -> set[str]:
    """The numbers of ``doc``'s numbered headings (``## 10. …`` → ``10``, ``### 1d. …`` → ``1d``)."""
    return set(re.findall(r"^#+ (\d+[a-z]?)\. ", doc.read_text(encoding="utf-8"), re.M))


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_cited_design_notes_exist(path: Path) -> None:
    missing = []
    for doc, title in cited_notes(path):
        target = ROOT / doc
        if not target.is_file():
            missing.append(f"{doc} (no such file)")
        elif title.replace("`", "") not in _headings(target):
            missing.append(f'{doc}, "{title}" (no such heading or bold lead)')
    for doc, number in DOC_SECTION.findall(_flat(path.read_text(encoding="utf-8"))):
        target = ROOT / doc
        if not target.is_file() or number not in _sections(target):
            missing.append(f"{doc} §{number} (no such numbered section)")
    assert not missing, f"{_rel(path)} cites:\n" + "\n".join(missing)


def test_the_checks_see_what_they_must(tmp_path: Path) -> None:
    assert ISSUE.search("(issue 27 §2)") and ISSUE.search("issues 14 and 24") and ISSUE.search("issue #4")
    assert ISSUE.search("Issue 16 item 3")
    assert not ISSUE.search("the issued key") and not ISSUE.search("an issue with the file")
    assert not ISSUE.search("issue time") and not ISSUE.search("tissue 3")
    assert SPEC.search("SPEC §3") and not SPEC.search("SPECTRUM") and not SPEC.search("a spec")
    src = tmp_path / "m.py"
    src.write_text(
        '# as in docs/decisions.md, "Margins are\n# intervals" (paired); README.md, "Exit codes"\n'
        "# docs/benchmarks.md §10 and docs/benchmarks.md §1d\n",
        encoding="utf-8",
    )
    assert cited_notes(src) == [("docs/decisions.md", "Margins are intervals"), ("README.md", "Exit codes")]
    assert "Margins are intervals" in _headings(ROOT / "docs" / "decisions.md")
    code = tmp_path / "c.py"
    code.write_text(
        'x = f(1)  # docs/monitors.md\ny = {"ablation": 1}\nt = (ROOT / "README.md").read_text(encoding="utf-8")\n'
        'assert "docs/glossary.md" in footer and "x" in footer\n',
        encoding="utf-8",
    )
    assert cited_notes(code) == []
    assert "Exit codes" in _headings(ROOT / "README.md")
    assert DOC_SECTION.findall(_flat(src.read_text(encoding="utf-8"))) == [
        ("docs/benchmarks.md", "10"),
        ("docs/benchmarks.md", "1d"),
    ]
    assert {"10", "1d"} <= _sections(ROOT / "docs" / "benchmarks.md")
    assert "9" in _sections(ROOT / "docs" / "benchmarks.md") and "99" not in _sections(ROOT / "docs" / "benchmarks.md")
