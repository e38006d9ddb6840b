"""``moeaudit export``: a verified certificate's evidence mapped to a compliance framework."""

from __future__ import annotations

from pathlib import Path

from moeaudit.commands.common import check_output

# --out's suffix → the format written without --format (no suffix, or a text one: Markdown)
SUFFIXES = {".html": "html", ".htm": "html", ".json": "json", ".md": "md", ".markdown": "md", ".txt": "md", "": "md"}


def export(
    cert: Path,
    framework: str,
    out: Path,
    *,
    fmt: str | None = None,
    pubkey: Path | None = None,
    force: bool = False,
    sign: bool = False,
) -> tuple[str, Path | None]:
    """Verify ``cert`` with ``pubkey`` and write the report to ``out`` whole; returned: the
    format used (``fmt``, else from ``out``'s suffix: :data:`SUFFIXES`) and, with
    ``sign``, ``OUT.dsse.json``: the JSON report signed as a statement about the certificate
    file's digest and ``out``'s (docs/security.md, "Signed exports")."""
    from moeaudit.jsonio import atomic_write
    from moeaudit.report.export import run_export

    check_output(out, force)
    # `--out x.html` means HTML; an explicit format wins; a suffix of another format (x.pdf) is
    # refused rather than given Markdown under a name that says otherwise
    suffix = out.suffix.lower()
    if fmt is None and suffix not in SUFFIXES:
        from moeaudit.errors import UsageError

        raise UsageError(
            f"--out ends in {suffix}, a format export does not write (md, html, json)",
            path=out,
            hint="name the file .md, .html or .json, or pass --format",
        )
    fmt = fmt or SUFFIXES[suffix]
    signed = Path(str(out) + ".dsse.json") if sign else None
    check_output(signed, force)
    text = run_export(cert, pubkey, framework, fmt)
    envelope = None
    if signed is not None:  # both built before either is written
        from moeaudit.attest.signing import default_key_path, load_private_key
        from moeaudit.jsonio import dumps
        from moeaudit.report.export import run_signed_export

        # the report's bytes as atomic_write writes them: the statement binds the file beside it
        report_file = (out.name, text.encode("utf-8"))
        key = load_private_key(default_key_path())[0]
        envelope = dumps(run_signed_export(cert, pubkey, framework, key, report_file))
    atomic_write(out, text)
    if signed is not None and envelope is not None:
        atomic_write(signed, envelope)
    return fmt, signed
