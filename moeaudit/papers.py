"""The papers moeaudit cites by number, and the short names its output calls them by.

Help, terminal output and the HTML certificate name a paper at its first mention ("Gradient
Starvation Envelope (000) Eq. 16"), so a reader without the papers knows what is cited; the
numbers stay for brevity after that. ``docs/glossary.md`` has the full titles and the terms.
"""

from __future__ import annotations

import re
from typing import Any

# number → (short name used in the output, full title)
PAPERS: dict[str, tuple[str, str]] = {
    "000": (
        "Gradient Starvation Envelope",
        "The Gradient Starvation Envelope: A Formal Compliance Primitive for Sparse Mixture-of-Experts",
    ),
    "001": (
        "gradient conflict",
        "Mixture-of-Experts with Gradient Conflict-Driven Subspace Topology Pruning for Emergent Modularity",
    ),
    "002": ("boundary mass", "Soft-to-Hard Routing in Sparse Mixture-of-Experts Models"),
    "003": ("MoE atlas", "Making the Pretraining-to-Post-Training Boundary Observable in Large Mixture-of-Experts"),
    "004": (
        "stability/entropy collapse",
        "Stability as a Liability: Systematic Breakdown of Linguistic Structure in LLMs",
    ),
}
GLOSSARY = "docs/glossary.md"

# "(000)" after its name, or a paper number standing alone ("000 Eq. 16", "003's", "`003`"), not
# part of a number ("1.000", "1,000", a digest)
_MENTION = re.compile(r"\((00[0-4])\)|`?(?<![\w.,/−-])(00[0-4])(?![\w.)])`?")


def named(text: str, seen: set[str] | None = None) -> str:
    """``text`` with each paper named at its first mention: "000 Eq. 16" becomes "Gradient
    Starvation Envelope (000) Eq. 16". ``seen`` holds the papers already named earlier in the same
    output (help page, report, certificate) and is updated; without it the text stands alone."""
    seen = set() if seen is None else seen

    def name(m: re.Match[str]) -> str:
        if m.group(1):  # "(000)": named already if its name is right before it
            if text[: m.start()].rstrip().endswith(PAPERS[m.group(1)][0]):
                seen.add(m.group(1))
            return m.group(0)
        number = m.group(2)
        if number in seen:
            return m.group(0)
        seen.add(number)
        return f"{PAPERS[number][0]} ({number})"

    return _MENTION.sub(name, text)


def legend() -> str:
    """One line: every paper by number and short name."""
    return "; ".join(f"{number} {short}" for number, (short, _) in PAPERS.items())


def named_strings(obj: Any, seen: set[str] | None = None) -> Any:
    """A copy of a JSON-like document with ``named`` applied to every string in reading order
    (dict values in insertion order, lists in order), sharing ``seen``: one output document, one
    first mention per paper. For derived outputs (export, CI summaries), never for signed bytes."""
    seen = set() if seen is None else seen
    if isinstance(obj, str):
        return named(obj, seen)
    if isinstance(obj, dict):
        return {k: named_strings(v, seen) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [named_strings(v, seen) for v in obj]
    return obj
