"""Peak memory and time of the envelope over a long ``metrics.jsonl`` (docs/benchmarks.md §10).

Two measurements per size, each in a fresh process, on the log ``metrics_memory.py`` writes
(what the training hook writes for an 8-layer × 8-expert run, one line a step):

* ``envelope``: ``moeaudit envelope LOG --json OUT`` as the command line runs it (read the log,
  build the series, check every series, the level rules, write the report);
* ``certify``: the envelope part of ``certify`` — the log read once and hashed
  (``read_metrics``), ``series.envelope_evidence`` over the run's window (first to last
  logged step) under the built-in policy (``evidence_peak_above_base_mib``: the peak until
  then), and the report serialised as certify writes it (``jsonio.dumps``).

Peak = ``ru_maxrss`` above the process's RSS once moeaudit (and the command line) is imported.
Each child runs in the directory the script was started from (``python -c`` puts it first on
``sys.path``); it reports which moeaudit it imported and whether numpy was loaded.

    PYTHONPATH=. OMP_NUM_THREADS=1 python3 benchmarks/envelope_memory.py --dir W --lines 100000 250000 500000 1000000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from metrics_memory import write_log

CHILD = r"""
import json, os, resource, sys, time
from types import SimpleNamespace
import moeaudit
from moeaudit.cli import cli
from moeaudit.jsonio import dumps, finite_document
from moeaudit.metrics import read_metrics
from moeaudit.policy import load_policy
from moeaudit.series import envelope_evidence
import moeaudit.judge.envelope, moeaudit.judge.envelope_columns

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

mode, log, out = sys.argv[1:4]
base = rss_kib()
t0 = time.perf_counter()
if mode == "envelope":
    try:
        cli.main(["envelope", log, "--json", out, "--force"], prog_name="moeaudit", standalone_mode=False)
    except SystemExit as exc:
        assert exc.code in (0, 1, None), exc.code
    report = json.loads(open(out).read())
else:
    series = read_metrics(log)
    logs = SimpleNamespace(metrics=log, probe=None, parsed={"metrics": series})
    policy = load_policy(None)
    report, why = envelope_evidence(logs, {}, policy, "pretrain", None, start=series.steps[0] - 1, end=series.steps[-1])
    assert why is None, why
    evidence_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # before serialising
    with open(out, "w") as f:
        f.write(dumps(finite_document(report)))
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
shown = report.get("shown", {}).get("pooled", {}).get("samples", {})
evidence = (evidence_peak - base) / 1024 if mode == "certify" else None
print(json.dumps({"mode": mode, "seconds": dt, "peak_above_base_mib": (peak - base) / 1024,
                  "evidence_peak_above_base_mib": evidence,
                  "base_mib": base / 1024, "compliant": report["compliant"],
                  "evaluated": shown.get("evaluated"), "shown": shown.get("shown"),
                  "report_bytes": os.path.getsize(out), "numpy": "numpy" in sys.modules,
                  "moeaudit": moeaudit.__file__}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, nargs="+", default=[100_000, 250_000, 500_000, 1_000_000])
    parser.add_argument("--modes", nargs="+", default=["envelope", "certify"], choices=["envelope", "certify"])
    parser.add_argument(
        "--dir", type=Path, default=None, help="keep the logs here and reuse them (default: a temp dir)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.dir or Path(tmp)
        for n in args.lines:
            log = where / f"metrics-{n}.jsonl"
            if not log.is_file():
                write_log(log.with_suffix(".part"), n)
                log.with_suffix(".part").rename(log)
            for mode in args.modes:
                report = Path(tmp) / f"{mode}-{n}.json"
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, mode, str(log), str(report)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row = {"lines": n, **json.loads(out.stdout.strip().splitlines()[-1])}
                row["us_per_line"] = 1e6 * row["seconds"] / n
                row["bytes_per_line_peak"] = row["peak_above_base_mib"] * 2**20 / n
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
