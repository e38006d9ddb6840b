"""Scaling exponents of the receipts replay, one input dimension at a time (docs/benchmarks.md §5).

    python benchmarks/scaling.py                    # every axis (≈ 8 min on 2 busy cores; --legacy adds ≈ 3 min)
    python benchmarks/scaling.py --only domains --legacy   # + the pre-issue-24 pairwise JS
    python benchmarks/scaling.py --quick            # small sizes, to check the script itself

Every input is built here from a seed in a temporary directory (``benchmarks/build.py``: tiny
float32 mixtral-layout checkpoints, random canaries). Each point is timed in this process: one
warm-up, then the median of ``--repeats`` runs of ``state_receipts`` (the checkpoint's digest
is computed before the clock starts), or of a whole ``audit_run`` (certify without signing or
writing) for the checkpoints axis. One thread count (``--threads``) and one
``OMP_WAIT_POLICY`` (set here before torch is imported) hold for every point, so both sides
of every ratio see the same environment. Per axis the exponent b of t ≈ a·n^b is fitted by
least squares on log t against log n, over all sizes and over the largest three (the tail,
where a fixed per-run cost no longer hides a superlinear term); the target is b ≤ 1.1 for both.

Axes (the others held at the base): canary tokens (windows of fixed length), layers, experts
(top-2), domains (fixed 1000 windows × 8 tokens, domain id = window mod D), checkpoints (a run
of n checkpoints). ``window_len`` is printed too but is not held to the target: causal
attention is O(T²) per window by construction (T is capped by ``limits.check_window_len``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from build import Arch, write_checkpoint  # noqa: E402

from moeaudit import canary as canary_mod  # noqa: E402
from moeaudit.certify import audit_run  # noqa: E402
from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.policy import Policy  # noqa: E402
from moeaudit.receipts import observer as observer_mod  # noqa: E402
from moeaudit.receipts.occupancy import js_divergence  # noqa: E402
from moeaudit.receipts.state import state_receipts  # noqa: E402

BASE = Arch(vocab=512, hidden=64, layers=2, experts=8, top_k=2, inter=128, heads=4, kv_heads=2)
TARGET = 1.1


@dataclass(frozen=True)
class Point:
    arch: Arch
    windows: int = 64
    length: int = 32
    domains: int = 4
    checkpoints: int = 0  # 0: one state_receipts; n ≥ 1: audit_run over a run of n checkpoints


AXES: dict[str, tuple[str, list[int], Callable[[Point, int], Point]]] = {
    "tokens": ("canary tokens (windows × 32)", [32, 64, 128, 256], lambda p, n: replace(p, windows=n)),
    "window_len": ("window length (64 windows)", [16, 32, 64, 128], lambda p, n: replace(p, length=n)),
    "layers": ("routed layers", [2, 4, 8, 16], lambda p, n: replace(p, arch=replace(p.arch, layers=n))),
    "experts": ("experts (top-2)", [8, 16, 32, 64], lambda p, n: replace(p, arch=replace(p.arch, experts=n))),
    "domains": (
        "canary domains (1000 × 8 tokens)",
        [1, 10, 100, 200, 400, 1000],
        lambda p, n: replace(p, windows=1000, length=8, domains=n),
    ),
    "checkpoints": ("checkpoints in the run (certify)", [4, 8, 16, 32], lambda p, n: replace(p, checkpoints=n)),
}
UNTARGETED = {"window_len"}
QUICK = {
    "tokens": [32, 64],
    "window_len": [16, 32],
    "layers": [2, 4],
    "experts": [8, 16],
    "domains": [1, 100, 400],
    "checkpoints": [2, 4],
}


class Inputs:
    """Checkpoints and canaries under one temporary directory, each built once."""

    def __init__(self, root: Path) -> None:
        self.root, self.made = root, set[str]()

    def checkpoint(self, arch: Arch, seed: int = 0) -> Path:
        path = self.root / f"ckpt-{arch.layers}-{arch.experts}-{seed}"
        if path.name not in self.made:
            write_checkpoint(path, arch, dtype=torch.float32, seed=seed)
            self.made.add(path.name)
        return path

    def run(self, arch: Arch, n: int) -> Path:
        path = self.root / f"run-{arch.layers}-{arch.experts}-{n}"
        path.mkdir(exist_ok=True)
        for i in range(n):
            link = path / f"checkpoint-{100 * (i + 1)}"
            if not link.exists():
                link.symlink_to(self.checkpoint(arch, seed=i), target_is_directory=True)
        return path


def make_canary(p: Point) -> canary_mod.Canary:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, p.arch.vocab, (p.windows, p.length), generator=gen).int()
    ids = (torch.arange(p.windows) % p.domains).int()
    return canary_mod.Canary(tokens, ids, tuple(f"d{i}" for i in range(p.domains)))


def timer(p: Point, inputs: Inputs) -> Callable[[], float]:
    canary = make_canary(p)
    if p.checkpoints:
        run, policy = inputs.run(p.arch, p.checkpoints), Policy()

        def certify() -> float:
            start = time.perf_counter()
            audit_run(run, canary, policy)
            return time.perf_counter() - start

        return certify
    ckpt = Checkpoint(inputs.checkpoint(p.arch))
    _ = ckpt.digest  # hashing is part of a run, not of the replay

    def receipts() -> float:
        start = time.perf_counter()
        state_receipts(ckpt, canary)
        return time.perf_counter() - start

    return receipts


def measure(run: Callable[[], float], repeats: int, warmup: bool = True) -> tuple[float, list[float]]:
    if warmup:
        run()
    times = [run() for _ in range(repeats)]
    return statistics.median(times), times


def exponent(ns: list[int], ts: list[float]) -> float:
    """Least-squares slope of log t on log n."""
    xs, ys = [math.log(n) for n in ns], [math.log(t) for t in ts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def legacy_domain_routing(
    topk_NK: torch.Tensor, domain_ids_W: torch.Tensor, domains: tuple[str, ...], E: int
) -> dict[str, Any]:
    """``occupancy.domain_routing`` before commit 0fcc3c9: a mask per domain and one
    ``js_divergence`` call per ordered pair of domains."""
    N, K = topk_NK.shape
    dom_N = domain_ids_W.repeat_interleave(N // domain_ids_W.shape[0])
    present = [d for d in range(len(domains)) if bool((domain_ids_W == d).any())]
    pi, load = {}, {}
    for d in present:
        sel = topk_NK[dom_N == d]
        counts = torch.bincount(sel.reshape(-1), minlength=E).double()
        pi[domains[d]] = (counts / sel.shape[0]).tolist()
        load[domains[d]] = counts / (K * sel.shape[0])
    names = [domains[d] for d in present]
    js = [[float(js_divergence(load[a], load[b])) for b in names] for a in names]
    return {"domains": names, "pi": pi, "js": js}


@contextmanager
def legacy_domains() -> Iterator[None]:
    current = observer_mod.domain_routing
    observer_mod.domain_routing = legacy_domain_routing  # type: ignore[assignment]
    try:
        yield
    finally:
        observer_mod.domain_routing = current


def sweep(
    axis: str,
    sizes: list[int],
    inputs: Inputs,
    repeats: int,
    say: Callable[[str], None],
    legacy: bool = False,
    legacy_repeats: int = 1,
) -> dict[str, Any]:
    label, _, vary = AXES[axis]
    rows = []
    for n in sizes:
        row: dict[str, Any] = {"n": n}
        row["median_s"], row["times_s"] = measure(timer(vary(Point(BASE), n), inputs), repeats)
        if legacy:
            with legacy_domains():
                row["legacy_s"], _ = measure(timer(vary(Point(BASE), n), inputs), legacy_repeats, warmup=False)
        old = f"   legacy {row['legacy_s']:.3f} s" if legacy else ""
        say(f"  {axis} = {n:>5}: {row['median_s']:.3f} s{old}")
        rows.append(row)
    result = {"axis": axis, "label": label, "rows": rows, "targeted": axis not in UNTARGETED}
    for prefix, key in [("", "median_s")] + ([("legacy_", "legacy_s")] if legacy else []):
        ts = [r[key] for r in rows]
        result[prefix + "exponent"] = exponent(sizes, ts)
        result[prefix + "tail_exponent"] = exponent(sizes[-3:], ts[-3:])
    return result


def worst(r: dict[str, Any], prefix: str = "") -> float:
    return max(r[prefix + "exponent"], r[prefix + "tail_exponent"])


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def report(results: list[dict[str, Any]]) -> str:
    lines = [f"{'axis':<12} {'exponent':>8} {'tail':>6}  target  times (median s)"]
    for r in results:
        ok = "—" if not r["targeted"] else "ok" if worst(r) <= TARGET else "MISSED"
        times = "  ".join(f"{row['n']}: {row['median_s']:.3f}" for row in r["rows"])
        lines.append(f"{r['axis']:<12} {r['exponent']:>8.2f} {r['tail_exponent']:>6.2f}  {ok:<6}  {times}")
        if "legacy_exponent" in r:
            old = "  ".join(f"{row['n']}: {row['legacy_s']:.3f}" for row in r["rows"])
            lines.append(
                f"{'  (legacy)':<12} {r['legacy_exponent']:>8.2f} {r['legacy_tail_exponent']:>6.2f}  {'':<6}  {old}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(AXES), help="comma-separated axes: " + ", ".join(AXES))
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point after one warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every point")
    ap.add_argument(
        "--legacy",
        action="store_true",
        help="on the domains axis, also time the pre-issue-24 pairwise JS (one run, no warm-up)",
    )
    ap.add_argument("--quick", action="store_true", help="two or three small sizes per axis")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment()
    print(json.dumps(env))
    results = []
    with tempfile.TemporaryDirectory(prefix="moeaudit-scaling-") as tmp:
        inputs = Inputs(Path(tmp))
        for axis in args.only.split(","):
            sizes = QUICK[axis] if args.quick else AXES[axis][1]
            print(f"{axis}: {AXES[axis][0]}", flush=True)
            results.append(
                sweep(
                    axis,
                    sizes,
                    inputs,
                    args.repeats,
                    lambda m: print(m, flush=True),
                    legacy=args.legacy and axis == "domains",
                )
            )
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": results}, indent=1) + "\n")
    missed = [r["axis"] for r in results if r["targeted"] and worst(r) > TARGET]
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
