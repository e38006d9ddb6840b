"""Two trees' envelope over long logs, as whole processes, alternating A B A B (docs/benchmarks.md §10).

Each run is a fresh ``python3 -c`` child under ``/usr/bin/time -v`` (its peak RSS), started with its
cwd in its own tree and ``PYTHONPATH`` = that tree (``python -c`` puts the cwd first on ``sys.path``:
started elsewhere, both arms could import the same checkout); a child that imported moeaudit from
anywhere else is refused. Two modes:

* ``envelope``: ``moeaudit envelope LOG --json OUT`` as the command line runs it;
* ``certify``: the envelope part of certify, as a certify served from the cache runs it (no torch,
  no numpy loaded before it): ``read_metrics`` (hashed), ``series.envelope_evidence`` over the
  log, the report serialised by ``jsonio.dumps``.

Printed per run: seconds inside the child, wall and CPU (user + system) seconds and peak RSS of
the whole process, the SHA-256 of what it wrote (the report; for ``envelope`` also its terminal
output) and whether numpy was loaded; then per mode and log the medians and the per-round ratios
B/A. Any digest that differs between the arms is reported (and the exit status is 1).

    OMP_NUM_THREADS=1 python3 benchmarks/envelope_ab.py --a /tmp/base --b . \\
        --logs /work/logs/healthy-20000.jsonl /work/logs/healthy-100000.jsonl --rounds 3

``--loop`` keeps the level rule's loop in both arms (the budgets for importing numpy set to 0), so
the ratio is what computing V once a sample saves alone.

``--stress PATH --lines N`` writes a long 4-layer × 8-expert log whose rules fire (a starved
expert, a dead one, alert runs of tiny norms, null norms and all-zero layer rows) and exits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path

CHILD = r"""
import hashlib, io, json, os, sys, time
from contextlib import redirect_stdout
import moeaudit
mode, log, out, loop = sys.argv[1:5]
if loop == "loop":  # no numpy for the level rule in either arm: what V once a sample saves alone
    import moeaudit.judge.envelope_columns as columns
    columns.ENVELOPE_NUMPY_ROWS = columns.CERTIFY_NUMPY_ROWS = 0
t0 = time.perf_counter()
if mode == "envelope":
    from moeaudit.cli import cli
    text = io.StringIO()
    with redirect_stdout(text):
        try:
            cli.main(["envelope", log, "--json", out, "--force"], prog_name="moeaudit", standalone_mode=False)
        except SystemExit as exc:
            assert exc.code in (0, 1, 3, None), exc.code
    printed = hashlib.sha256(text.getvalue().encode()).hexdigest()
else:
    from types import SimpleNamespace
    from moeaudit.jsonio import dumps, finite_document
    from moeaudit.metrics import read_metrics
    from moeaudit.policy import load_policy
    from moeaudit.series import envelope_evidence
    series = read_metrics(log)
    logs = SimpleNamespace(metrics=log, probe=None, parsed={"metrics": series})
    report, why = envelope_evidence(
        logs, {}, load_policy(None), "pretrain", None, start=series.steps[0] - 1, end=series.steps[-1]
    )
    assert why is None, why
    with open(out, "w") as f:
        f.write(dumps(finite_document(report)))
    printed = None
seconds = time.perf_counter() - t0
with open(out, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
print(json.dumps({"moeaudit": moeaudit.__file__, "seconds": seconds, "report": digest, "printed": printed,
                  "numpy": "numpy" in sys.modules}))
"""


def run_arm(tree: Path, mode: str, log: Path, out: Path, loop: bool = False) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        ["/usr/bin/time", "-v", sys.executable, "-c", CHILD, mode, str(log), str(out), "loop" if loop else "-"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if not str(row["moeaudit"]).startswith(str(tree.resolve()) + os.sep):
        raise SystemExit(f"{tree}: the child imported {row['moeaudit']}, not this tree's moeaudit")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", done.stderr)
    user = re.search(r"User time \(seconds\): ([\d.]+)", done.stderr)
    system = re.search(r"System time \(seconds\): ([\d.]+)", done.stderr)
    assert rss and wall and user and system, done.stderr
    h, m, s = wall.groups()
    row["wall"] = int(h or 0) * 3600 + int(m) * 60 + float(s)
    row["cpu"] = float(user.group(1)) + float(system.group(1))  # less moved by other processes' load
    row["peak_mib"] = int(rss.group(1)) / 1024
    return row


def write_stress(path: Path, lines: int, seed: int = 0) -> None:
    """A long log whose rules fire: layer 0's expert 3 starved for stretches, layer 1's expert 5
    dead from step 3000 on, layer 2 every norm under 1e-4 (alert runs) for stretches, null norms
    and all-zero rows of layer 3; float32 values, as the hook writes them."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for step in range(1, lines + 1):
            norms = {str(k): [rng.uniform(1e-3, 3e-3) for _ in range(8)] for k in range(4)}
            if (step // 700) % 3 == 1:
                norms["0"][3] = rng.uniform(0.0, 2e-5)  # share ≈ 0.01 and below: starved stretches
            if step > 3000:
                norms["1"][5] = rng.uniform(0.0, 9e-7)  # dead
            if (step // 400) % 4 == 2:
                norms["2"] = [rng.uniform(0.0, 9e-5) for _ in range(8)]  # max < a, V > b: alerts
            if rng.random() < 0.002:
                norms["3"][rng.randrange(8)] = None  # a non-finite norm, written null
            elif rng.random() < 0.002:
                norms["3"] = [0.0] * 8  # an all-zero layer row (no share, no normalized V)
            typed = {k: [None if g is None else float(array("f", [g])[0]) for g in v] for k, v in norms.items()}
            f.write(json.dumps({"step": step, "loss": 3.0, "expert_grad_norms": typed}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, help="tree A (the baseline: a git worktree at the base commit)")
    parser.add_argument("--b", type=Path, help="tree B (the change)")
    parser.add_argument("--logs", type=Path, nargs="+", default=[])
    parser.add_argument("--modes", nargs="+", default=["envelope", "certify"], choices=["envelope", "certify"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--loop", action="store_true", help="keep the level rule's loop in both arms (no numpy import for it)"
    )
    parser.add_argument("--stress", type=Path, help="write a stress log here and exit")
    parser.add_argument("--lines", type=int, default=20_000)
    args = parser.parse_args()
    if args.stress:
        write_stress(args.stress, args.lines)
        return
    if not (args.a and args.b and args.logs):
        parser.error("--a, --b and --logs are needed")
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    differ = False
    with tempfile.TemporaryDirectory() as tmp:
        for log in args.logs:
            for mode in args.modes:
                rows: dict[str, list[dict[str, object]]] = {"A": [], "B": []}
                for r in range(args.rounds):
                    for arm, tree in trees.items():
                        row = run_arm(tree, mode, log, Path(tmp) / f"{arm}.json", args.loop)
                        rows[arm].append(row)
                        print(
                            json.dumps({"log": str(log), "mode": mode, "round": r + 1, "arm": arm, **row}), flush=True
                        )
                a, b = rows["A"], rows["B"]
                same = {(x["report"], x["printed"]) for x in a + b}
                differ |= len(same) != 1
                ratios = [float(y["wall"]) / float(x["wall"]) for x, y in zip(a, b)]  # type: ignore[arg-type]
                cpu = [float(y["cpu"]) / float(x["cpu"]) for x, y in zip(a, b)]  # type: ignore[arg-type]
                summary = {
                    "log": log.name,
                    "mode": mode,
                    "wall_median": {k: statistics.median(float(x["wall"]) for x in v) for k, v in rows.items()},  # type: ignore[arg-type]
                    "seconds_median": {k: statistics.median(float(x["seconds"]) for x in v) for k, v in rows.items()},  # type: ignore[arg-type]
                    "ratio_median": statistics.median(ratios),
                    "ratios": [round(x, 3) for x in ratios],
                    "cpu_median": {k: statistics.median(float(x["cpu"]) for x in v) for k, v in rows.items()},  # type: ignore[arg-type]
                    "cpu_ratio_median": statistics.median(cpu),
                    "cpu_ratios": [round(x, 3) for x in cpu],
                    "peak_mib_median": {k: statistics.median(float(x["peak_mib"]) for x in v) for k, v in rows.items()},  # type: ignore[arg-type]
                    "numpy": {k: sorted({bool(x["numpy"]) for x in v}) for k, v in rows.items()},
                    "identical": len(same) == 1,
                    "digest": hashlib.sha256(repr(sorted(same)).encode()).hexdigest()[:16],
                }
                print("SUMMARY " + json.dumps(summary), flush=True)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
