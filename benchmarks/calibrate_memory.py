"""Peak memory and time of calibrate's envelope fit over a long ``metrics.jsonl`` (docs/benchmarks.md §10).

The fit is what ``moeaudit calibrate`` does with a healthy run's log once its checkpoints are
certified: the tightest falsifiable envelope at the finest sampling that admits one (V of every
series, ε = c·Var_t[V] for c in [2, 5], δ* by bisection, both starved copies evaluated, the
starvation share's quantile) — ``moeaudit.calibrate._fit_envelope``. Each size runs in a fresh
process; the log is a healthy-looking 8-layer × 8-expert one (every norm a slow oscillation, as
float32), so the fit succeeds at the native sampling. Peak = ``ru_maxrss`` above the process's RSS
once moeaudit is imported.

``--baseline REF`` runs the same child on a git worktree of commit REF too, alternating, and
prints the ratios (this checkout / REF): both in this environment, one OMP thread.

    OMP_NUM_THREADS=1 python3 benchmarks/calibrate_memory.py --dir W --lines 20000 100000 --baseline 8d8d6e4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = EXPERTS = 8

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
import moeaudit.calibrate as cal
from moeaudit.judge import envelope as env
from moeaudit.metrics import read_metrics
from moeaudit.policy import Policy
log = Path(sys.argv[1])
base = rss_mib()
t0 = time.perf_counter()
series = env.from_metrics(read_metrics(log), "normalized")
t1 = time.perf_counter()
settings, _, check = cal._fit_envelope(series, Policy(), "normalized", [], log, since=0, stage="pretraining", model="m")
t2 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"module": cal.__file__, "read_s": t1 - t0, "fit_s": t2 - t1, "peak_above_base_mib": peak - base,
                  "epsilon": settings.epsilon, "delta": settings.delta, "at_step": check["at_step"]}))
"""


def write_log(path: Path, lines: int, seed: int = 0, period: float = 5000.0) -> None:
    rng = random.Random(seed)
    base = [[rng.uniform(1e-3, 3e-3) for _ in range(EXPERTS)] for _ in range(LAYERS)]
    phase = [[rng.uniform(0, 2 * math.pi) for _ in range(EXPERTS)] for _ in range(LAYERS)]
    with path.open("w") as f:
        for step in range(1, lines + 1):
            norms = {
                str(k): array(
                    "f",
                    [
                        base[k][e] * (1 + 0.3 * math.sin(2 * math.pi * step / period + phase[k][e]))
                        for e in range(EXPERTS)
                    ],
                ).tolist()
                for k in range(LAYERS)
            }
            f.write(json.dumps({"step": step, "loss": 3.0, "expert_grad_norms": norms}) + "\n")


def measure(code: Path, log: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # `python -c` puts the working directory first on sys.path, before PYTHONPATH: run in `code`
    # so that each arm imports its own moeaudit, wherever the script is started from
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(log)], capture_output=True, text=True, check=True, env=env, cwd=code
    )
    row = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if not Path(row.pop("module")).resolve().is_relative_to(Path(code).resolve()):
        raise SystemExit(f"the arm at {code} imported moeaudit from elsewhere")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, nargs="+", default=[20_000, 100_000])
    ap.add_argument("--dir", type=Path, default=None, help="keep the logs here and reuse them")
    ap.add_argument("--baseline", default=None, help="a commit to compare with (a temporary git worktree)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.dir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        arms = {"this": ROOT}
        if args.baseline:
            wt = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), args.baseline], check=True)
            arms["baseline"] = wt
        try:
            for n in args.lines:
                log = where / f"healthy-{n}.jsonl"
                if not log.is_file():
                    write_log(log.with_suffix(".part"), n)
                    log.with_suffix(".part").rename(log)
                rows = {name: measure(code, log) for name, code in arms.items()}
                row: dict[str, object] = {"lines": n, **rows}
                if "baseline" in rows:
                    a, b = rows["this"], rows["baseline"]
                    row["same_fit"] = all(a[k] == b[k] for k in ("epsilon", "delta", "at_step"))
                    row["ratio_fit_s"] = a["fit_s"] / b["fit_s"]
                    row["ratio_peak"] = a["peak_above_base_mib"] / b["peak_above_base_mib"]
                print(json.dumps(row), flush=True)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False)


if __name__ == "__main__":
    main()
