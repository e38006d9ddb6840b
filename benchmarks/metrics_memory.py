"""Peak memory and time of reading a long ``metrics.jsonl`` (docs/benchmarks.md §9).

What certify does with the log before the replays: one streamed read that hashes the bytes it
parses (``moeaudit.metrics.read_metrics``), the training-loss means over checkpoint intervals
and the log's reach (``lineage``). Each size is measured in a fresh process: peak RSS
(``ru_maxrss``) above that process's RSS once moeaudit is imported, and wall time.

The synthetic log is what the training hook writes for an 8-layer × 8-expert run: one line a
step, ``loss``, ``lm_loss`` and float32 norms (``Tensor.item()`` of float32 values).

    PYTHONPATH=. OMP_NUM_THREADS=1 python3 benchmarks/metrics_memory.py --lines 250000 500000 1000000
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path

LAYERS, EXPERTS = 8, 8

CHILD = r"""
import json, resource, sys, time
from bisect import bisect_right
from itertools import islice
from moeaudit.metrics import read_metrics

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

base = rss_kib()
t0 = time.perf_counter()
series = read_metrics(sys.argv[1])
steps = series.steps
ckpts = list(range(0, steps[-1] + 1, 500))[1:] or [steps[-1]]
means = []
for lo, hi in zip([-1, *ckpts[:-1]], ckpts):
    a, b = bisect_right(steps, lo), bisect_right(steps, hi)
    picked = [v for v in series.lm_loss[a:b] if v is not None]
    means.append(sum(picked) / len(picked) if picked else None)
reach = (steps[-1], max(b - a for a, b in zip(steps, islice(steps, 1, None))))
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"lines": len(steps), "seconds": dt, "peak_above_base_mib": (peak - base) / 1024,
                  "base_mib": base / 1024, "bytes": series.size,
                  "norm_itemsize": next(iter(series.norms.values())).itemsize}))
"""


def write_log(path: Path, lines: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for step in range(1, lines + 1):
            norms = {
                str(layer): array("f", [rng.uniform(1e-3, 3e-3) for _ in range(EXPERTS)]).tolist()
                for layer in range(LAYERS)
            }
            loss = array("f", [rng.uniform(2, 4)])[0]
            f.write(json.dumps({"step": step, "loss": loss, "lm_loss": loss, "expert_grad_norms": norms}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, nargs="+", default=[250_000, 500_000, 1_000_000])
    parser.add_argument(
        "--dir", type=Path, default=None, help="keep the logs here and reuse them (default: a temp dir)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.dir or Path(tmp)  # --dir: the logs are kept there and reused
        for n in args.lines:
            log = where / f"metrics-{n}.jsonl"
            if not log.is_file():
                write_log(log.with_suffix(".part"), n)
                log.with_suffix(".part").rename(log)
            out = subprocess.run([sys.executable, "-c", CHILD, str(log)], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout)
            row["us_per_line"] = 1e6 * row["seconds"] / n
            row["bytes_per_line_peak"] = row["peak_above_base_mib"] * 2**20 / n
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
