"""benchmarks/gpu.py runs end to end on the CPU at its tiny shape (fresh processes, ratios), so the
GPU benchmark the lead runs is not first exercised on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_benchmark_runs_on_the_cpu_at_a_tiny_shape(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--precision", "bf16"]
    cmd += ["--rounds", "1", "--only", "floor,floor_low", "--work", str(tmp_path / "w"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["shape"] == "tiny" and res["device"] == "cpu" and res["precision"] == "bf16"
    (fp32,), (bf16,) = res["runs"]["floor"], res["runs"]["floor_low"]
    assert fp32["rc"] == bf16["rc"] == 0
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    assert 0 < abs(bf16["nll"] - fp32["nll"]) < 1e-2 * fp32["nll"]  # the same canary, bf16 experts
    ratio = res["compute_med_ratios"]["floor_low/floor"]
    assert ratio == round(bf16["compute_s"] / fp32["compute_s"], 3)
    assert "floor_low/floor" in p.stdout
