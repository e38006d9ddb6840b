"""Compliance export (docs/compliance.md): a verified certificate's evidence, item by item.

For each framework item the export says which certificate fields bear on it and which parts of
the item the certificate cannot show. Nothing is claimed by fiat: an item is split into the
*aspects* it asks for, each aspect names the selectors that can back it, and the status is
counted from what this certificate actually holds —

* ``covered``     every aspect is backed by evidence in the certificate;
* ``partial``     some aspects are, the others are listed under ``not_shown`` with the reason;
* ``not covered`` none is. Related fields that do not meet the item are listed as ``context``.

An aspect with no selector is one no training-health certificate can show (training data,
compute, organisational acts); it is listed, never dropped. Requirements are one-sentence
paraphrases, not the frameworks' text; ``docs/compliance.md`` cites the sources and explains
each mapping. Exports are made only from a statement that
:func:`moeaudit.attest.certificate.open_certificate` verified. Torch-free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from moeaudit.errors import InputError, UsageError
from moeaudit.papers import named_strings
from moeaudit.records import VerifiedStatement
from moeaudit.report.evidence import (
    COVERED,
    NOT_COVERED,
    OUTSIDE,
    PARTIAL,
    Aspect,
    Evidence,
    Framework,
    Item,
    _p,
    canary,
    envelope,
)
from moeaudit.report.frameworks import FRAMEWORKS

SCHEMA = "moeaudit.export/v1"
EXPORT_PREDICATE = "https://moeaudit.dev/compliance-export/v1"  # a signed export's predicateType
FORMATS = ("md", "html", "json")
TEMPLATE = "export.html.j2"


# --- export ---------------------------------------------------------------------------------------


def status_of(backed: Sequence[bool]) -> str:
    if backed and all(backed):
        return COVERED
    return PARTIAL if any(backed) else NOT_COVERED


def assess(item: Item, stmt: VerifiedStatement) -> dict[str, Any]:
    """One item against one verified statement: status, evidence, what is not shown, context.
    Fields are named as the signed statement spells them (lowerCamelCase in a v2 predicate)."""
    from moeaudit.attest.certificate import PREDICATE_TYPE
    from moeaudit.attest.naming import wire_path

    where = wire_path if stmt.get("predicateType") == PREDICATE_TYPE else str
    evidence, not_shown, backed = [], [], []
    for aspect in item.aspects:
        found = [select(stmt) for select in aspect.selectors]
        shown = [e for e in found if e.shown]
        backed.append(bool(shown))
        evidence += [{"aspect": aspect.what, "field": where(e.field), "summary": e.summary} for e in shown]
        if not shown:
            why = "; ".join(e.summary for e in found) or OUTSIDE
            not_shown.append({"aspect": aspect.what, "reason": why})
    related = ((select(stmt), why) for select, why in item.context)
    context = [{"field": where(e.field), "summary": e.summary, "why": why} for e, why in related if e.shown]
    return {
        "id": item.id,
        "requirement": item.requirement,
        "status": status_of(backed),
        "evidence": evidence,
        "not_shown": not_shown,
        "context": context,
        "note": item.note,
    }


def certificate_summary(stmt: VerifiedStatement) -> dict[str, Any]:
    p = _p(stmt)
    run, t = p.get("run") or {}, p.get("tool") or {}
    return {
        "subjects": [
            {"name": s.get("name"), "sha256": (s.get("digest") or {}).get("sha256")} for s in stmt.get("subject") or []
        ],
        "run": run.get("name"),
        "stage": run.get("stage"),
        "verdict": p.get("verdict"),
        "issued_at": p.get("issued_at"),
        "keyid": stmt.get("_keyid"),
        "policy_digest": (p.get("policy") or {}).get("digest"),
        "canary_digest": ((p.get("canary") or {}).get("digest") or {}).get("sha256"),
        "tool": " ".join(str(v) for v in (t.get("name"), t.get("version")) if v),
    }


def framework(key: str) -> Framework:
    if key not in FRAMEWORKS:
        raise UsageError(f"unknown framework {key!r}", hint="choose one of " + ", ".join(FRAMEWORKS))
    return FRAMEWORKS[key]


def export(statement: VerifiedStatement, framework_key: str) -> dict[str, Any]:
    """The JSON-ready report of a statement returned by ``open_certificate``, for one framework."""
    if not statement.get("_keyid"):  # set only by open_certificate, after the signature verified
        raise InputError(
            "export needs a verified certificate", hint="open it with moeaudit.attest.certificate.open_certificate"
        )
    fw = framework(framework_key)
    items = [assess(item, statement) for item in fw.items]
    counts = {s: sum(i["status"] == s for i in items) for s in (COVERED, PARTIAL, NOT_COVERED)}
    summary = certificate_summary(statement)
    about: dict[str, Any] = {"key": fw.key, "title": fw.title, "source": fw.source, "note": fw.note}
    if fw.audience:  # one audience's view: it names the certificate file it was made from
        about["audience"] = fw.audience
        summary["sha256"] = statement.get("_sha256")
    return {"schema": SCHEMA, "framework": about, "certificate": summary, "summary": counts, "items": items}


def export_statement(
    report: Mapping[str, Any],
    statement: VerifiedStatement,
    *,
    certificate_name: str,
    report_file: tuple[str, bytes] | None = None,
) -> dict[str, Any]:
    """The JSON report as an in-toto statement whose first subject is the verified certificate
    file, named ``certificate_name`` (the base name of the file whose bytes ``_sha256`` of
    ``open_certificate`` hashes: ``certificate.json`` or ``certificate.sigstore.json``): the
    authority and the downstream views of one certificate name the same digest, so a reader can
    tell they rest on one signed statement. ``report_file`` (base name, bytes): the report file
    written beside the signature, bound as the second subject (docs/security.md, "Signed
    exports")."""
    from moeaudit.attest.certificate import STATEMENT_TYPE

    digest = statement.get("_sha256")
    if not digest:
        raise InputError("export needs a verified certificate", hint="open it with open_certificate")
    subject = [{"name": certificate_name, "digest": {"sha256": digest}}]
    if report_file is not None:
        name, raw = report_file
        subject.append({"name": name, "digest": {"sha256": hashlib.sha256(raw).hexdigest()}})
    return {"_type": STATEMENT_TYPE, "subject": subject, "predicateType": EXPORT_PREDICATE, "predicate": dict(report)}


def run_signed_export(
    cert_path: str | Path,
    pubkey_path: str | Path | None,
    framework_key: str,
    key: Any,
    report_file: tuple[str, bytes] | None = None,
) -> dict[str, Any]:
    """Verify the certificate, export it as JSON, and sign the report (DSSE, ``key``) as an
    in-toto statement about the certificate file's digest and, given, the report file's
    (:func:`export_statement`)."""
    from moeaudit.attest.certificate import canonical_json, open_certificate
    from moeaudit.attest.signing import default_public_key, load_public_key, sign_envelope

    framework(framework_key)
    pub = Path(pubkey_path) if pubkey_path else default_public_key()
    stmt = open_certificate(Path(cert_path), load_public_key(pub))
    body = export_statement(
        export(stmt, framework_key), stmt, certificate_name=Path(cert_path).name, report_file=report_file
    )
    return sign_envelope(key, canonical_json(body))


def run_export(cert_path: str | Path, pubkey_path: str | Path | None, framework_key: str, fmt: str) -> str:
    """Verify the certificate (default key: the user's signing key + ".pub"), export, render."""
    from moeaudit.attest.certificate import open_certificate
    from moeaudit.attest.signing import default_public_key, load_public_key
    from moeaudit.jsonio import dumps

    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}", hint="choose one of " + ", ".join(FORMATS))
    framework(framework_key)  # a usage error before any file is read
    key = Path(pubkey_path) if pubkey_path else default_public_key()
    stmt = open_certificate(Path(cert_path), load_public_key(key))
    report = export(stmt, framework_key)
    if fmt == "html":
        return to_html(report, stmt)
    return {"json": dumps, "md": to_markdown}[fmt](report)


# --- renderers ------------------------------------------------------------------------------------


def _md(text: Any) -> str:
    """Certificate text inside Markdown: one line, no raw HTML, no table or emphasis breakout."""
    s = " ".join(str(text).split())
    s = s.replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for ch in "|*_`[]#":
        s = s.replace(ch, "\\" + ch)
    return s


CERT_ROWS = (
    ("verdict", "verdict"),
    ("run", "run"),
    ("stage", "stage"),
    ("issued at", "issued_at"),
    ("signing key id", "keyid"),
    ("policy digest", "policy_digest"),
    ("canary digest", "canary_digest"),
    ("tool", "tool"),
)


def to_markdown(report: Mapping[str, Any]) -> str:
    # papers by name at their first mention (docs/decisions.md, "Papers are named at their first mention")
    report = named_strings(report)
    fw, cert, n = report["framework"], report["certificate"], report["summary"]
    out = [
        f"# {_md(fw['title'])}",
        "",
        f"Source: {_md(fw['source'])}.",
        "",
        _md(fw["note"]),
        "",
        "## Certificate",
        "",
        "| field | value |",
        "|---|---|",
    ]
    out += [f"| {label} | {_md(cert.get(key) or '—')} |" for label, key in CERT_ROWS]
    out += [f"| certificate file | sha256 {_md(cert['sha256'])} |"] if cert.get("sha256") else []
    out += [f"| subject {_md(s['name'])} | sha256 {_md(s['sha256'])} |" for s in cert["subjects"]]
    out += [
        "",
        f"Items: {n[COVERED]} covered, {n[PARTIAL]} partial, {n[NOT_COVERED]} not covered. "
        "An item is covered only when every aspect it asks for is backed by this certificate.",
        "",
        "| item | status |",
        "|---|---|",
    ]
    out += [f"| {_md(i['id'])} | {i['status']} |" for i in report["items"]]
    for i in report["items"]:
        out += ["", f"## {_md(i['id'])} — {i['status']}", "", f"*Requirement (paraphrased):* {_md(i['requirement'])}"]
        out += _md_list(
            "Evidence in the certificate:",
            [f"{_md(e['aspect'])} — `{e['field']}`: {_md(e['summary'])}" for e in i["evidence"]],
        )
        out += _md_list(
            "Not shown by the certificate:", [f"{_md(g['aspect'])} — {_md(g['reason'])}" for g in i["not_shown"]]
        )
        out += _md_list(
            "Related, but not evidence for this item:",
            [f"`{c['field']}`: {_md(c['summary'])} — {_md(c['why'])}" for c in i["context"]],
        )
        out += ["", f"Note: {_md(i['note'])}"] if i["note"] else []
    return "\n".join(out) + "\n"


def _md_list(title: str, lines: list[str]) -> list[str]:
    return ["", title, "", *(f"- {line}" for line in lines)] if lines else []


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2

    from moeaudit.report.svg import page_text
    from moeaudit.resources import templates_dir

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=page_text,  # control characters shown escaped, as on the certificate page
    )


def to_html(report: Mapping[str, Any], statement: VerifiedStatement | None = None) -> str:
    """One self-contained page: inline CSS, every value autoescaped, no script, no URL. Given the
    verified statement, each item shows the chart that backs its evidence (docs/compliance.md)."""
    html: str = (
        _environment()
        .get_template(TEMPLATE)
        .render(
            r=named_strings(report),
            COVERED=COVERED,
            PARTIAL=PARTIAL,
            NOT_COVERED=NOT_COVERED,
            charts=_charts(statement),
            chart_for=_chart_for,
        )
    )
    return html


def _charts(statement: VerifiedStatement | None) -> dict[str, Any]:
    """The certificate page's figures, drawn from the same verified statement."""
    if statement is None:
        return {}
    from moeaudit.report import html

    p = statement.get("predicate") or {}
    gates, protected = list(p.get("gates") or []), [int(x) for x in p.get("protected_layers") or []]
    out: dict[str, Any] = {}
    figs = html.figures(gates, protected) if gates else {}
    if figs.get("loss_c2") is not None:
        out["gates"] = figs["loss_c2"]
    env = html.envelope_view(p.get("envelope"), list(p.get("checks") or []))
    if not env.get("missing") and env.get("panels"):
        out["envelope"] = env["panels"][0]["svg"]
    occupancy = html.heatmap_view(p.get("heatmaps"), protected).get("occupancy")
    if occupancy:
        out["occupancy"] = occupancy["svg"]
    return out


def _chart_for(item: Mapping[str, Any], charts: Mapping[str, Any]) -> list[Any]:
    """The charts an item's evidence rests on, by the statement fields it cites."""
    fields = " ".join(str(e.get("field", "")) for e in item.get("evidence") or [])
    wanted = [
        name for name, key in (("gates", "gates"), ("envelope", "envelope"), ("occupancy", "heatmaps")) if key in fields
    ]
    if "occupancy" not in wanted and "occupancy" in fields:
        wanted.append("occupancy")
    return [charts[name] for name in wanted if name in charts]


__all__ = [
    "COVERED",
    "FORMATS",
    "FRAMEWORKS",
    "NOT_COVERED",
    "PARTIAL",
    "Aspect",
    "Evidence",
    "Framework",
    "Item",
    "canary",
    "envelope",
    "export",
    "export_statement",
    "run_export",
    "run_signed_export",
    "to_html",
    "to_markdown",
]
