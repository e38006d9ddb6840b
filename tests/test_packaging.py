"""The wheel a user gets from ``pip install "moeaudit @ git+…"`` (the README's CI snippet) holds
every module and template of the source tree, and the installed copy runs on its own.

An editable install maps the whole ``moeaudit/`` directory, so a package missing from
pyproject's list goes unnoticed there; only a real wheel shows it (``moeaudit.families`` was
once left out: every non-editable install failed at its first checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"


def _source_files() -> tuple[set[str], set[str]]:
    """(modules as wheel paths, templates as wheel paths) of the source tree."""
    modules = {
        p.relative_to(ROOT).as_posix() for p in (ROOT / "moeaudit").rglob("*.py") if "__pycache__" not in p.parts
    }
    templates = {f"moeaudit/_templates/{p.name}" for p in (ROOT / "templates").iterdir() if p.suffix in (".j2", ".css")}
    return modules, templates


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the source (the build never writes into the checkout)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("moeaudit", "templates"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--disable-pip-version-check",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("moeaudit-*.whl")
    return built


def test_the_wheel_holds_every_module_and_template(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules, templates = _source_files()
    assert modules - names == set()
    assert templates - names == set()
    assert "moeaudit/families/gpt_oss.py" in names  # one family file, named, as a witness
    schemas = {p.relative_to(ROOT).as_posix() for p in (ROOT / "moeaudit" / "schemas").glob("*.schema.json")}
    assert len(schemas) == 7 and schemas - names == set()  # the published JSON Schemas ship


def test_the_installed_wheel_reads_and_certifies_a_run(wheel: Path, tmp_path: Path) -> None:
    """Install the wheel into its own directory and run the CLI from there, outside the
    checkout: ``inspect`` reaches the families registry, ``certify`` replays two checkpoints
    and renders the HTML from the installed templates."""
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    run = tmp_path / "run"
    for step in (1250, 1500):
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{step}", run / f"checkpoint-{step}")
    # -S: no .pth files, so the checkout's editable finder cannot supply what the wheel lacks;
    # the dependencies come from the interpreter's site-packages, after the wheel.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), *deps]),
        "MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"),
        "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
    }

    def python(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-S", *args], cwd=tmp_path, env=env, capture_output=True, text=True)

    def moeaudit(*args: str) -> subprocess.CompletedProcess[str]:
        return python("-m", "moeaudit", *args)

    where = python("-c", "import moeaudit.families as f; print(f.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(site)
    shown = moeaudit("inspect", str(SAMPLES / "deepseek" / "checkpoint-1500"), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["family"] == "deepseek_v3"
    done = moeaudit(
        "certify",
        str(run),
        "--out",
        str(tmp_path / "out"),
        "--canary",
        str(SAMPLES / "canary.safetensors"),
        "--policy",
        str(SAMPLES / "policy.toml"),
    )
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "out" / "certificate.html").read_text()
    assert "verdict" in page and "<svg" in page
