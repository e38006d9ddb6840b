"""A paper cited by number ("000 Eq. 16") is named at its first mention in the
help, the terminal output and the HTML certificate, the certificate's footer lists all five and
points to docs/glossary.md; and document text reaches the terminal literally (rich would read
"[calibrated]" or "[/b]" as markup)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from moeaudit.cli import cli
from moeaudit.papers import PAPERS, named
from moeaudit.report.html import render_html
from moeaudit.report.terminal import print_gates

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
FIXTURE = ROOT / "tests" / "fixtures" / "statement_example.json"
# the short names the issue asks for, pinned here independently of moeaudit.papers
NAMES = {
    "000": "Gradient Starvation Envelope",
    "001": "gradient conflict",
    "002": "boundary mass",
    "003": "MoE atlas",
    "004": "stability/entropy collapse",
}
NUMBER = re.compile(r"(?<![\w.,/−-])(00[0-4])(?![\w.])")


def unnamed_first_mentions(text: str) -> list[str]:
    """Papers whose first mention in ``text`` is a bare number, with some context (line breaks
    and indents of wrapped help are spaces)."""
    text = " ".join(text.split())
    bad, first = [], {}
    for m in NUMBER.finditer(text):
        first.setdefault(m.group(1), m.start())
    for number, at in first.items():
        if not text[:at].endswith(f"{NAMES[number]} ("):
            bad.append(text[max(0, at - 40) : at + 20])
    return bad


def test_short_names_are_the_glossarys() -> None:
    assert {n: short for n, (short, _) in PAPERS.items()} == NAMES
    glossary = (ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")
    for number, short in NAMES.items():
        assert f"| `{number}` | {short} | *" in glossary


def test_named_names_the_first_mention_only() -> None:
    text = "illustrative (000 Table 6); 000 Eq. 11; 003's Eq. 25; 1.000 1,000 a003f 0.0002 step/002"
    assert named(text) == (
        "illustrative (Gradient Starvation Envelope (000) Table 6); 000 Eq. 11; "
        "MoE atlas (003)'s Eq. 25; 1.000 1,000 a003f 0.0002 step/002"
    )
    seen: set[str] = set()
    assert named("MoE atlas (003) Table 4", seen) == "MoE atlas (003) Table 4" and seen == {"003"}
    assert named("(003 Table 5), 002 §7", seen) == "(003 Table 5), boundary mass (002) §7"
    assert named("cells of `003` Theorem 1; `003` §4.1") == "cells of MoE atlas (003) Theorem 1; `003` §4.1"


def _help_pages(group: click.Group = cli, path: tuple[str, ...] = ()) -> dict[str, str]:
    pages = {" ".join(path) or "moeaudit": CliRunner().invoke(cli, [*path, "--help"]).output}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            pages.update(_help_pages(cmd, (*path, name)))
        else:
            pages[" ".join((*path, name))] = CliRunner().invoke(cli, [*path, name, "--help"]).output
    return pages


def test_help_names_every_paper_it_cites() -> None:
    pages = _help_pages()
    assert {name: unnamed_first_mentions(text) for name, text in pages.items() if unnamed_first_mentions(text)} == {}
    assert not [name for name, text in pages.items() if "SPEC" in text]
    assert "Gradient Starvation Envelope (000) Eq. 16" in " ".join(pages["calibrate"].split())


def test_envelope_output_names_the_paper_and_keeps_brackets() -> None:
    result = CliRunner().invoke(cli, ["envelope", str(SAMPLES / "collapse"), "--source", "logs"])
    assert result.exit_code == 1, result.output
    assert unnamed_first_mentions(result.stdout) == []
    assert "bounds of the Gradient Starvation Envelope (000), per series" in result.stdout
    assert "dead expert (000 §10.3): layer" in result.stdout  # short after the first mention
    # the sample policy is calibrated: rich used to swallow "[calibrated]" as a style tag
    assert re.search(r"budget ε/δ = [0-9.]+ \[calibrated\]\n", result.stdout)


def test_gates_output_names_papers_and_prints_document_text_literally(capsys: pytest.CaptureFixture[str]) -> None:
    pred = copy.deepcopy(json.loads(FIXTURE.read_text(encoding="utf-8"))["predicate"])
    pred["run"]["name"] = "run[bold]x[/]"
    pred["verdict_reason"] = "a YELLOW gate [step 1500] (003 Table 11)"
    pred["checks"][0]["reason"] += " [/b]"  # an unmatched closing tag made rich raise MarkupError
    print_gates(pred)
    text = capsys.readouterr().out
    assert unnamed_first_mentions(text) == []
    assert "run[bold]x[/] (pretraining) — gates" in text
    assert "[/b]" in text and "[step 1500]" in text
    assert "not gated (MoE atlas (003) Table 5)" in text  # the first mention, in a check's reason
    assert "(003 Table 11)" in text  # later mentions stay short


def test_compare_output_names_the_papers() -> None:
    run = SAMPLES / "sft-refine"
    result = CliRunner().invoke(cli, ["compare", str(run / "checkpoint-0"), str(run / "checkpoint-1000")])
    assert result.exit_code == 0, result.output
    assert unnamed_first_mentions(result.stdout) == []
    assert "MoE atlas (003)" in result.stdout and "(003 Table 4" in result.stdout


def _visible_text(page: str) -> str:
    body = re.sub(r"<(style|svg)\b.*?</\1>", " ", page, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)).replace("&#39;", "'")


@pytest.mark.parametrize("calibrated", [False, True])
def test_certificate_names_papers_and_has_a_legend_in_the_footer(calibrated: bool) -> None:
    stmt: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    stmt["predicate"]["verdict_reason"] = "a check failed: envelope exceeds its Grönwall bound (000 Eq. 12)"
    if calibrated:
        stmt["predicate"]["envelope"]["calibrated"] = True
    page = render_html(stmt, keyid="k" * 64, envelope_sha256="e" * 64)
    text = _visible_text(page)
    assert unnamed_first_mentions(text) == []
    assert "Gradient Starvation Envelope (000) Eq. 12" in text  # named in the verdict band, first
    assert "SPEC" not in text
    footer = _visible_text(page.split("<footer>")[1])
    legend = (
        "000 Gradient Starvation Envelope; 001 gradient conflict; 002 boundary mass; 003 MoE atlas; "
        "004 stability/entropy collapse"
    )
    assert legend in footer and "docs/glossary.md" in footer


def test_error_messages_name_the_paper(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("[envelope]\ndelta = 0.05\nwindow = 10\n", encoding="utf-8")
    result = CliRunner().invoke(cli, ["envelope", str(SAMPLES / "healthy"), "--policy", str(policy)])
    assert result.exit_code == 4, result.output
    assert "envelope.window must be ≥ 3/δ (Gradient Starvation Envelope (000) Eq. 17" in result.stderr
    assert unnamed_first_mentions(result.stderr) == []


def test_export_and_ci_outputs_name_the_papers(tmp_path: Path) -> None:
    """The compliance export (Markdown, HTML) and gate's CI outputs are read by people too: the
    first mention names the paper; the JSON export stays as signed (bare numbers)."""
    from moeaudit.attest.certificate import open_certificate, sign_statement
    from moeaudit.attest.signing import generate_key, load_public_key
    from moeaudit.jsonio import atomic_write, dumps
    from moeaudit.report.ci import junit_xml, markdown_summary
    from moeaudit.report.export import export, to_html, to_markdown

    key = generate_key(tmp_path / "key.pem")
    cert = tmp_path / "certificate.json"
    stmt = json.loads(FIXTURE.read_text())
    atomic_write(cert, dumps(sign_statement(stmt, key, issued_at="2026-01-01T00:00:00Z")))
    statement = open_certificate(cert, load_public_key(tmp_path / "key.pem.pub"))
    report = export(statement, "eu-ai-act")
    assert "003 Table 4" in json.dumps(report)  # the machine-readable report keeps the signed text
    for text in (to_markdown(report), to_html(report, statement)):
        assert "MoE atlas (003) Table" in text
        assert unnamed_first_mentions(re.sub(r"<[^>]+>", " ", text)) == []
    result = {
        "base": "a",
        "candidate": "b",
        "decision": "HOLD",
        "conditions": [
            {"name": "claims", "status": "fail", "detail": "not licensed by 003 Table 4; see 003 Eq. 27"},
            {"name": "envelope", "status": "inconclusive", "detail": "000 Eq. 16 budget within tolerance"},
        ],
    }
    for text in (junit_xml(result), markdown_summary(result)):
        assert "MoE atlas (003) Table 4" in text and "see 003 Eq. 27" in text
        assert "Gradient Starvation Envelope (000) Eq. 16" in text
