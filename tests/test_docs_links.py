"""Nothing the README or a document cites is missing: every relative link, and every repository
path written in backticks or in prose, names a file or folder of this tree.

A path is checked from the repository root, then from the package (``replay/groups.py`` means
``moeaudit/replay/groups.py``), then from the citing document's folder. Placeholders
(``tests/test_oracle_<family>.py``), globs and URLs are not paths. Fenced code blocks are
skipped (commands and output), so a path a reader must find goes in the prose.
Fast and torch-free: it reads Markdown only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda p: p.relative_to(ROOT).as_posix(),
)
# files a link may name before they exist (none now; a branch that links a file another branch
# writes lists it here until both are merged)
PENDING: set[str] = set()

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # a code span may wrap, not cross a blank line
_TOP = ("moeaudit", "docs", "tests", "benchmarks", "templates", "sample_checkpoints", ".ci")
_EXT = r"(?:py|md|json|jsonl|toml|css|j2|pem|pub|sh|safetensors|txt|proto|js|cfg|ini|yml|yaml)"
# a repository path in prose: starts at a top-level folder, ends in a known file extension
_PROSE = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, _TOP))})/[\w./-]*\.{_EXT})(?![\w/])")
_PACKAGES = {p.name for p in (ROOT / "moeaudit").iterdir() if (p / "__init__.py").exists()}
# a backticked token that is a path: a folder part and a file name, or a folder ending in "/"
_PATHLIKE = re.compile(rf"^\.?[\w.-]+(?:/[\w.-]+)*(?:\.{_EXT}|/)$")


def _prose(doc: Path) -> str:
    return _FENCE.sub("", doc.read_text(encoding="utf-8"))


def _exists(path: str, doc: Path) -> bool:
    path = path.rstrip("/")
    for base in (ROOT, ROOT / "moeaudit", doc.parent):
        full = (base / path).resolve()
        if full.exists() or (full.is_relative_to(ROOT) and full.relative_to(ROOT).as_posix() in PENDING):
            return True
    return False


def _repo_path(token: str) -> bool:
    """A backticked token names a file of this repository (not a user's path such as
    ``runs/a/metrics.jsonl``): its first part is a top-level folder, a package of ``moeaudit/``
    or a top-level file."""
    first = token.split("/", 1)[0]
    return first in _TOP or first in _PACKAGES or (ROOT / first).is_file()


def cited(doc: Path) -> list[tuple[str, str]]:
    """(kind, path) for every path ``doc`` cites."""
    text = _prose(doc)
    out: list[tuple[str, str]] = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor in the same page
        out.append(("link", target.split("#", 1)[0]))
    for code in _CODE.findall(text):
        token = re.sub(r":\d+$", "", code.strip())  # `moeaudit/cli.py:40`
        if "/" in token and _PATHLIKE.match(token) and _repo_path(token):
            out.append(("code", token))
    for path in _PROSE.findall(_CODE.sub("", text)):
        out.append(("prose", path.rstrip(".")))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", _prose(doc), re.M)
    return {slug(h) for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_anchor_is_a_heading(doc: Path) -> None:
    """``[x](other.md#a-heading)`` and ``[x](#a-heading)`` land on a heading of that document."""
    missing = []
    for target in _LINK.findall(_prose(doc)):
        if "#" not in target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        path, anchor = target.split("#", 1)
        file = (doc.parent / path).resolve() if path else doc
        if file.suffix == ".md" and file.is_file() and anchor not in anchors(file):
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to anchors that are no heading: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_path_exists(doc: Path) -> None:
    missing = sorted({f"{kind}: {path}" for kind, path in cited(doc) if not _exists(path, doc)})
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist:\n" + "\n".join(missing)


def test_the_checker_sees_links_code_and_prose(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "See [a](missing/a.md), [b](https://example.com/b.md), [c](#anchor), `moeaudit/nope.py`,\n"
        "`replay/groups.py`, docs/absent.md and `a placeholder tests/test_<x>.py`.\n"
        "```\ncat docs/in_a_fence.md\n```\n",
        encoding="utf-8",
    )
    found = cited(doc)
    assert ("link", "missing/a.md") in found and ("code", "moeaudit/nope.py") in found
    assert ("prose", "docs/absent.md") in found and ("code", "replay/groups.py") in found
    assert not any("example.com" in p or "in_a_fence" in p or "<x>" in p for _, p in found)
    assert not _exists("moeaudit/nope.py", doc) and _exists("replay/groups.py", doc)
    assert (
        slug("Shortcut-connected MoE (LongCat-Flash, longcat_flash)")
        == "shortcut-connected-moe-longcat-flash-longcat_flash"
    )
    assert slug("Runs, events and logs") == "runs-events-and-logs"


def test_the_readme_layout_names_the_packages() -> None:
    """The README's layout section names every package folder of ``moeaudit/`` (each exists:
    the test above)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    packages = sorted(p.name for p in (ROOT / "moeaudit").iterdir() if (p / "__init__.py").exists())
    missing = [p for p in packages if f"`moeaudit/{p}/`" not in layout]
    assert not missing, f"README.md's Layout section does not name moeaudit/{missing}"
