"""The weight path of a device replay, on the host alone: hash a checkpoint, then read every layer's
weights as the device branch does (forward order, then backward order), each tensor copied once as a
DMA would read it. Two plans, one process each (pair them with a whole-process A/B timer):

    python benchmarks/weight_path.py build            # a 1.5 GB mixtral-layout checkpoint (bf16) in /tmp
    python benchmarks/weight_path.py cap              # the CPU's plan: 512 MiB of private copies, the rest
                                                      # re-read through 64 KiB block digests, each pass
    python benchmarks/weight_path.py plan             # an accelerator's plan (replay/hostplan.py): the file
                                                      # kept, tensors read as views of the hashed copy

On an H200 this host work was 8.5 of the 11.7 s of the 1.32 B benchmark's replay (cProfile, before the
plan; docs/benchmarks.md "GPU"), so the host-side figure here is what the plan changes there. Pinning is
left out (it needs CUDA): the copy the plan keeps is plain memory here, and the one copy per tensor stands
for the DMA. Prints one JSON line: seconds to hash, seconds for the two passes, bytes read per pass.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = Path("/tmp/moeaudit-weight-path")


def build() -> None:
    sys.path.insert(0, str(HERE))
    from build import Arch, write_checkpoint

    arch = Arch(vocab=32000, hidden=2048, layers=4, experts=16, top_k=2, inter=1408, heads=16, kv_heads=4)
    print(write_checkpoint(WORK / "ckpt", arch) / 1e9, "GB")


def passes(plan: str) -> dict[str, float]:
    import torch

    from moeaudit.checkpoint import Checkpoint, sealed

    if plan == "plan":  # what plan_host_copies sets on CUDA, less the pinning
        sealed.PLAN = sealed.HostPlan(budget=1 << 40, alias=True)
    t0 = time.perf_counter()
    ckpt = Checkpoint(WORK / "ckpt")
    _ = ckpt.digest
    t1 = time.perf_counter()
    moved = 0
    layers = list(range(ckpt.spec.num_layers))
    for order in (layers, layers[::-1]):  # the forward, then the backward
        for i in order:
            lw = ckpt.layer_weights(i, None, lazy_experts=True, device="cpu")
            for _, t in lw.stored_tensors():
                torch.empty_like(t).copy_(t)  # the DMA's read of the source
                moved += t.numel() * t.element_size()
    t2 = time.perf_counter()
    return {"plan": plan, "hash_s": t1 - t0, "passes_s": t2 - t1, "bytes_per_pass": moved / 2}


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build()
    else:
        print(json.dumps(passes(sys.argv[1])))
