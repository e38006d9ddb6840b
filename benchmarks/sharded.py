"""Expert-parallel replay on 1, 2 and 4 CPU ranks (docs/benchmarks.md §8): wall time of the replay, bytes
each rank read from the checkpoint, peak RSS of each rank; and the memory demonstration — a
per-process cap that one process's replay exceeds and every rank of four stays under.

    python benchmarks/sharded.py [--layers 8] [--experts 16] [--hidden 256] [--expert-dim 512]

The baseline (one process, no torch.distributed) runs in the same script and environment; the
sharded runs are real gloo ranks on 127.0.0.1 (one process each, OMP_NUM_THREADS = cores ÷
ranks). Bytes read are counted where the checkpoint's bytes are read (``checkpoint.sealed``:
the hashing pass of a file and every verified re-read) over the whole run (the digest and both
replays), the total as a multiple of the checkpoint's size, and the bytes a rank received from
the rank that hashed them (``replay.rank_bytes``: sent, not read); peak RSS is each process's
VmHWM, torch and gloo included. The replay is timed twice in each run: the first (digest, cold
process) and a second, warm one. Results go to stdout as JSON lines and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _count_reads() -> dict[str, int]:
    """Count the checkpoint bytes this process reads (the sealed reader's two read paths)."""
    from moeaudit.checkpoint import sealed

    count = {"bytes": 0}
    pread, read = sealed._pread_exact, sealed._read_exact

    def counted_pread(path: Path, fd: int, view: memoryview, offset: int) -> None:
        count["bytes"] += len(view)
        pread(path, fd, view, offset)

    def counted_read(fd: int, view: memoryview) -> int:
        n = read(fd, view)
        count["bytes"] += n
        return n

    sealed._pread_exact, sealed._read_exact = counted_pread, counted_read
    return count


def _received() -> int:
    """Checkpoint bytes this rank received from the rank that hashed them (not read from disk)."""
    from moeaudit.replay import rank_bytes

    return rank_bytes.RECEIVED["bytes"]


def _peak_rss_mb() -> float:
    """VmHWM (ru_maxrss survives exec: a child would report the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_main(ckpt: str, canary: str, out: str) -> None:
    """One process: rank 0 (or the single-process baseline) replays; the others serve."""
    count = _count_reads()
    import torch

    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.replay import dist, replay, worker

    rank, world = dist.env_world()
    if rank > 0:
        code = worker.serve()
        stats: dict[str, Any] = {
            "rank": rank,
            "bytes_read": count["bytes"],
            "peak_rss_mb": _peak_rss_mb(),
            "bytes_received": _received(),
        }
        Path(f"{out}.{rank}").write_text(json.dumps(stats))
        sys.stdout.flush()
        os._exit(code)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    probe = canary_mod.load(canary)
    with dist.session():
        t0 = time.perf_counter()
        c = Checkpoint(ckpt)
        digest = c.digest  # hashed across the ranks
        result = replay(c, probe.tokens)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        replay(c, probe.tokens)  # warm: what each further checkpoint of a run costs
        seconds = time.perf_counter() - t0
    stats = {
        "rank": 0,
        "bytes_read": count["bytes"],
        "peak_rss_mb": _peak_rss_mb(),
        "bytes_received": _received(),
        "replay_s": seconds,
        "first_s": first,
        "nll": result.nll,
        "digest": digest,
    }
    Path(f"{out}.0").write_text(json.dumps(stats))
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, ckpt: Path, canary: Path, out: Path) -> list[dict[str, Any]]:
    threads = str(max(1, (os.cpu_count() or 1) // world))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "OMP_WAIT_POLICY": "PASSIVE",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE), "--rank-main", str(ckpt), str(canary), str(out)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(world)
    ]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"a rank of {world} failed (exit {p.returncode})")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def build(root: Path, layers: int, experts: int, hidden: int, expert_dim: int) -> tuple[Path, Path]:
    import torch
    import transformers

    from moeaudit import canary as canary_mod

    config = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=expert_dim,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    ckpt = root / "ckpt"
    model.save_pretrained(ckpt, max_shard_size="8MB")  # several files: each hashed by one rank
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (8, 128), generator=g, dtype=torch.int32)
    canary = root / "canary.safetensors"
    canary_mod.save(canary_mod.Canary(tokens, torch.zeros(8, dtype=torch.int32), ("text",)), canary)
    return ckpt, canary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-dim", type=int, default=512)
    ap.add_argument("--worlds", default="1,2,4")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt, canary = build(root, args.layers, args.experts, args.hidden, args.expert_dim)
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        print(
            json.dumps(
                {
                    "checkpoint_bytes": size,
                    "files": len(list(ckpt.glob("*.safetensors"))),
                    "cores": os.cpu_count(),
                    "load": os.getloadavg(),
                }
            )
        )
        runs = {}
        for world in (int(w) for w in args.worlds.split(",")):
            ranks = launch(world, ckpt, canary, root / f"stats{world}")
            runs[world] = ranks
            print(json.dumps({"world": world, "ranks": ranks, "load": os.getloadavg()}))
    base = runs[min(runs)][0]
    print(f"\ncheckpoint {size / 2**20:.0f} MiB; {os.cpu_count()} cores")
    print(
        "ranks  replay s  speed-up  MiB read per rank (digest + 2 replays)  total read  MiB received per rank"
        "  peak RSS per rank (MiB)"
    )
    for world, ranks in runs.items():
        s = ranks[0]["replay_s"]
        reads = " ".join(f"{r['bytes_read'] / 2**20:6.1f}" for r in ranks)
        total = sum(r["bytes_read"] for r in ranks) / size
        received = " ".join(f"{r['bytes_received'] / 2**20:6.1f}" for r in ranks)
        rss = " ".join(f"{r['peak_rss_mb']:6.0f}" for r in ranks)
        same = (
            "same NLL and digest"
            if ranks[0]["nll"] == base["nll"] and ranks[0]["digest"] == base["digest"]
            else "NLL/digest DIFFER"
        )
        print(
            f"{world:5d}  {s:8.2f}  {base['replay_s'] / s:7.2f}x  {reads:39s} {total:8.2f}x  {received:21s}"
            f"  {rss}   {same} "
            f"(first replay {ranks[0]['first_s']:.2f} s)"
        )
    if 1 in runs and 4 in runs:
        one, four = runs[1][0]["peak_rss_mb"], max(r["peak_rss_mb"] for r in runs[4])
        cap = (one + four) / 2
        print(
            f"\nmemory cap {cap:.0f} MiB per process: 1 process peaks at {one:.0f} MiB "
            f"({'over' if one > cap else 'UNDER'}), the largest of 4 ranks at {four:.0f} MiB "
            f"({'under' if four < cap else 'OVER'})"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(*sys.argv[2:5])
    else:
        main()
