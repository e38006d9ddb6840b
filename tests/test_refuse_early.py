"""Every output is refused before any replay (docs/decisions.md, "Where outputs may go"): an existing
--json/--junit/--out file without --force, or an output directory that does not exist, is one error line (exit 4) before
a checkpoint is replayed — not after 15 s of work. Each replay entry point is replaced by one that
raises, so a command that reached it would fail differently."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeaudit.cli import cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
HEALTHY, REFINE = SAMPLES / "healthy", SAMPLES / "sft-refine"

pytestmark = pytest.mark.skipif(not HEALTHY.is_dir(), reason="sample runs not built")

REPLAYS = (
    "moeaudit.receipts.state.state_receipts",
    "moeaudit.commands.compare.compare_checkpoints",
    "moeaudit.certify.audit_run",
    "moeaudit.series.evaluate_run",
    "moeaudit.calibrate.calibrate_run",
    "moeaudit.report.export.run_export",
    "moeaudit.judge.promote.rollback",
)


@pytest.fixture(autouse=True)
def no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    def replayed(*_a: object, **_k: object) -> None:
        raise AssertionError("the command replayed before checking its output")

    for target in REPLAYS:
        monkeypatch.setattr(target, replayed)


def commands(out: Path) -> dict[str, list[str]]:
    o = str(out)
    return {
        "gate --junit": ["gate", str(HEALTHY / "checkpoint-250"), str(HEALTHY / "checkpoint-500"), "--junit", o],
        "gate --json": ["gate", str(HEALTHY / "checkpoint-250"), str(HEALTHY / "checkpoint-500"), "--json", o],
        "gate across runs": ["gate", str(REFINE / "checkpoint-0"), str(HEALTHY / "checkpoint-500"), "--json", o],
        "receipts --json": ["receipts", str(HEALTHY / "checkpoint-250"), "--json", o],
        "compare --json": ["compare", str(REFINE / "checkpoint-0"), str(REFINE / "checkpoint-1000"), "--json", o],
        "envelope --json": ["envelope", str(HEALTHY), "--json", o],
        "calibrate --out": ["calibrate", str(HEALTHY), "--out", o],
        "export --out": ["export", str(HEALTHY / "certificate.json"), "--framework", "eu-ai-act", "--out", o],
    }


@pytest.mark.parametrize("name", list(commands(Path("x"))))
def test_existing_output_is_refused_before_any_replay(name: str, tmp_path: Path) -> None:
    out = tmp_path / "existing.out"
    out.write_text("keep me\n")
    start = time.monotonic()
    result = CliRunner().invoke(cli, commands(out)[name])
    assert result.exit_code == 4, (name, result.output, result.exception)
    assert "output exists" in result.stderr and "--force" in result.stderr, result.stderr
    assert str(out) in result.stderr
    assert out.read_text() == "keep me\n"
    assert time.monotonic() - start < 5  # no replay, no canary or policy search beyond headers


@pytest.mark.parametrize("name", ["gate --json", "receipts --json", "compare --json", "calibrate --out"])
def test_missing_output_directory_is_refused_before_any_replay(name: str, tmp_path: Path) -> None:
    out = tmp_path / "no-such-dir" / "report.json"
    result = CliRunner().invoke(cli, commands(out)[name])
    assert result.exit_code == 4, (name, result.output, result.exception)
    assert "output directory does not exist" in result.stderr, result.stderr
    assert not out.parent.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["certify", str(HEALTHY), "--out", "{tmp}/o"],
        ["gate", str(REFINE / "checkpoint-0"), str(REFINE / "checkpoint-1000")],
        ["compare", str(REFINE / "checkpoint-0"), str(REFINE / "checkpoint-1000")],
    ],
    ids=["certify", "gate", "compare"],
)
def test_a_missing_reference_is_refused_before_any_replay(argv: list[str], tmp_path: Path) -> None:
    missing = tmp_path / "healthy-ref"
    args = [a.format(tmp=tmp_path) for a in argv] + ["--reference", str(missing)]
    result = CliRunner(env={"XDG_CONFIG_HOME": str(tmp_path / "cfg")}).invoke(cli, args)
    assert result.exit_code == 4, (result.output, result.exception)
    why = "reference not found — pass a healthy checkpoint directory or its receipts JSON"
    assert result.stderr.splitlines()[-1] == f"moeaudit: error: {missing}: {why}"
    assert not (tmp_path / "o").exists()
