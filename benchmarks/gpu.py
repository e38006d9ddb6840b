"""The replay-speed benchmark's contenders in one script: fresh processes, alternating, ratios.

    python benchmarks/gpu.py --device cuda --precision bf16 --rounds 2          # the GPU benchmark
    python benchmarks/gpu.py --device cpu --rounds 1                            # a tiny shape on the CPU
    python benchmarks/gpu.py --device cuda --only cli,cli_low,floor,floor_low   # the precision target only

The GPU shape is the one the GPU probe measured (a 1.32 B mixtral-layout checkpoint from
``benchmarks/build.py``, 8 layers × 16 experts, a 32 × 512 canary); the CPU default is tiny, so
that CI runs the script end to end (tests/test_gpu_bench.py). Contenders, each its own process,
each printing one JSON line with ``compute_s`` (after the checkpoint is opened and hashed, until
the device is synchronised) and ``peak_gb``:

* ``cli``: ``moeaudit receipts --device D`` (fp32, the reference), whole process;
* ``cli_low``: the same with ``--precision P`` (when P is not fp32);
* ``receipts``: the receipts in process (fp32); ``receipts_low``: in precision P;
* ``floor``: the bare replay, forward + backward (fp32); ``floor_low``: in precision P;
* ``floor_overlap``: the replay with the overlap receipts' extra experts (fp32);
* ``floor_cap``: ``floor`` with the host copies capped as on the CPU (``MOEAUDIT_HOST_COPY_BUDGET=0``:
  a checkpoint over 512 MiB is re-read through its block digests), the weight path's A/B;
* ``hf_fp32`` / ``hf_bf16``: what a user writes with transformers (forward with router logits,
  next-token CE, backward, per-expert gradient norms and counts).

Rounds alternate over the contenders (A B C … A B C …) so that a machine whose load moves
moves every arm alike; medians per contender; the ratios printed are compute (and wall) of
``X_low / X`` (the precision's speed-up target is ≤ 0.25 for bf16 on the GPU), of moeaudit
against transformers, and of the receipts against the bare replay.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

SHAPES = {  # (Arch fields, canary windows, window length)
    "gpu": (
        dict(vocab=32000, hidden=2048, layers=8, experts=16, top_k=2, inter=1408, heads=16, kv_heads=4),
        32,
        512,
    ),
    "tiny": (dict(vocab=512, hidden=64, layers=2, experts=4, top_k=2, inter=128, heads=4, kv_heads=2), 4, 32),
    "small": (dict(vocab=4096, hidden=256, layers=4, experts=8, top_k=2, inter=704, heads=8, kv_heads=2), 8, 128),
}


def _contenders(ckpt: Path, canary: Path, device: str, precision: str, work: Path) -> dict[str, list[str]]:
    py, me = sys.executable, str(Path(__file__).resolve())

    def inner(mode: str, prec: str = "fp32") -> list[str]:
        return [py, me, "_run", mode, str(ckpt), str(canary), device, prec]

    cli = [py, "-m", "moeaudit", "receipts", str(ckpt), "--canary", str(canary), "--force", "--device", device]
    out: dict[str, list[str]] = {
        "cli": [*cli, "--json", str(work / "r.json")],
        "receipts": inner("receipts"),
        "floor": inner("floor"),
        "floor_overlap": inner("overlap"),
        # the weight path's A/B: private copies capped at the CPU's 512 MiB (block-verified re-reads)
        "floor_cap": ["env", "MOEAUDIT_HOST_COPY_BUDGET=0", *inner("floor")],
        "hf_fp32": inner("hf", "fp32"),
        "hf_bf16": inner("hf", "bf16"),
    }
    if precision != "fp32":
        out["cli_low"] = [*cli, "--json", str(work / f"r-{precision}.json"), "--precision", precision]
        out["receipts_low"] = inner("receipts", precision)
        out["floor_low"] = inner("floor", precision)
    return out


RATIOS = [
    ("cli_low", "cli"),
    ("receipts_low", "receipts"),
    ("floor_low", "floor"),
    ("cli", "hf_fp32"),
    ("cli", "hf_bf16"),
    ("cli_low", "hf_bf16"),
    ("receipts", "floor"),
    ("receipts", "floor_overlap"),
    ("floor", "hf_fp32"),
    ("floor_low", "hf_bf16"),
    ("floor", "floor_cap"),
]


def ratios(summary: dict[str, dict[str, float]], key: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for a, b in RATIOS:
        if key in summary.get(a, {}) and summary.get(b, {}).get(key):
            out[f"{a}/{b}"] = round(summary[a][key] / summary[b][key], 3)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="bf16")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="default: gpu on cuda, tiny on the cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", help="comma-separated contenders (default: all)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moeaudit-gpu-bench"))
    ap.add_argument("--timeout", type=float, default=300.0, help="per process, seconds")
    ap.add_argument("--out", type=Path, help="also write the runs and summary as JSON here")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from build import Arch, write_canary, write_checkpoint

    shape = a.shape or ("gpu" if a.device == "cuda" else "tiny")
    fields, W, T = SHAPES[shape]
    arch = Arch(**fields)
    work = a.work / shape
    ckpt, canary = work / "ckpt", work / "canary.safetensors"
    if not (ckpt / "config.json").exists() or not canary.exists():
        work.mkdir(parents=True, exist_ok=True)
        write_checkpoint(ckpt, arch)
        write_canary(canary, arch.vocab, W, T)
    print(f"{shape}: {arch} ({arch.parameters() / 1e9:.3f} B parameters), canary {W}x{T}", flush=True)
    contenders = _contenders(ckpt, canary, a.device, a.precision, work)
    if a.only:
        keep = a.only.split(",")
        contenders = {k: v for k, v in contenders.items() if k in keep}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p),
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in contenders}
    for r in range(a.rounds):
        for name, cmd in contenders.items():
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
            wall = time.perf_counter() - t
            line = next((x for x in reversed(p.stdout.strip().splitlines()) if x.startswith("{")), "{}")
            inner = json.loads(line) if name not in ("cli", "cli_low") else {}
            runs[name].append({"wall": wall, "rc": p.returncode, **inner})
            print(f"round {r} {name}: rc {p.returncode} wall {wall:.2f}s {inner}", flush=True)
            if p.returncode:
                print(p.stderr[-2500:], flush=True)
    summary: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        ok = [x for x in rs if x["rc"] == 0]
        if ok:
            summary[name] = {"wall_med": statistics.median(x["wall"] for x in ok)}
            if all("compute_s" in x for x in ok):
                summary[name]["compute_med"] = statistics.median(x["compute_s"] for x in ok)
    print("SUMMARY", json.dumps(summary, indent=1), flush=True)
    result = {"shape": shape, "arch": str(arch), "canary": [W, T], "device": a.device, "precision": a.precision}
    result.update(runs=runs, summary=summary)
    for key in ("compute_med", "wall_med"):
        result[key + "_ratios"] = ratios(summary, key)
        print(key, json.dumps(result[key + "_ratios"]), flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps(result, indent=1))
    return result


# --- one contender, in its own process ---------------------------------------------------------------


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak(device: str) -> float:
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB → GB


def _run_moeaudit(mode: str, ckpt_path: str, canary_path: str, device: str, precision: str) -> dict[str, Any]:
    import moeaudit.cli  # noqa: F401  the process settings the command line makes
    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.precision import precision_mode

    dev = None if device == "cpu" else device
    if dev is not None:
        from moeaudit.replay.hostplan import plan_host_copies

        plan_host_copies(dev)  # what the CLI does for --device, before anything is hashed
    ckpt = Checkpoint(ckpt_path)
    probe = canary_mod.load(canary_path)
    _ = ckpt.digest
    t1 = time.perf_counter()
    with precision_mode(precision):
        if mode == "receipts":
            from moeaudit.receipts.state import state_receipts

            nll = state_receipts(ckpt, probe, device=dev)["nll"]
        else:
            from moeaudit.replay import replay

            obs: tuple[Any, ...] = ()
            if mode == "overlap":
                from moeaudit.receipts.overlap import extra_experts

                class OverlapExperts:
                    def extra_experts(self, layer: int, routing: Any) -> Any:
                        return extra_experts(routing, layer)

                    def __call__(self, tap: Any, lw: Any) -> None:
                        pass

                obs = (OverlapExperts(),)
            nll = replay(ckpt, probe.tokens, observers=obs, device=dev).nll
    _sync(device)
    return {"mode": mode, "precision": precision, "nll": float(nll), "compute_s": time.perf_counter() - t1}


def _run_hf(ckpt: str, canary: str, device: str, dtype: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tokens = load_file(canary)["tokens"].long().to(device)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    model = model.to(device)
    _sync(device)
    t1 = time.perf_counter()
    out = model(tokens, output_router_logits=True)
    logits = out.logits.float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    k = model.config.num_experts_per_tok
    for layer, rl in zip(model.model.layers, out.router_logits, strict=True):
        ex = layer.mlp.experts
        n = (ex.gate_up_proj.grad.double().pow(2).sum((1, 2)) + ex.down_proj.grad.double().pow(2).sum((1, 2))).sqrt()
        c = torch.bincount(rl.topk(k, dim=-1).indices.reshape(-1), minlength=ex.gate_up_proj.shape[0])
        _ = (n.tolist(), c.tolist())
    _sync(device)
    return {"mode": "hf", "precision": dtype, "nll": float(loss), "compute_s": time.perf_counter() - t1}


def run_one(argv: list[str]) -> None:
    mode, ckpt, canary, device, precision = argv
    res = (
        _run_hf(ckpt, canary, device, precision)
        if mode == "hf"
        else _run_moeaudit(mode, ckpt, canary, device, precision)
    )
    print(json.dumps({**res, "peak_gb": _peak(device)}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_run":
        run_one(sys.argv[2:])
    else:
        main()
