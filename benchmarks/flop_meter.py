"""What counting the replay's FLOPs costs: ``receipts.compute.metered`` wraps every certify replay in
``torch.utils.flop_counter.FlopCounterMode``, a dispatch mode that sees each operation in Python.
One process, one checkpoint, the same replay alternately bare and metered (A/B, several rounds):

    python benchmarks/flop_meter.py sample            # sample_checkpoints/deepseek/checkpoint-1000
    python benchmarks/flop_meter.py mid               # a 4-layer mixtral layout, hidden 1024, 8 experts,
                                                      # built in /tmp (bf16 on disk), 8 × 256-token canary

Prints one JSON line per round: seconds bare, seconds metered, their ratio, and the FLOPs counted.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = Path("/tmp/moeaudit-flop-meter")


def _inputs(which: str) -> tuple[Path, Path]:
    if which == "sample":
        return (
            ROOT / "sample_checkpoints" / "deepseek" / "checkpoint-1000",
            ROOT / "sample_checkpoints" / "canary.safetensors",
        )
    sys.path.insert(0, str(HERE))
    from build import Arch, write_canary, write_checkpoint

    arch = Arch(vocab=8192, hidden=1024, layers=4, experts=8, top_k=2, inter=704, heads=8, kv_heads=2)
    if not (WORK / "ckpt" / "config.json").exists():
        write_checkpoint(WORK / "ckpt", arch)
        write_canary(WORK / "canary.safetensors", arch.vocab, 8, 256)
    return WORK / "ckpt", WORK / "canary.safetensors"


def main(which: str, rounds: int = 3) -> None:
    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.policy import Policy
    from moeaudit.receipts.compute import metered
    from moeaudit.receipts.state import state_receipts

    path, canary_path = _inputs(which)
    ckpt, probe, policy = Checkpoint(path), canary_mod.load(canary_path), Policy()
    state_receipts(ckpt, probe, policy)  # warm: first-touch reads, kernels' first calls
    for r in range(rounds):
        t0 = time.perf_counter()
        state_receipts(ckpt, probe, policy)
        t1 = time.perf_counter()
        with metered() as meter:
            state_receipts(ckpt, probe, policy)
        t2 = time.perf_counter()
        bare, counted = t1 - t0, t2 - t1
        print(
            json.dumps(
                {
                    "round": r,
                    "bare_s": round(bare, 3),
                    "metered_s": round(counted, 3),
                    "ratio": round(counted / bare, 2),
                    "flops": meter.flops,
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sample")
