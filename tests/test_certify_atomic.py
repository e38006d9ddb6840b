"""A failure in the middle of `certify` leaves no partial certificate; the CI gate writes its
Markdown summary where GitHub Actions asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import moeaudit.report.html
from moeaudit.cli import cli

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"
pytestmark = pytest.mark.skipif(not (SAMPLES / "sft-refine").is_dir(), reason="sample runs not built")


def test_failure_while_rendering_leaves_no_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a, **_k):
        raise KeyboardInterrupt  # as if Ctrl-C arrived while the page was being rendered

    monkeypatch.setattr(moeaudit.report.html, "render_html", boom)
    env = {"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    out = tmp_path / "out"
    result = CliRunner(env=env).invoke(cli, ["certify", str(SAMPLES / "sft-refine"), "--out", str(out)])
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert not (out / "certificate.json").exists() and not (out / "certificate.html").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_gate_appends_github_step_summary(tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    env = {"GITHUB_STEP_SUMMARY": str(summary), "MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}
    result = CliRunner(env=env).invoke(
        cli, ["gate", str(SAMPLES / "healthy" / "checkpoint-250"), str(SAMPLES / "healthy" / "checkpoint-1500")]
    )
    assert result.exit_code == 0, result.output + result.stderr
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "moeaudit gate: PROMOTE" in text
    assert "| envelope | pass |" in text and "| refinement | skipped |" in text
