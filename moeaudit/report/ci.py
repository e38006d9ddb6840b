"""CI outputs of ``moeaudit gate``: JUnit XML and the GitHub step summary (Markdown)."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from moeaudit.papers import named_strings
from moeaudit.records import GateResult


def junit_xml(result: GateResult) -> str:
    # papers by name at their first mention (docs/decisions.md, "Papers are named at their first mention")
    result = named_strings(result)
    # The decision is a test case of its own: HOLD and INCONCLUSIVE both fail it, so a CI that
    # reads only the failure count never sees an inconclusive gate as "0 failures" (README.md, "Promotion check in CI").
    decided = result["decision"]
    why = f"{decided}: {result.get('decision_reason') or result.get('verdict_reason') or ''}"
    inner = "" if decided == "PROMOTE" else f"<failure type={quoteattr(decided.lower())} message={quoteattr(why)}/>"
    cases = [f'  <testcase classname="moeaudit.gate" name="decision">{inner}</testcase>']
    for c in result["conditions"]:
        inner = ""
        if c["status"] == "fail":
            inner = f"<failure message={quoteattr(c['detail'])}/>"
        elif c["status"] in ("skipped", "inconclusive"):
            inner = f"<skipped message={quoteattr(c['status'] + ': ' + c['detail'])}/>"
        cases.append(f'  <testcase classname="moeaudit.gate" name={quoteattr(c["name"])}>{inner}</testcase>')
    failures = sum(c["status"] == "fail" for c in result["conditions"]) + (decided != "PROMOTE")
    skipped = sum(c["status"] in ("skipped", "inconclusive") for c in result["conditions"])
    name = escape(f"{result['base']} → {result['candidate']}")
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name="moeaudit gate: {name}" '
        f'tests="{len(cases)}" failures="{failures}" skipped="{skipped}">\n' + "\n".join(cases) + "\n</testsuite>\n"
    )


def markdown_summary(result: GateResult) -> str:
    result = named_strings(result)
    icon = {"PROMOTE": "✅", "HOLD": "⛔", "INCONCLUSIVE": "⚠️"}[result["decision"]]
    lines = [
        f"### {icon} moeaudit gate: {result['decision']} — `{result['base']}` → `{result['candidate']}`",
        "",
        *([result["decision_reason"], ""] if result.get("decision_reason") else []),
        "| condition | status | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {c['name']} | {c['status']} | {c['detail'].replace('|', '/')} |" for c in result["conditions"]]
    return "\n".join(lines) + "\n"
