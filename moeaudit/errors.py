"""One error hierarchy for the whole tool.

The library raises these; only ``cli.py`` turns them into a one-line message and an exit
code (README.md, "Exit codes": 0 pass, 1 policy failed / signature invalid, 2 usage, 3 inconclusive,
4 input or operational error).
"""

from __future__ import annotations

import errno
from pathlib import Path

EXIT_POLICY_FAILED = 1
EXIT_USAGE = 2
EXIT_INPUT = 4
EXIT_INTERRUPTED = 130


class MoeauditError(Exception):
    """Base error: a user-facing message, the file it concerns and what to do."""

    exit_code = EXIT_INPUT

    def __init__(self, what: str, *, path: str | Path | None = None, hint: str | None = None):
        self.what = what
        self.path = None if path is None else str(path)
        self.hint = hint
        super().__init__(self.diagnostics())

    def diagnostics(self) -> str:
        """The single line printed on stderr (control characters escaped, so a file name with
        a newline cannot split it)."""
        what = self.what
        if self.path is not None:
            name = Path(self.path).name  # "config.json: …" after ".../config.json" says it twice
            what = what.removeprefix(f"{name}: ") if name else what
        where = elide(_one_line(self.path), MAX_PATH_CHARS) if self.path else None
        parts = [f"{where}: {elide_values(_one_line(what))}" if where else elide_values(_one_line(what))]
        if self.hint:
            parts.append(_one_line(self.hint))
        return short_line(" — ".join(parts))


def _one_line(text: str) -> str:
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


# A one-line error stays one short line (docs/decisions.md, "Error lines are capped"): a value quoted in a message (a
# list of 20 000 layer names, a path, a long JSON string) is shown by its two ends, so the line still says
# what is wrong, with what file, and what to do.
MAX_LINE_CHARS = 600
MAX_PATH_CHARS = 200
MAX_VALUE_CHARS = 120
ELLIPSIS = " … "
_OPEN, _CLOSE = "[{", "]}"  # data (lists, objects); a parenthesis is prose and stays whole


def elide(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters by replacing its middle with " … "."""
    if len(text) <= limit:
        return text
    keep = max(limit - len(ELLIPSIS), 2)
    head = (keep * 2 + 2) // 3
    return text[:head] + ELLIPSIS + text[len(text) - (keep - head) :]


def elide_values(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """Each outermost bracketed value — a list ``[...]`` or an object ``{...}`` — longer than
    ``limit`` characters, middle elided (an unbalanced bracket leaves the text as it is)."""
    out, depth, start, last = [], 0, 0, 0
    closing: list[str] = []
    for i, ch in enumerate(text):
        if ch in _OPEN:
            if depth == 0:
                start = i
            closing.append(_CLOSE[_OPEN.index(ch)])
            depth += 1
        elif ch in _CLOSE and depth:
            if closing.pop() != ch:
                return text
            depth -= 1
            if depth == 0 and i + 1 - start > limit:
                out += [text[last:start], elide(text[start : i + 1], limit)]
                last = i + 1
    return "".join(out) + text[last:]


def short_line(text: str) -> str:
    """The user-facing line, control characters escaped and at most MAX_LINE_CHARS long."""
    return elide(_one_line(text), MAX_LINE_CHARS)


class InputError(MoeauditError):
    """The input (checkpoint, canary, log, policy) is malformed or does not fit."""


_OS_HINTS = {
    errno.ENOSPC: "free disk space (or write somewhere else) and rerun",
    errno.EDQUOT: "free space in your quota (or write somewhere else) and rerun",
    errno.EACCES: "check the permissions of the file and of its directory",
    errno.EPERM: "check the permissions of the file and of its directory",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.EISDIR: "name a file, not a directory",
    errno.ENOTDIR: "a part of the path is not a directory: check the path",
    errno.ENOENT: "check the path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) and rerun",
    errno.EIO: "the disk or network file system reported an I/O error: check it and rerun",
    errno.EPIPE: "the program reading the output closed it early (e.g. `| head`): the exit code is no verdict; "
    "rerun without it",
}


def from_os_error(exc: OSError, doing: str | None = None, path: str | Path | None = None) -> InputError:
    """An operating-system error (full disk, permission, a directory where a file belongs) as
    the one-line input error: what failed, on which file, and what to do (exit 4)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    name = exc.filename if exc.filename is not None else path
    if isinstance(name, bytes):
        name = name.decode("utf-8", "backslashreplace")
    what = f"{doing}: {reason}" if doing else reason
    return InputError(what, path=name, hint=_OS_HINTS.get(exc.errno or 0))


class CheckpointError(InputError):
    """A checkpoint directory or one of its files cannot be used."""


class CanaryError(InputError):
    """A canary probe set is empty, ragged, out of vocabulary or corrupt."""


class UsageError(MoeauditError):
    exit_code = EXIT_USAGE


class PolicyFailed(MoeauditError):
    """Not an operational failure: the audited object failed the policy."""

    exit_code = EXIT_POLICY_FAILED
