"""The machine's float32 matrix-product rate at the replay's shapes (docs/benchmarks.md §1d).

The replay's routed experts are per-expert products of M gathered tokens × K = hidden × N =
expert dimension, in the forward (x·W1ᵀ, x·W3ᵀ, h·W2ᵀ) and the backward (g·W2, da·W, daᵀ·x);
the LM head is rows × hidden × vocabulary. This prints GFLOP/s for those shapes (best of
``--reps``, torch's intra-op threads as configured) next to a large square product, so the
receipts' FLOP count can be turned into a time the machine cannot beat.

    python benchmarks/gemm_ceiling.py [--hidden 512] [--inter 1792] [--vocab 32000] [--reps 15]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def best(f: Callable[[], object], reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def single_rate(hidden: int, inter: int, rows: int = 512, reps: int = 7) -> float:
    """GFLOP/s of one expert-shaped product (rows × hidden × inter, x·W1ᵀ) on the threads torch
    has: the rate the replay's dominant products cannot beat."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, hidden, generator=gen), torch.randn(inter, hidden, generator=gen)
    return 2 * rows * hidden * inter / best(lambda: F.linear(x, w), reps) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1792)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rate-only", action="store_true", help="print one number: single_rate() at 512 rows (for run.py)")
    a = ap.parse_args()
    if a.rate_only:
        print(f"{single_rate(a.hidden, a.inter, reps=a.reps):.2f}")
        return
    H, inter, V = a.hidden, a.inter, a.vocab
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(inter, H, generator=gen), torch.randn(H, inter, generator=gen)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s, best of {a.reps}")
    print(f"{'M':>6} {'x·W1ᵀ':>8} {'h·W2ᵀ':>8} {'da·W1':>8} {'daᵀ·x':>8} {'gᵀ·h':>8}")
    for M in (256, 512, 1024, 2048, 4096):
        x, h = torch.randn(M, H, generator=gen), torch.randn(M, inter, generator=gen)
        g = torch.randn(M, H, generator=gen)
        flops = 2 * M * H * inter
        rates = [
            flops / best(f, a.reps) / 1e9
            for f in (
                lambda: F.linear(x, w1),
                lambda: F.linear(h, w2),
                lambda: h @ w1,
                lambda: h.T @ x,
                lambda: g.T @ h,
            )
        ]
        print(f"{M:>6} " + " ".join(f"{r:8.1f}" for r in rates))
    head = torch.randn(V, H, generator=gen)
    for R in (262, 1024):
        x, d = torch.randn(R, H, generator=gen), torch.randn(R, V, generator=gen)
        flops = 2 * R * H * V
        print(
            f"LM head, {R} rows: logits {flops / best(lambda: F.linear(x, head), 5) / 1e9:.1f}, "
            f"dL/dx {flops / best(lambda: d @ head, 5) / 1e9:.1f}"
        )
    for n in (1024, 2048):
        p, q = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        print(f"square {n}: {2 * n**3 / best(lambda: p @ q, 5) / 1e9:.1f}")


if __name__ == "__main__":
    main()
