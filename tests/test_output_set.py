"""The certificate's output set (docs/decisions.md, "Output set") appears whole or not at all, under a
lock, checked before the replay; policy and canary are never taken from inside the audited run
unless named."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from signed import signed_statement

import moeaudit.jsonio
from moeaudit.cli import cli
from moeaudit.output import OutputSet

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
pytestmark = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


@pytest.fixture()
def env(tmp_path: Path, samples_cache: Path) -> dict[str, str]:
    return {"MOEAUDIT_CACHE_DIR": str(samples_cache), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}


def _run(tmp: Path, steps: tuple[int, ...] = (1250, 1500), extra: dict[str, str] | None = None) -> Path:
    run = tmp / "run"
    run.mkdir()
    for s in steps:
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{s}", run / f"checkpoint-{s}")
    shutil.copy(SAMPLES / "healthy" / "metrics.jsonl", run / "metrics.jsonl")
    for name, text in (extra or {}).items():
        (run / name).write_text(text)
    return run


def certify(env: dict[str, str], run: Path, out: Path, *args: str):
    return CliRunner(env=env).invoke(
        cli,
        [
            "certify",
            str(run),
            "--out",
            str(out),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--policy",
            str(SAMPLES / "policy.toml"),
            *args,
        ],
    )


def leftovers(where: Path) -> list[str]:
    return sorted(p.name for p in where.iterdir() if ".staging-" in p.name or ".old-" in p.name)


def test_a_full_disk_leaves_no_partial_set_and_no_false_already_exists(tmp_path, env, monkeypatch) -> None:
    run, out = _run(tmp_path), tmp_path / "out"
    real = moeaudit.jsonio.atomic_write

    def full(path, data, **kw):
        if Path(path).name == "certificate.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data, **kw)

    monkeypatch.setattr(moeaudit.jsonio, "atomic_write", full)
    result = certify(env, run, out)
    assert result.exit_code == 4 and "space" in result.stderr.lower()
    assert not out.exists() and leftovers(tmp_path) == []
    monkeypatch.setattr(moeaudit.jsonio, "atomic_write", real)
    result = certify(env, run, out)  # no "a certificate already exists"
    assert result.exit_code == 0, result.stderr
    assert {p.name for p in out.iterdir()} == {
        "certificate.json",
        "certificate.html",
        "certificate.sigstore.json",
        "receipts",
    }


def test_force_replaces_the_whole_set_no_stale_receipts(tmp_path, env) -> None:
    run, out = _run(tmp_path), tmp_path / "out"
    assert certify(env, run, out).exit_code == 0
    stale = out / "receipts" / "pair-999-vs-1.json"
    stale.write_text("{}")
    assert certify(env, run, out).exit_code == 4  # exists, no --force
    assert certify(env, run, out, "--force").exit_code == 0
    assert not stale.exists() and leftovers(tmp_path) == []
    names = {p.name for p in (out / "receipts").iterdir()}
    assert names == {"checkpoint-1250.json", "checkpoint-1500.json", "pair-1500-vs-1250.json", "envelope.json"}


def test_a_directory_with_other_files_is_never_replaced(tmp_path, env) -> None:
    run, out = _run(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = certify(env, run, out, "--force")
    assert result.exit_code == 4 and "other files" in result.stderr
    assert (out / "notes.txt").read_text() == "mine"


def test_two_runs_to_one_output_the_second_stops_before_replaying(tmp_path, env) -> None:
    run, out = _run(tmp_path), tmp_path / "out"
    with OutputSet(out):  # as if another certify held it
        result = certify(env, run, out)
    assert result.exit_code == 4 and "another moeaudit run is writing" in result.stderr
    assert "replaying" not in result.stderr and "[1/2]" not in result.stderr


def test_an_unwritable_output_is_refused_before_the_replay(tmp_path, env) -> None:
    run = _run(tmp_path)
    (tmp_path / "afile").write_text("x")
    result = certify(env, run, tmp_path / "afile" / "out")
    assert result.exit_code == 4 and result.stderr.count("moeaudit: error:") == 1
    assert "[1/2]" not in result.stderr


def test_ctrl_c_leaves_no_receipts(tmp_path, env, monkeypatch) -> None:
    import moeaudit.report.html

    def boom(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(moeaudit.report.html, "render_html", boom)
    run, out = _run(tmp_path), tmp_path / "out"
    result = certify(env, run, out)
    assert result.exit_code == 130 and not out.exists() and leftovers(tmp_path) == []


def test_sigterm_is_handled_like_ctrl_c(tmp_path) -> None:
    run, out = _run(tmp_path, (250, 500, 750, 1000, 1250, 1500)), tmp_path / "out"
    env = {**os.environ, "MOEAUDIT_CACHE_DIR": str(tmp_path / "fresh-cache"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moeaudit",
            "certify",
            str(run),
            "--out",
            str(out),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--policy",
            str(SAMPLES / "policy.toml"),
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert proc.stderr is not None
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until the replay has started: staging exists
        line = proc.stderr.readline()
        if line.startswith("replaying") or not line:
            break
    assert leftovers(tmp_path), "the output set is staged before the replay"
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, rest
    assert "interrupted" in rest
    assert not out.exists() and leftovers(tmp_path) == []


# --- item 7: discovery never reaches into the audited run ---------------------------------------


def test_a_policy_inside_the_audited_run_is_not_picked_up(tmp_path, env) -> None:
    planted = '[gates]\ntol_c2 = 0.9\n[envelope]\nprovenance = "calibrated by an independent lab"\n'
    work = tmp_path / "work"
    work.mkdir()
    run = _run(work, extra={"policy.toml": planted})
    shutil.copy(SAMPLES / "canary.safetensors", run / "canary.safetensors")  # also planted
    out = tmp_path / "out"
    result = CliRunner(env=env).invoke(cli, ["certify", str(run), "--out", str(out)])
    # the canary inside the run is not used either: none is found outside it
    assert result.exit_code == 4 and "inside the audited run" in result.stderr
    shutil.copy(SAMPLES / "canary.safetensors", work / "canary.safetensors")
    result = CliRunner(env=env).invoke(cli, ["certify", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    pred = signed_statement(json.loads((out / "certificate.json").read_text()))["predicate"]
    assert pred["policy"]["source"] == "built-in default"
    assert pred["policy"]["gates"]["tol_c2"] != 0.9
    assert "ignored" in pred["policy"]["origin"] and "policy.toml" in pred["policy"]["origin"]
    assert pred["canary"]["origin"].startswith("found at") and "ignored" in pred["canary"]["origin"]
    named = CliRunner(env=env).invoke(
        cli, ["certify", str(run), "--out", str(out), "--force", "--policy", str(run / "policy.toml")]
    )
    assert named.exit_code == 0, named.stderr
    pred = signed_statement(json.loads((out / "certificate.json").read_text()))["predicate"]
    assert pred["policy"]["gates"]["tol_c2"] == 0.9 and pred["policy"]["origin"] == "named with --policy"


def test_samples_still_find_the_shipped_policy_and_canary(tmp_path, env) -> None:
    result = CliRunner(env=env).invoke(cli, ["inspect", str(SAMPLES / "healthy" / "checkpoint-250")])
    assert result.exit_code == 0
    from moeaudit.locate import find_upwards, locate_canary

    assert find_upwards(SAMPLES / "healthy", "policy.toml")[0].name == "policy.toml"
    assert locate_canary(None, SAMPLES / "healthy" / "checkpoint-250")[0].name == "canary.safetensors"
