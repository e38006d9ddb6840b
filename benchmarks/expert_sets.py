"""One expert's three sets of rows (routed, overlap candidates, random outside expert) as three
SwiGLU batches, as the replay computes them (``experts_forward_sets``), against one batch of all
their rows: what merging the sets into one GEMM per expert would buy on this CPU.

    python benchmarks/expert_sets.py [--threads 1,2] [--rounds 5]

Shapes: an expert of the speed benchmark's mid and narrow shapes (d 512, expert dimension 1792 /
1024) with the rows one expert gets on their 16 × 256 canary (top-2 of 16: 512 routed rows, 512
candidate rows, 256 random rows). Both sides run in this process, alternating, on the same
inputs and thread count; prints the median time of each and their ratio, and whether the merged
batch gives each row bit for bit what its own batch gives (the replay relies on a set's values
being what it would get alone). docs/benchmarks.md §1 has the result.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"mid": (512, 1792), "narrow": (512, 1024)}
ROWS = (512, 512, 256)  # routed, candidates, random: per expert on a 16 × 256 canary, top-2 of 16


def mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def timed(f, n: int) -> float:  # type: ignore[no-untyped-def]
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20, help="calls per timing")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for name, (d, inter) in SHAPES.items():
        w1, w3 = torch.randn(inter, d, generator=g), torch.randn(inter, d, generator=g)
        w2 = torch.randn(d, inter, generator=g)
        xs = [torch.randn(m, d, generator=g) for m in ROWS]
        merged = torch.cat(xs)
        same = torch.equal(torch.cat([mlp(x, w1, w3, w2) for x in xs]), mlp(merged, w1, w3, w2))
        for threads in map(int, a.threads.split(",")):
            torch.set_num_threads(threads)
            sep, cat = [], []
            for _ in range(a.rounds):  # alternating: a machine whose load moves moves both
                sep.append(timed(lambda: [mlp(x, w1, w3, w2) for x in xs], a.reps))
                cat.append(timed(lambda: mlp(merged, w1, w3, w2), a.reps))
            s, c = statistics.median(sep), statistics.median(cat)
            ratios = sorted(y / x for x, y in zip(sep, cat))
            print(
                f"{name} d={d} inter={inter} rows={ROWS} threads={threads}: three batches {s * 1e3:.2f} ms, "
                f"one batch {c * 1e3:.2f} ms, merged/separate {c / s:.3f} "
                f"(rounds {ratios[0]:.3f}–{ratios[-1]:.3f}); rows bit-identical: {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
