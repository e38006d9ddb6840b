"""One rank of tests/test_distributed.py: ``python dist_worker.py MODE OUT_DIR`` with RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set. Every collective has a bounded timeout.

Modes (each logs step 1 of a tiny Mixtral to OUT_DIR/metrics.jsonl through the loop hook, or
``ExpertGradLogger`` for ``ep``; only rank 0 writes):

* ``ddp``  — DistributedDataParallel, each rank half of the batch (gloo averages the gradients);
* ``fsdp`` — FSDP2 ``fully_shard`` per decoder layer and the root, half of the batch each;
* ``ep``   — sharded gradients set by hand: every fused expert tensor and the router as DTensors
  sharded on dim 0 (expert parallelism: each rank holds half the experts), the reference
  gradient of the full batch distributed over the ranks.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hfmodels import tiny_model  # noqa: E402

from moeaudit.integrations.hooks import ExpertGradLogger  # noqa: E402
from moeaudit.integrations.loop import MoeauditHook  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)


def batch() -> torch.Tensor:
    return torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(3))


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = batch()
    half = tokens.chunk(world)[rank]
    model = tiny_model("mixtral").train()
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        wrapped(input_ids=half, labels=half).loss.backward()
        source: torch.nn.Module = wrapped
    elif mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(input_ids=half, labels=half).loss.backward()
        source = model
    elif mode == "ep":
        source = _expert_parallel(model, tokens, world)
    else:
        raise SystemExit(f"unknown mode {mode}")
    if mode == "ep":
        logger = ExpertGradLogger(out / "metrics.jsonl", source, family="mixtral")
        record = logger.log(1, 0.0)
        logger.close()
    else:  # the loop hook a torchtitan-style loop calls on every rank
        with MoeauditHook(out, source, every=1) as hook:
            record = hook.after_backward(1, torch.tensor(0.0))
    # the global norm a trainer clips with, from the same pass (no rank writes here)
    totals = ExpertGradLogger(out / "unused.jsonl", source, family="mixtral", total=True, rank_zero=False)
    (out / f"rank{rank}.json").write_text(
        json.dumps({"wrote": record is not None, "total": totals.measure().total, "collective": totals.collective})
    )
    dist.barrier()
    dist.destroy_process_group()


def _expert_parallel(model: torch.nn.Module, tokens: torch.Tensor, world: int) -> torch.nn.Module:
    """The full-batch gradient, with every fused expert tensor and router sharded on dim 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model(input_ids=tokens, labels=tokens).loss.backward()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        moe = layer.mlp
        for owner, name in ((moe.experts, "gate_up_proj"), (moe.experts, "down_proj"), (moe.gate, "weight")):
            p = getattr(owner, name)
            sharded = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
            sharded.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
            setattr(owner, name, sharded)
    return model


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    # The results are on disk and the process group is destroyed; leave without running C++
    # static destructors, which race gloo's threads at exit ("terminate called without an
    # active exception", SIGABRT) about one run in three on a loaded 2-core machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
