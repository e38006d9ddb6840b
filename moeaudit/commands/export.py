"""``moeaudit export``: a verified certificate's evidence mapped to a compliance framework."""

from __future__ import annotations

from pathlib import Path

from moeaudit.commands.common import check_output


def export(
    cert: Path, framework: str, out: Path, *, fmt: str | None = None, pubkey: Path | None = None, force: bool = False
) -> str:
    """Verify ``cert`` with ``pubkey`` and write the report to ``out`` whole; the format used
    is returned (``fmt``, else from ``out``'s suffix: .html or .json, else md)."""
    from moeaudit.jsonio import atomic_write
    from moeaudit.report.export import run_export

    check_output(out, force)
    # `--out x.html` means HTML; an explicit format wins
    fmt = fmt or {".html": "html", ".htm": "html", ".json": "json"}.get(out.suffix.lower(), "md")
    atomic_write(out, run_export(cert, pubkey, framework, fmt))
    return fmt
