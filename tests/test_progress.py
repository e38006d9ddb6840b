"""Per-layer progress with an ETA in a real terminal, nothing when not a TTY."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
pytestmark = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


def _run_dir(tmp: Path) -> Path:
    run = tmp / "run"
    for s in (1250, 1500):
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{s}", run / f"checkpoint-{s}")
    return run


def _argv(run: Path, out: Path, key: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "moeaudit",
        "certify",
        str(run),
        "--out",
        str(out),
        "--key",
        str(key),
        "--canary",
        str(SAMPLES / "canary.safetensors"),
        "--policy",
        str(SAMPLES / "policy.toml"),
    ]


@pytest.fixture()
def key(tmp_path: Path) -> Path:
    from moeaudit.attest.signing import generate_key

    generate_key(tmp_path / "key")
    return tmp_path / "key"


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "MOEAUDIT_CACHE_DIR": str(tmp / "cache"), "COLUMNS": "160", "TERM": "xterm"}


def test_a_terminal_sees_per_layer_progress_with_an_eta(tmp_path: Path, key: Path) -> None:
    main, child = pty.openpty()
    proc = subprocess.Popen(
        _argv(_run_dir(tmp_path), tmp_path / "out", key),
        stdin=child,
        stdout=child,
        stderr=child,
        env=_env(tmp_path),
        cwd=tmp_path,
        close_fds=True,
    )
    os.close(child)
    chunks = []
    while True:
        ready, _, _ = select.select([main], [], [], 180)
        if not ready:
            break
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=60) == 0
    os.close(main)
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))
    # the bar redraws ~10 times a second, so which layers show depends on the machine's speed
    assert re.search(r"\[[12]/2\] checkpoint-1(250|500) (forward|backward) layer [1-4]/4", screen), screen
    assert re.search(r"(forward|backward) layer [1-4]/4", screen)
    assert "ETA" in screen and re.search(r"ETA\s+(-:--:--|\d+:\d\d:\d\d)", screen)


def test_no_progress_bar_off_a_terminal(tmp_path: Path, key: Path) -> None:
    done = subprocess.run(
        _argv(_run_dir(tmp_path), tmp_path / "out", key),
        env=_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "forward layer" not in done.stderr and "ETA" not in done.stderr and "\x1b[" not in done.stderr
    assert "[1/2] checkpoint-1250" in done.stderr  # the plain one-line-per-checkpoint log stays
