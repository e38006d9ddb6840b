"""A new user's walk through the README and ``--help`` on the shipped samples: what each
documented spelling does, exit codes and one-line errors included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeaudit.cli import cli

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"
needs_samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


@needs_samples
def test_gate_json_dash_is_stdout_as_for_receipts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `--json -` means stdout for receipts, compare and envelope; gate's --json is the same option
    monkeypatch.chdir(tmp_path)
    run = SAMPLES / "healthy"
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}).invoke(
        cli, ["gate", str(run / "checkpoint-250"), str(run / "checkpoint-500"), "--json", "-"]
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)  # stdout is the document alone
    assert doc["schema"] == "moeaudit.gate/v1" and doc["decision"] == "PROMOTE"
    assert doc["candidate"] == "checkpoint-500" and doc["base"] == "checkpoint-250"
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no file named "-"
