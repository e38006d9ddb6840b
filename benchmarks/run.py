"""moeaudit benchmarks (docs/benchmarks.md): speed against transformers and against our own floor, peak
memory on a large bf16 checkpoint, scaling, and the receipts cache. Not part of the tests.

    python benchmarks/run.py                  # everything (≈ 1 h on 2 busy cores; ~10 GB disk)
    python benchmarks/run.py --only speed     # speed | rss | scaling | cache, comma-separated
    python benchmarks/run.py --quick          # small sizes, to check the script itself

Every input is built here from a seed, in a temporary directory. Each contender runs as a fresh
process (imports, reading weights and writing results included, as a user would see it), and
the contenders of one comparison alternate round by round, so a change of machine load hits
them alike; the ratios are what to read, the raw seconds are given with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import moeaudit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from build import Arch, describe, write_canary, write_checkpoint  # noqa: E402

PY = sys.executable
MID = Arch(vocab=32000, hidden=512, layers=4, experts=16, top_k=2, inter=1792, heads=8, kv_heads=2)
# narrower experts and a small vocabulary: the LM head is cheap, so the per-expert work, the element-wise
# work and the process's fixed costs weigh more than on MID
NARROW = Arch(vocab=4096, hidden=512, layers=4, experts=16, top_k=2, inter=1024, heads=8, kv_heads=2)
# the speed comparison's shapes, each with its canary (windows, tokens per window)
SPEED_SHAPES = {"mid": (MID, (16, 256)), "narrow": (NARROW, (16, 256))}
BIG = Arch(vocab=32000, hidden=1024, layers=32, experts=8, top_k=2, inter=2560, heads=16, kv_heads=4)
CACHE_SMALL = Arch(vocab=8192, hidden=512, layers=4, experts=8, top_k=2, inter=1024, heads=8, kv_heads=2)
SCALE_BASE = Arch(vocab=8192, hidden=256, layers=4, experts=8, top_k=2, inter=768, heads=4, kv_heads=2)


@dataclass
class Run:
    wall: float
    cpu: float  # user + sys of the child
    rss_mb: float  # ru_maxrss
    out: str


ENVS = {
    # libgomp's default made explicit: a thread that reaches a barrier first spins before
    # sleeping. Set for every contender (the moeaudit CLI sets PASSIVE only when it is unset).
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    # Waiting threads sleep at once: on an oversubscribed machine the spinning thread otherwise
    # burns the time slice its partner needs to reach the barrier (see docs/benchmarks.md).
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
ENVS["default"] = ENVS["active"]  # the old name: "default" used to leave it unset, unequal


def base_env(threads: int) -> dict[str, str]:
    """What every contender of every ratio gets, whatever the wait policy: the same thread
    counts, stated rather than left to each library's default."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


WRAP = [PY, str(HERE / "bench_env.py")]


def reported_env(out: str) -> dict[str, object]:
    """The ``BENCH_ENV`` line a contender run under ``bench_env.py`` printed at exit."""
    lines = [ln for ln in out.splitlines() if ln.startswith("BENCH_ENV ")]
    if not lines:
        raise SystemExit(f"a contender printed no BENCH_ENV line:\n{out[-2000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def same_env(runs: dict[str, list[Run]]) -> dict[str, object]:
    """The one environment all contenders computed in; a ratio between unequal environments
    is refused (it would measure the settings, not the code)."""
    seen = {name: reported_env(r.out) for name, rs in runs.items() for r in rs}
    distinct = {json.dumps(e, sort_keys=True) for e in seen.values()}
    if len(distinct) != 1:
        raise SystemExit("contenders ran in different environments: " + "; ".join(f"{n}: {e}" for n, e in seen.items()))
    return next(iter(seen.values()))


def run(cmd: list[str], env: dict[str, str] | None = None) -> Run:
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({status}): {' '.join(cmd)}\n{out[-3000:]}")
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out)


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} CPUs"


def machine() -> dict[str, str]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "ram_gb": f"{_mem_total_gb():.1f}",
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
        "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_", "GOMP_"))},
        "python": platform.python_version(),
        "moeaudit_commit": _commit(),
        "load_before": load_note(),
    }


def _mem_total_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def _commit() -> str:
    """The moeaudit commit measured (``BENCH_COMMIT`` when running from an exported tree)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def alternate(
    contenders: dict[str, list[str]], rounds: int, env: dict[str, str], warmup: int = 1
) -> dict[str, list[Run]]:
    """Run the contenders in turn, ``rounds`` times, rotating the order every round, after
    ``warmup`` uncounted rounds (the page cache then holds the inputs for every contender)."""
    names = list(contenders)
    runs: dict[str, list[Run]] = {n: [] for n in names}
    for _ in range(warmup):
        for name in names:
            run(contenders[name], env)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            runs[name].append(result := run(contenders[name], env))
            print(
                f"  round {r + 1} {name:>13}: {result.wall:7.2f} s wall {result.cpu:7.2f} s cpu "
                f"{result.rss_mb:7.0f} MB   ({load_note()})",
                flush=True,
            )
    return runs


def ratios(runs: dict[str, list[Run]], num: str, den: str) -> dict[str, object]:
    per_round = [a.wall / b.wall for a, b in zip(runs[num], runs[den], strict=True)]
    med = statistics.median(r.wall for r in runs[num]) / statistics.median(r.wall for r in runs[den])
    cpu = statistics.median(r.cpu for r in runs[num]) / statistics.median(r.cpu for r in runs[den])
    return {
        "per_round": [round(x, 3) for x in per_round],
        "median_wall": round(med, 3),
        "median_cpu": round(cpu, 3),
    }


# ----- speed ---------------------------------------------------------------------------------


def speed(
    work: Path, rounds: int, arch: Arch, windows: int, length: int, env_name: str, threads: int, name: str = "mid"
) -> dict[str, object]:
    ckpt, canary = work / name, work / f"{name}-canary.safetensors"
    if not ckpt.exists():
        write_checkpoint(ckpt, arch)
        write_canary(canary, arch.vocab, windows, length)
    out = work / f"{name}-receipts.json"
    # every contender runs under bench_env.py, which reports the environment it computed in
    contenders = {
        "moeaudit": [
            *WRAP,
            "-m",
            "moeaudit",
            "receipts",
            str(ckpt),
            "--canary",
            str(canary),
            "--json",
            str(out),
            "--force",
        ],
        # the same command keeping every layer's expert products for the backward
        # (``replay.stash``; the default keeps them within the stored inputs' size): what more
        # memory buys
        "moeaudit_kept": [
            "env",
            "MOEAUDIT_ACTIVATION_BUDGET=inf",
            *WRAP,
            "-m",
            "moeaudit",
            "receipts",
            str(ckpt),
            "--canary",
            str(canary),
            "--json",
            str(work / f"{name}-receipts-kept.json"),
            "--force",
        ],
        # per-expert gradient norms in float32 (the receipts sum squares in float64): the script's
        # cheapest honest form, so the ratio is the stricter one
        "hf_fp32": [*WRAP, str(HERE / "hf_user.py"), str(ckpt), str(canary), "fp32", "float32"],
        "floor": [*WRAP, str(HERE / "floor.py"), str(ckpt), str(canary)],
        "floor_overlap": [*WRAP, str(HERE / "floor.py"), str(ckpt), str(canary), "--overlap"],
    }
    env = {**base_env(threads), **ENVS[env_name]}
    # bytecode compiled once, for every contender alike (an installed user's machine has it)
    run([PY, "-m", "compileall", "-q", str(Path(moeaudit.__file__).parent), str(HERE)])
    print(f"speed, {name} ({env_name} env {env}): {describe(arch)}, canary {windows}×{length}, float32", flush=True)
    runs = alternate(contenders, rounds, env)
    seen = same_env(runs)
    print(f"  every contender computed in: {seen}", flush=True)
    kept = kept_by_default(runs["floor"][-1].out, arch.layers)
    gflop = {
        "floor": replay_gflop(arch, windows, length, overlap=False, kept=kept),
        "floor_overlap": replay_gflop(arch, windows, length, overlap=True, kept=kept),
        "moeaudit_kept": replay_gflop(arch, windows, length, overlap=True, kept=True),
    }
    gflop["moeaudit"] = gflop["floor_overlap"]
    same = json.loads(Path(out).read_text()) == json.loads((work / f"{name}-receipts-kept.json").read_text())
    # (the whole documents: the environment block names torch, python, device and dtype only)
    print(f"  W1/W3 products kept for every layer by default: {kept}; receipts identical with all kept: {same}")
    ceiling = ceiling_rate(arch, env)
    # per CPU-second: the rate one core achieved over the whole process (imports, reading and
    # hashing included), set against what one core reaches on the experts' product alone
    rates = {n: round(g / statistics.median(r.cpu for r in runs[n]), 1) for n, g in gflop.items()}
    print(
        f"  GFLOP per replay { ({n: round(g, 1) for n, g in gflop.items()}) }; GFLOP per CPU-second "
        f"{rates}; single-thread GEMM ceiling {ceiling:.1f}",
        flush=True,
    )
    return {
        "gflop": gflop,
        "gflop_per_cpu_s": rates,
        "gemm_ceiling_gflops_1thread": round(ceiling, 1),
        "shape": name,
        "arch": describe(arch),
        "canary": [windows, length],
        "env": env,
        "env_reported": seen,
        "dtype": "float32",
        "kept_by_default": kept,
        "receipts_identical_kept": same,
        "runs": {n: [vars(r) | {"out": None} for r in rs] for n, rs in runs.items()},
        **{key: ratios(runs, *key.split("/")) for key in RATIOS},
    }


def kept_by_default(floor_out: str, layers: int) -> bool:
    """Whether the floor's replay kept every layer's W1/W3 products (its own report line)."""
    m = re.search(r"kept W1/W3 products of layers \[(.*)\]", floor_out)
    return m is not None and len([v for v in m.group(1).split(",") if v.strip()]) == layers


def replay_gflop(arch: Arch, windows: int, length: int, overlap: bool, kept: bool = False) -> float:
    """Matrix-product GFLOP of one replay as moeaudit computes it (2 FLOPs a multiply-add):
    the forward; the backward, which recomputes each layer from its stored input (attention,
    router, the experts' W1/W3 products) and forms input and weight gradients; the LM head's
    logits and dL/dx (its weight gradient is never formed). ``overlap``: the receipts' extra
    experts (K' − k next candidates and one random, per token and layer) in the forward.
    ``kept``: the backward reuses the forward's W1/W3 products (``replay.stash``) instead.
    Element-wise work, norms and softmax are left out: this is the floor's arithmetic."""
    N, R = windows * length, windows * (length - 1)
    H, inter, E, k = arch.hidden, arch.inter, arch.experts, arch.top_k
    kv = arch.kv_heads * arch.head_dim
    proj = 2 * N * H * (2 * H + 2 * kv)  # q, k, v, o
    scores = 2 * windows * length * length * H  # QKᵀ and PV over causal windows (half of T²)
    router = 2 * N * H * E
    expert = 2 * N * k * H * inter  # one product over every routed (token, slot)
    extra = (min(E, 2 * k) - k + 1) if overlap and E > k else 0
    fwd = proj + scores + router + 3 * expert + 3 * expert * extra / k
    # backward: recompute (proj + scores + router + W1, W3) + input and weight gradients
    # (2 × proj, 2 × scores, 2 × router) + experts: p = g·W2, dx (2), dW1, dW3, dW2
    bwd = 3 * (proj + scores + router) + (0 if kept else 2 * expert) + 6 * expert
    head = 2 * (2 * R * H * arch.vocab)
    return (arch.layers * (fwd + bwd) + head) / 1e9


def ceiling_rate(arch: Arch, env: dict[str, str]) -> float:
    """The machine's single-thread GFLOP/s at the experts' product shape (gemm_ceiling.py)."""
    r = run(
        [PY, str(HERE / "gemm_ceiling.py"), "--hidden", str(arch.hidden), "--inter", str(arch.inter), "--rate-only"],
        {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    )
    return float(r.out.strip().splitlines()[-1])


RATIOS = (
    "moeaudit/hf_fp32",
    "moeaudit/floor",
    "moeaudit/floor_overlap",
    "floor_overlap/floor",
    "floor/hf_fp32",
    "moeaudit/moeaudit_kept",
)


# ----- peak memory ---------------------------------------------------------------------------


def peak_rss(work: Path, arch: Arch, windows: int, length: int, repeats: int, env: dict[str, str]) -> dict[str, object]:
    ckpt, canary = work / "big", work / "big-canary.safetensors"
    t = time.perf_counter()
    size = write_checkpoint(ckpt, arch)
    built = time.perf_counter() - t
    write_canary(canary, arch.vocab, windows, length)
    print(f"rss: {describe(arch)}: {size / 1e9:.2f} GB written in {built:.0f} s", flush=True)
    results = []
    # the default (kept products within the stored inputs' size, replay.stash) and the leanest
    # replay (none kept), alternating
    budgets = {"default": None, "none kept": "0"}
    for _, (label, budget) in ((i, b) for i in range(repeats) for b in budgets.items()):
        r = run(
            [
                "/usr/bin/time",
                "-v",
                PY,
                "-m",
                "moeaudit",
                "receipts",
                str(ckpt),
                "--canary",
                str(canary),
                "--json",
                str(work / "big-receipts.json"),
                "--force",
            ],
            env if budget is None else {**env, "MOEAUDIT_ACTIVATION_BUDGET": budget},
        )
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.out)
        assert m, r.out[-2000:]
        rss = int(m.group(1)) * 1024
        results.append({"budget": label, "wall": r.wall, "cpu": r.cpu, "max_rss_bytes": rss, "fraction": rss / size})
        print(
            f"  {label}: max RSS {rss / 1e9:.3f} GB = {rss / size:.1%} of {size / 1e9:.2f} GB, {r.wall:.1f} s "
            f"({load_note()})",
            flush=True,
        )
    shutil.rmtree(ckpt)
    return {
        "arch": describe(arch),
        "checkpoint_bytes": size,
        "canary": [windows, length],
        "env": env,
        "runs": results,
    }


# ----- scaling -------------------------------------------------------------------------------


def _point(work: Path, arch: Arch, windows: int, length: int, repeats: int, env: dict[str, str]) -> dict[str, object]:
    tag = f"L{arch.layers}-E{arch.experts}"
    ckpt, canary = work / f"scale-{tag}", work / f"scale-canary-{windows}x{length}.safetensors"
    if not ckpt.exists():
        write_checkpoint(ckpt, arch)
    if not canary.exists():
        write_canary(canary, arch.vocab, windows, length)
    times, walls = [], []
    for _ in range(repeats):
        r = run([PY, str(HERE / "measure.py"), str(ckpt), str(canary)], env)
        times.append(json.loads(r.out.strip().splitlines()[-1])["replay_s"])
        walls.append(r.wall)
    point = {
        "layers": arch.layers,
        "experts": arch.experts,
        "tokens": windows * length,
        "replay_s": round(min(times), 3),
        "process_s": round(min(walls), 3),
        "parameters": arch.parameters(),
    }
    print(f"  {point}  ({load_note()})", flush=True)
    return point


def scaling(
    work: Path, base: Arch, repeats: int, quick: bool, env: dict[str, str]
) -> dict[str, list[dict[str, object]]]:
    T = 256
    windows = [4, 8, 16] if quick else [4, 8, 16, 32]
    layers = [2, 4] if quick else [2, 4, 8, 16]
    experts = [4, 8] if quick else [4, 8, 16, 32]
    print(
        "scaling (min of repeats; replay = in-process receipts time, process = whole run)",
        flush=True,
    )
    return {
        "tokens": [_point(work, base, w, T, repeats, env) for w in windows],
        "layers": [_point(work, replace(base, layers=n), 8, T, repeats, env) for n in layers],
        "experts": [_point(work, replace(base, experts=n), 8, T, repeats, env) for n in experts],
    }


# ----- cache ---------------------------------------------------------------------------------


WARM_SAMPLES = 5


def _replayed(out: str) -> list[str]:
    return [line.split("replaying ", 1)[1].strip() for line in out.splitlines() if "replaying " in line]


def cache(
    work: Path,
    name: str,
    arch: Arch,
    steps: int,
    canary_shape: tuple[int, int],
    rounds: int,
    env: dict[str, str],
) -> dict[str, object]:
    """certify a run twice (cold cache, then warm), then add one checkpoint and certify again."""
    run_dir, out, key = work / f"run-{name}", work / f"certs-{name}", work / "key"
    canary = run_dir / "canary.safetensors"
    for i in range(steps):
        write_checkpoint(run_dir / f"checkpoint-{100 * (i + 1)}", arch, seed=i)
    write_canary(canary, arch.vocab, *canary_shape)
    run([PY, "-m", "moeaudit", "keygen", "--out", str(key), "--force"])
    added_dir = run_dir / f"checkpoint-{100 * (steps + 1)}"
    cmd = [
        PY,
        "-m",
        "moeaudit",
        "certify",
        str(run_dir),
        "--canary",
        str(canary),
        "--out",
        str(out),
        "--key",
        str(key),
        "--force",
    ]
    # A wheel install compiles moeaudit's bytecode (pip does); an editable install writes it on
    # first import, unless PYTHONDONTWRITEBYTECODE is set, as on these VMs, where every run would
    # recompile ~40 modules (~0.1 s). Compile once, as an installed user's machine has it.
    run([PY, "-m", "compileall", "-q", str(Path(moeaudit.__file__).parent)])
    print(f"cache ({name} run: {steps} checkpoints, {describe(arch)}, canary {canary_shape})")
    results = []
    for r in range(rounds):
        env_r = {**env, "MOEAUDIT_CACHE_DIR": str(work / f"cache-{name}-{r}")}
        if added_dir.exists():
            shutil.rmtree(added_dir)
        # a warm run is a few tenths of a second, so one sample is mostly the machine's noise:
        # take the median of WARM_SAMPLES (the cold run is seconds to minutes; one suffices)
        cold = run(cmd, env_r)
        warms = [run(cmd, env_r) for _ in range(WARM_SAMPLES)]
        warm = sorted(warms, key=lambda r: r.wall)[len(warms) // 2]
        write_checkpoint(added_dir, arch, seed=steps)
        added = run(cmd, env_r)
        row = {
            "cold_s": cold.wall,
            "warm_s": warm.wall,
            "warm_samples_s": [round(r.wall, 3) for r in warms],
            "speedup": cold.wall / warm.wall,
            "replays_cold": _replayed(cold.out),
            "replays_warm": sorted({c for r in warms for c in _replayed(r.out)}),  # all must be []
            "added_s": added.wall,
            "replays_added": _replayed(added.out),
        }
        results.append(row)
        print(
            f"  round {r + 1}: cold {cold.wall:.2f} s (replayed {row['replays_cold']}), warm "
            f"{warm.wall:.2f} s median of {row['warm_samples_s']} (replayed {row['replays_warm']}) "
            f"→ {row['speedup']:.1f}×; "
            f"{added_dir.name} added: {added.wall:.2f} s (replayed {row['replays_added']})"
            f"  ({load_note()})",
            flush=True,
        )
    return {
        "arch": describe(arch),
        "checkpoints": steps,
        "canary": list(canary_shape),
        "rounds": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="speed,rss,scaling,cache")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", type=Path, help="keep inputs here instead of a temporary directory")
    ap.add_argument("--json", type=Path, help="also write all results to this file")
    ap.add_argument(
        "--env",
        default="passive,active",
        help="thread wait policies to compare under: passive, active (comma-separated; every "
        "contender of a ratio gets the same one); rss, scaling and cache use the first one",
    )
    ap.add_argument(
        "--shapes",
        default=",".join(SPEED_SHAPES),
        help=f"the speed comparison's shapes, comma-separated: {', '.join(SPEED_SHAPES)}",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="OMP_NUM_THREADS and MKL_NUM_THREADS of every contender",
    )
    args = ap.parse_args()
    only = set(args.only.split(","))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="moeaudit-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {"machine": machine()}
    print(json.dumps(results["machine"]), flush=True)
    envs = args.env.split(",")
    env = {**base_env(args.threads), **ENVS[envs[0]]}
    try:
        if "speed" in only:
            speed_runs: dict[str, object] = {}
            for name in args.shapes.split(","):
                arch, canary_shape = SPEED_SHAPES[name]
                if args.quick:
                    arch, canary_shape = replace(arch, layers=2), (8, 128)
                for e in envs:
                    speed_runs[f"{name}, {e}"] = speed(work, args.rounds, arch, *canary_shape, e, args.threads, name)
            results["speed"] = speed_runs
        if "rss" in only:
            arch = replace(BIG, layers=4, hidden=512) if args.quick else BIG
            results["rss"] = peak_rss(work, arch, 8, 256, 1 if args.quick else 2, env)
        if "scaling" in only:
            results["scaling"] = scaling(work, SCALE_BASE, 1 if args.quick else 2, args.quick, env)
        if "cache" in only:
            results["cache"] = {
                "tiny": cache(work, "tiny", replace(SCALE_BASE, layers=2), 2, (8, 128), args.rounds, env),
                "small": cache(work, "small", CACHE_SMALL, 3, (16, 256), args.rounds, env),
            }
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["load_after"] = load_note()
    summarise(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def summarise(res: dict[str, object]) -> None:
    print("\n== summary ==")
    print(json.dumps(res["machine"]))
    for env_name, s in res.get("speed", {}).items():
        print(f"speed, {env_name} ({s.get('arch')}, canary {s.get('canary')}) env {s['env']}:")
        for name, runs in s["runs"].items():
            print(
                f"{name:>10}: wall "
                + " ".join(f"{r['wall']:.2f}" for r in runs)
                + "  cpu "
                + " ".join(f"{r['cpu']:.2f}" for r in runs)
                + "  maxrss MB "
                + " ".join(f"{r['rss_mb']:.0f}" for r in runs)
            )
        print(f"{'environment':>22}: {s['env_reported']}")
        for k in RATIOS:
            print(f"{k:>22}: {s[k]}  (env {s['env']})")
    if "rss" in res:
        r = res["rss"]
        print(
            f"rss: checkpoint {r['checkpoint_bytes'] / 1e9:.2f} GB; max RSS "
            + ", ".join(
                f"{x.get('budget', '')} {x['max_rss_bytes'] / 1e9:.3f} GB ({x['fraction']:.1%}, {x['wall']:.0f} s)"
                for x in r["runs"]
            )
        )
    if "scaling" in res:
        for axis, points in res["scaling"].items():
            print(
                f"scaling vs {axis}: "
                + "; ".join(f"{p[axis if axis != 'tokens' else 'tokens']}: {p['replay_s']:.2f} s" for p in points)
            )
    for name, c in res.get("cache", {}).items():
        for row in c["rounds"]:
            print(
                f"cache ({name}): cold {row['cold_s']:.2f} s, warm {row['warm_s']:.2f} s "
                f"({row['speedup']:.1f}×), one checkpoint added: {row['added_s']:.2f} s, "
                f"replayed {row['replays_added']}"
            )
    print(res["load_after"])


if __name__ == "__main__":
    main()
