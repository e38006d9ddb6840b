"""Common mistakes get a message that says what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from moeaudit.cli import cli

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"


@pytest.mark.parametrize(
    "argv", [["certify", "{missing}"], ["envelope", "{missing}"], ["inspect", "{missing}"], ["receipts", "{missing}"]]
)
def test_a_typo_says_the_path_does_not_exist(tmp_path: Path, argv: list[str]) -> None:
    args = [a.format(missing=tmp_path / "runs" / "helthy") for a in argv]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 4 and "no such" in result.stderr and "helthy" in result.stderr


def test_a_checkpoint_given_to_certify_points_at_its_run(tmp_path: Path) -> None:
    ckpt = SAMPLES / "healthy" / "checkpoint-250"
    result = CliRunner(env={"XDG_CONFIG_HOME": str(tmp_path)}).invoke(
        cli, ["certify", str(ckpt), "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 4
    assert "this is a checkpoint, not a run directory" in result.stderr
    assert f"audit its run: {SAMPLES / 'healthy'}" in result.stderr
    assert not (tmp_path / "out").exists()


def test_verify_defaults_to_your_key_like_export(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    result = CliRunner(env=env).invoke(cli, ["verify", str(tmp_path / "c.json")])
    assert result.exit_code == 4  # no "Missing option '--pubkey'" usage error
    # no key yet: says how to pass the signer's (tests/test_messages.py)
    assert "you have no moeaudit key yet — pass --pubkey KEY.pub" in result.stderr


def test_gate_without_a_policy_warns_the_constants_are_illustrative(tmp_path: Path) -> None:
    import shutil

    for s in (1250, 1500):
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{s}", tmp_path / "run" / f"checkpoint-{s}")
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "c")}).invoke(
        cli,
        [
            "gate",
            str(tmp_path / "run" / "checkpoint-1250"),
            str(tmp_path / "run" / "checkpoint-1500"),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
        ],
    )
    assert result.exit_code in (0, 1, 3)
    assert "warning: no policy file: the built-in constants are illustrative" in result.stderr
