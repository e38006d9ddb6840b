"""What counting the replays' FLOPs costs: certify wraps a replay in
``torch.utils.flop_counter.FlopCounterMode``, a dispatch mode that sees each operation in Python,
once per shape (``receipts.flop_reuse``: the other checkpoints' replays carry that count).
One process, the checkpoints of one run; each round replays every checkpoint three ways, back to
back: bare, metered (every replay, before ``flop_reuse``) and as certify plans it (metered once
per shape, the others carrying that count):

    python benchmarks/flop_meter.py sample            # sample_checkpoints/deepseek, its 6 checkpoints
    python benchmarks/flop_meter.py mid               # 3 checkpoints of a 4-layer mixtral layout, hidden
                                                      # 1024, 8 experts (seeds 0-2), built in /tmp (bf16
                                                      # on disk), 8 × 256-token canary
    python benchmarks/flop_meter.py mid --device cuda # the same replays on a GPU (gpu_session.sh)

Threads: ``torch.get_num_threads()`` is printed and is the same for every side of every ratio.
Prints one JSON line per round: per side the seconds of the whole run and their ratios to bare,
the first replay's ratio metered/bare, the carrying replays' ratio to bare, the FLOPs (the same
both ways, asserted) and how many replays carried a count.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = Path("/tmp/moeaudit-flop-meter")
MID_CHECKPOINTS = 3


def _inputs(which: str) -> tuple[list[Path], Path]:
    if which == "sample":
        run = ROOT / "sample_checkpoints" / "deepseek"
        steps = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        return steps, ROOT / "sample_checkpoints" / "canary.safetensors"
    sys.path.insert(0, str(HERE))
    from build import Arch, write_canary, write_checkpoint

    arch = Arch(vocab=8192, hidden=1024, layers=4, experts=8, top_k=2, inter=704, heads=8, kv_heads=2)
    paths = [WORK / f"checkpoint-{seed}" for seed in range(MID_CHECKPOINTS)]
    for seed, path in enumerate(paths):
        if not (path / "model.safetensors").exists():
            write_checkpoint(path, arch, seed=seed)
    if not (WORK / "canary.safetensors").exists():
        write_canary(WORK / "canary.safetensors", arch.vocab, 8, 256)
    return paths, WORK / "canary.safetensors"


def _round(ckpts: list[Any], probe: Any, policy: Any, device: str | None = None) -> dict[str, Any]:
    """One pass over the run; each checkpoint replayed bare, metered, and as certify plans it,
    back to back (so that a change in the machine's load falls on all three sides alike)."""
    from moeaudit.receipts.compute import metered
    from moeaudit.receipts.flop_reuse import FlopReuse
    from moeaudit.receipts.state import run_state

    reuse = FlopReuse(device)
    settings = policy.to_json()["receipts"]
    seconds = {"bare": [], "every": [], "once": []}
    flops = {"every": 0, "once": 0}
    carried = 0
    for i, ckpt in enumerate(ckpts):
        t0 = time.perf_counter()
        run_state(ckpt, probe, policy, device=device)
        t1 = time.perf_counter()
        with metered(device) as m:
            run_state(ckpt, probe, policy, device=device)
        t2 = time.perf_counter()
        plan = reuse.plan(ckpt, probe, settings)
        with metered(device, count=plan.meter) as m2:
            _, obs = run_state(ckpt, probe, policy, stash_budget=plan.budget, device=device)
        entry = reuse.record(plan, f"{i}", m2.record(), obs.kept_layers)
        t3 = time.perf_counter()
        seconds["bare"].append(t1 - t0)
        seconds["every"].append(t2 - t1)
        seconds["once"].append(t3 - t2)
        flops["every"] += m.flops
        flops["once"] += entry["flops"]
        carried += "flops_from" in entry
    assert flops["once"] == flops["every"], flops
    bare, every, once = (sum(seconds[k]) for k in ("bare", "every", "once"))
    return {
        "bare_s": round(bare, 3),
        "metered_every_s": round(every, 3),
        "metered_once_s": round(once, 3),
        "ratio_every": round(every / bare, 2),
        "ratio_once": round(once / bare, 2),
        "first_replay_ratio": round(seconds["every"][0] / seconds["bare"][0], 2),
        "carrying_replay_ratio": round(sum(seconds["once"][1:]) / sum(seconds["bare"][1:]), 2),
        "flops": flops["once"],
        "carried": carried,
    }


def main(which: str, rounds: int = 3, device: str | None = None) -> None:
    import torch

    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.policy import Policy
    from moeaudit.receipts.compute import metered
    from moeaudit.receipts.state import state_receipts

    paths, canary_path = _inputs(which)
    ckpts, probe, policy = [Checkpoint(p) for p in paths], canary_mod.load(canary_path), Policy()
    for ckpt in ckpts:  # warm: first-touch reads, kernels' first calls, the mode's set-up
        state_receipts(ckpt, probe, policy, device=device)
    with metered(device):
        state_receipts(ckpts[0], probe, policy, device=device)
    info = {"threads": torch.get_num_threads(), "checkpoints": len(ckpts), "torch": torch.__version__}
    print(json.dumps({**info, "device": device or "cpu"}))
    for r in range(rounds):
        print(json.dumps({"round": r, **_round(ckpts, probe, policy, device)}))


if __name__ == "__main__":
    args = sys.argv[1:]
    dev = args[args.index("--device") + 1] if "--device" in args else None
    rest = [a for i, a in enumerate(args) if a != "--device" and (i == 0 or args[i - 1] != "--device")]
    main(rest[0] if rest else "sample", device=dev)
