"""Helpers of tests/test_torch_free.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


PROBE = """
import json, sys
from moeaudit.cli import cli
for argv in json.loads(sys.argv[1]):
    cli.main(argv, prog_name="moeaudit", standalone_mode=False)
print(json.dumps(sorted(m for m in ("torch", "numpy") if m in sys.modules)))
"""


def _modules_after(argv: list[list[str]]) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
