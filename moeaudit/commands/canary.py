"""``moeaudit canary build|show``: package token windows or tokenized text into a hashed canary,
and describe one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit.commands.common import check_output

if TYPE_CHECKING:
    from moeaudit.canary import Canary


def build(
    out: Path,
    *,
    tokens: Path | None = None,
    text: Path | None = None,
    tokenizer: Path | None = None,
    window_len: int = 256,
    windows: int = 64,
    force: bool = False,
) -> Canary:
    """Windows from ``tokens`` (JSONL of token lists, as given) or from ``text`` tokenized with
    ``tokenizer`` (``windows`` windows of ``window_len`` tokens), saved to ``out``."""
    from moeaudit import canary as canary_mod

    check_output(out, force)
    if text is not None:
        from moeaudit.canary_text import build_from_text

        assert tokenizer is not None
        c = build_from_text(text, tokenizer, window_len=window_len, windows=windows)
    else:
        assert tokens is not None
        c = canary_mod.build_from_jsonl(tokens)
    canary_mod.save(c, out)
    return c


def show(path: Path) -> dict[str, Any]:
    """A canary's shape, domains and digest."""
    from moeaudit import canary as canary_mod

    return canary_mod.load(path).summary()
