"""Where a replay's time goes: one run under cProfile (the host: reads, hashing, Python), one plain
(the figure), one under torch.profiler (kernels, copies, syncs), on the device named.

    python benchmarks/profile_replay.py CKPT CANARY OUTDIR [--device cuda] [--no-plan]

Writes OUTDIR/cprofile.txt (cumulative and self time), OUTDIR/ops.txt (operators by device time, by
host time, by count), OUTDIR/trace.json.gz (a Chrome trace) and OUTDIR/rates.json (TFLOP/s of the
matrix products, their profiled FLOPs over their own time, and of the whole replay, its metered
FLOPs over a plain replay's time: the figures docs/scaling.md asks for). ``--no-plan`` leaves the host plan
of an accelerator replay unset (replay/hostplan.py), the weight path's A/B. docs/benchmarks.md §11
reads these files from an H200.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("canary")
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-plan", action="store_true")
    a = ap.parse_args()
    t0 = time.perf_counter()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import moeaudit.cli  # noqa: F401  the process settings the command line makes
    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.replay import replay
    from moeaudit.replay.hostplan import plan_host_copies

    dev = None if a.device == "cpu" else a.device
    cuda = a.device.startswith("cuda")
    if not a.no_plan:
        plan_host_copies(dev)  # as the CLI does for --device, before anything is hashed

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    ckpt, probe = Checkpoint(a.ckpt), canary_mod.load(a.canary)
    _ = ckpt.digest
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"setup {time.perf_counter() - t0:.2f} s", flush=True)
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    replay(ckpt, probe.tokens, device=dev)
    sync()
    pr.disable()
    print(f"replay under cProfile {time.perf_counter() - t:.2f} s", flush=True)
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(50)
    (a.out / "cprofile.txt").write_text(s.getvalue())
    t = time.perf_counter()
    res = replay(ckpt, probe.tokens, device=dev)
    sync()
    print(f"replay {time.perf_counter() - t:.2f} s, nll {res.nll:.6f}", flush=True)
    plain_s = time.perf_counter() - t
    from moeaudit.receipts.compute import metered

    with metered(a.device if cuda else None) as m:  # the replay's FLOPs, as certify signs them
        replay(ckpt, probe.tokens, device=dev)
        sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_flops=True) as p:
        t = time.perf_counter()
        replay(ckpt, probe.tokens, device=dev)
        sync()
    print(f"replay under torch.profiler {time.perf_counter() - t:.2f} s", flush=True)
    ka = p.key_averages()
    by_device = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    tables = [ka.table(sort_by=k, row_limit=45) for k in (by_device, "self_cpu_time_total", "count")]
    (a.out / "ops.txt").write_text("\n\n".join(tables))
    trace = a.out / "trace.json"
    p.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(a.out / "trace.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    # the rates docs/scaling.md asks for: the matrix products' (their FLOPs over their own device
    # time, from the profiler) and the whole replay's (its metered FLOPs over the plain replay's time)
    products = [e for e in ka if e.key in PRODUCTS]
    product_flops = sum(e.flops for e in products)
    product_s = sum((e.self_device_time_total if cuda else e.self_cpu_time_total) for e in products) / 1e6
    rates = {
        "device": a.device,
        "replay_flops": m.flops,
        "replay_s": round(plain_s, 4),
        "replay_tflops_per_s": round(m.flops / plain_s / 1e12, 3),
        "product_flops": product_flops,
        "product_s": round(product_s, 4),
        "product_tflops_per_s": round(product_flops / product_s / 1e12, 3) if product_s else None,
    }
    (a.out / "rates.json").write_text(json.dumps(rates, indent=1))
    print(f"rates {json.dumps(rates)}", flush=True)
    if cuda:
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 1e9:.2f} GB", flush=True)


# the matrix-product operators the profiler counts FLOPs for (torch.profiler's with_flops)
PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"}


if __name__ == "__main__":
    main()
