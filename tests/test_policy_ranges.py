"""A policy constant that is finite but overflows what it enters (ε = 1e308: ε/δ is inf) is
refused when the policy is read, naming the key — before any replay, never as an internal error
about inf once the replays are done (docs/policy.md, "Ranges")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeaudit.cli import cli
from moeaudit.errors import InputError
from moeaudit.policy import MAX_SETTING, policy_from_dict

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"


@pytest.mark.parametrize(
    "data, key",
    [
        ({"envelope": {"epsilon": 1e308}}, "envelope.epsilon"),
        ({"margins": {"beta_h": 1e300}}, "margins.beta_h"),
        ({"receipts": {"flip_sigma": 1e200}}, "receipts.flip_sigma"),
        ({"receipts": {"boundary_etas": [0.1, 1e100]}}, "receipts.boundary_etas"),
        ({"envelope": {"window": 10**400}}, "envelope.window"),
        ({"gates": {"tol_c2": -1e300}}, "gates.tol_c2"),
    ],
)
def test_an_overflowing_constant_is_refused_naming_its_key(data: dict, key: str) -> None:
    with pytest.raises(InputError) as exc:
        policy_from_dict(data, "p.toml")
    line = exc.value.diagnostics()
    assert line.startswith(f"p.toml: {key} = ") and "out of range" in line, line
    assert len(line) < 200, line  # a 400-digit integer is not printed whole


def test_the_largest_allowed_constant_is_accepted() -> None:
    policy = policy_from_dict({"envelope": {"epsilon": MAX_SETTING}}, "p.toml")
    assert policy.envelope.epsilon == MAX_SETTING


@pytest.mark.skipif(not (SAMPLES / "resume").is_dir(), reason="sample runs not built")
def test_certify_refuses_it_before_any_replay(tmp_path: Path) -> None:
    from moeaudit.attest.signing import generate_key

    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(SAMPLES / "resume" / "checkpoint-1500", run / "checkpoint-1500")
    policy = tmp_path / "policy.toml"
    text = (SAMPLES / "policy.toml").read_text()
    assert "\nepsilon = 0.13883089679966962\n" in text
    policy.write_text(text.replace("\nepsilon = 0.13883089679966962\n", "\nepsilon = 1e308\n"))
    generate_key(tmp_path / "key")
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}).invoke(
        cli,
        [
            "certify",
            str(run),
            "--key",
            str(tmp_path / "key"),
            "--out",
            str(tmp_path / "out"),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--policy",
            str(policy),
            "--no-cache",
        ],
    )
    assert result.exit_code == 4, result.output
    assert f"{policy}: envelope.epsilon = 1e+308 is out of range" in result.stderr
    assert "replaying" not in result.stderr and "internal error" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "data, line",
    [
        ({"receipts": {"seed": True}}, "p.toml: receipts.seed must be an integer, got true"),
        ({"margins": {"tau": False}}, "p.toml: margins.tau must be a finite number, got false"),
        ({"envelope": {"calibrated": "yes"}}, "p.toml: envelope.calibrated must be true or false, got 'yes'"),
    ],
)
def test_a_wrong_type_is_shown_as_the_toml_says_it(data: dict, line: str) -> None:
    # the user wrote `seed = true`, not Python's True
    with pytest.raises(InputError) as exc:
        policy_from_dict(data, "p.toml")
    assert exc.value.diagnostics() == line
