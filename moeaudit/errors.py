"""One error hierarchy for the whole tool.

The library raises these; only ``cli.py`` turns them into a one-line message and an exit
code (SPEC §10: 0 pass, 1 policy failed / signature invalid, 2 usage, 3 inconclusive,
4 input or operational error).
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_POLICY_FAILED = 1
EXIT_USAGE = 2
EXIT_INCONCLUSIVE = 3
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
        parts = [f"{self.path}: {what}" if self.path else what]
        if self.hint:
            parts.append(self.hint)
        return _one_line(" — ".join(parts))


def _one_line(text: str) -> str:
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


class InputError(MoeauditError):
    """The input (checkpoint, canary, log, policy) is malformed or does not fit."""


class CheckpointError(InputError):
    """A checkpoint directory or one of its files cannot be used."""


class CanaryError(InputError):
    """A canary probe set is empty, ragged, out of vocabulary or corrupt."""


class UsageError(MoeauditError):
    exit_code = EXIT_USAGE


class PolicyFailed(MoeauditError):
    """Not an operational failure: the audited object failed the policy."""

    exit_code = EXIT_POLICY_FAILED
