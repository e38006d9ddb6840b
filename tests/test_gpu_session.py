"""benchmarks/gpu_session.sh, the one run a session lent a GPU spends its device time on, dry-run on
the CPU (``DEV=cpu``, the tiny benchmark shape, the sample checkpoints for the FLOP meter): every
stage starts, runs and leaves its figures where the lead will read them, so a broken argument or
a missing file shows here, not after minutes of device time."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("stage 1", "stage 2", "stage 3:", "stage 3b", "stage 3c", "stage 4", "done")


def test_the_gpu_session_runs_every_stage_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "DEV": "cpu",
        "SHAPE": "tiny",
        "METER": "sample",
        "ROUNDS": "1",
        "OUT": str(out),
        "WORK": str(tmp_path / "w"),
        "OMP_NUM_THREADS": "1",
    }
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_session.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-3000:]
    at = [log.find(f"] {s}") for s in STAGES]
    assert all(i >= 0 for i in at) and at == sorted(at), log[-3000:]  # each stage, in order
    assert "torch" in (out / "env.txt").read_text()
    assert " passed" in (out / "stage1.log").read_text()  # collected and ran (CUDA ones skip here)
    for run in ("healthy", "deepseek"):  # certified on both arms: the sample's verdict on each
        for arm in ("dev", "cpu"):
            envelope = json.loads((tmp_path / "w" / f"{run}-{arm}" / "certificate.json").read_text())
            assert json.loads(base64.b64decode(envelope["payload"]))["predicate"]["verdict"] == "PASS"
    bench = json.loads((out / "gpu_bench.json").read_text())
    assert bench["device"] == "cpu" and bench["shape"] == "tiny"
    wanted = {"cli", "cli_low", "floor", "floor_low", "floor_cap", "hf_fp32", "hf_bf16"}
    assert set(bench["runs"]) == wanted and all(r["rc"] == 0 for runs in bench["runs"].values() for r in runs)
    rates = json.loads((out / "rates.json").read_text())
    assert rates["device"] == "cpu" and rates["replay_flops"] > 0 and rates["product_tflops_per_s"] > 0
    assert (out / "trace.json.gz").stat().st_size > 0 and (out / "ops.txt").stat().st_size > 0
    meter = [json.loads(line) for line in (out / "flop_meter.log").read_text().splitlines() if line.startswith("{")]
    assert meter[0]["device"] == "cpu" and any("ratio_once" in m for m in meter[1:])
    assert "skipped on cpu" in (out / "callback.log").read_text()
