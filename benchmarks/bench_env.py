"""Run a benchmark contender and report the environment it actually computed in.

``python bench_env.py -m moeaudit receipts …`` or ``python bench_env.py script.py …``: the target
runs as ``__main__`` (``runpy``) in this process, and at exit one line ``BENCH_ENV {json}`` gives
what the harness must hold equal across the contenders of a ratio — the OpenMP wait policy and
thread count the process ended with (a contender may set them for itself: the moeaudit CLI sets
``OMP_WAIT_POLICY=PASSIVE`` unless the caller set it), torch's intra-op threads and default
dtype. ``run.py`` refuses a ratio whose contenders report different environments.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys


def _report() -> None:
    torch = sys.modules.get("torch")
    env = {
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset: libgomp spins)"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "(unset)"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "(unset)"),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "torch_default_dtype": str(torch.get_default_dtype()) if torch is not None else None,
    }
    print("BENCH_ENV " + json.dumps(env, sort_keys=True), flush=True)


def main() -> None:
    atexit.register(_report)
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = args[0], args[1:]
        sys.argv = [script, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
