"""One rank of tests/test_distributed_train.py, started by ``torchrun`` on 127.0.0.1 (gloo):
``dist_train_worker.py MODE OUT_DIR``. Every collective has a bounded timeout.

Modes:

* ``trainer`` — the HF Trainer under DDP (2 CPU ranks, its default
  ``average_tokens_across_devices``) with :class:`MoeauditCallback`; rank 0 writes the Trainer's
  ``log_history`` next to the callback's ``metrics.jsonl``; ``trainer_ga``: the same with two
  micro-batches per optimizer step;
* ``fsdp_probe`` — FSDP2 ``fully_shard`` per decoder layer and the root; the loop hook's
  ``on_save`` writes the canary probe (every rank calls it).

With ``single`` as a third argument the same run is made by one process (no process group).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hfmodels import VOCAB, tiny_model  # noqa: E402

from moeaudit.canary import Canary  # noqa: E402
from moeaudit.errors import InputError  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)
STEPS, ROWS, SEQ = 3, 8, 12  # ROWS: the global batch of a step


def canary() -> Canary:
    rng = np.random.default_rng(5)
    return Canary(rng.integers(0, VOCAB, (4, 10)).astype("int32"), np.array([0, 0, 1, 1], "int32"), ("a", "b"))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS * ROWS, SEQ), generator=torch.Generator().manual_seed(7))


def trainer(out: Path, world: int, accumulate: int = 1) -> None:
    import transformers

    from moeaudit.integrations.transformers import MoeauditCallback

    model = tiny_model("mixtral")
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=ROWS // world // accumulate,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="no",
        ddp_backend="gloo" if world > 1 else None,
        ddp_timeout=60,
        dataloader_drop_last=True,
    )
    rows = [{"input_ids": r, "labels": r} for r in tokens()]
    t = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[MoeauditCallback()])
    t.train()
    if t.is_world_process_zero():
        history = [h for h in t.state.log_history if "loss" in h]
        (out / "log_history.json").write_text(json.dumps(history))


def fsdp_probe(out: Path, world: int) -> None:
    from moeaudit.integrations.core import canary_loss
    from moeaudit.integrations.loop import MoeauditHook

    model = tiny_model("mixtral").train()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    rows = tokens()[:ROWS]
    mine = rows.chunk(world)[dist.get_rank() if world > 1 else 0]
    with MoeauditHook(out, model, canary=canary(), every=1) as hook:
        model(input_ids=mine, labels=mine).loss.backward()
        hook.after_backward(1)
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        hook.on_save(1)
        after = {n: _full(p.grad) for n, p in model.named_parameters()}
        if world > 1:  # a canary loss computed outside probe_scope is refused, not logged as zeros
            try:
                hook.recorder.logger.probe(2, canary_loss(model, canary()))
                refused = ""
            except InputError as exc:
                refused = exc.diagnostics() if hasattr(exc, "diagnostics") else str(exc)
            (out / f"refused{dist.get_rank()}.txt").write_text(refused)
    same = all((grads[n] is None) == (after[n] is None) for n in grads) and all(
        torch.equal(grads[n], after[n]) for n in grads if grads[n] is not None
    )
    (out / f"grads_kept{dist.get_rank() if world > 1 else 0}.json").write_text(json.dumps(same))


def _full(g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:
        return None
    return g.full_tensor() if hasattr(g, "full_tensor") else g.clone()


def main(mode: str, out: Path, single: bool) -> None:
    world = 1
    if not single:
        dist.init_process_group("gloo", timeout=TIMEOUT)
        world = dist.get_world_size()
    modes = {"trainer": trainer, "trainer_ga": lambda o, w: trainer(o, w, accumulate=2), "fsdp_probe": fsdp_probe}
    modes[mode](out, world)
    if not single:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "single")
    # leave without C++ static destructors, which race gloo's threads at exit (tests/dist_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
