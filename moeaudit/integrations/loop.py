"""A hook for a hand-written PyTorch training loop — torchtitan's included (README.md, "Logging from your
training loop").

    from moeaudit.integrations.loop import MoeauditHook

    hook = MoeauditHook("runs/a", model, canary="canary.safetensors", every=1,
                        log_fn=lambda scalars, step: writer.add_scalars("moe", scalars, step))
    for step, batch in enumerate(loader, 1):
        loss = model(**batch).loss
        loss.backward()
        hook.after_backward(step, loss)        # before clipping: the unclipped gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); optimizer.zero_grad()
        if step % 500 == 0:
            model.save_pretrained(f"runs/a/checkpoint-{step}")
            hook.on_save(step)                 # canary probe + fsync of the logs
    hook.close()

It writes what the Trainer callbacks write (:mod:`moeaudit.integrations.core`): ``metrics.jsonl``
every ``every`` steps, ``canary.safetensors`` once, ``canary_probe.jsonl`` at saves; raises the
online envelope events as warnings on the ``moeaudit`` logger; and every ``log_every`` steps
hands the per-layer ``moe/…`` scalars to ``log_fn(scalars, step)`` — TensorBoard's
``SummaryWriter``, ``wandb.log``, ``mlflow.log_metrics`` or your own.

**torchtitan**: call :meth:`after_backward` in ``Trainer.train_step`` after
``forward_backward_step`` (the gradients of the whole step, before ``clip_grad_norm_``) and
:meth:`on_save` after ``checkpointer.save``, on every rank: with FSDP2 or expert parallelism the
gradients are DTensors, the squared norms are all-reduced across ranks (one collective) and only
rank 0 writes (:mod:`moeaudit.integrations.gradnorms`). Layer names must match a layout of
:mod:`moeaudit.families` (torchtitan's own are in the deepseek_v3 / llama4 layouts) or pass
``family``. ``rank_zero`` defaults to global rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moeaudit.canary import Canary
from moeaudit.integrations.core import RunRecorder, envelope_settings, load_canary
from moeaudit.policy import EnvelopeSettings, Policy


class MoeauditHook:
    """``after_backward`` every step, ``on_save`` at every checkpoint, ``close`` at the end."""

    def __init__(
        self,
        run_dir: str | Path,
        model: torch.nn.Module,
        *,
        canary: Canary | str | Path | None = None,
        every: int = 1,
        probe: bool = True,
        resume_step: int | None = None,
        envelope: EnvelopeSettings | Policy | str | Path | None = None,
        log_fn: Callable[[dict[str, float], int], Any] | None = None,
        log_every: int = 10,
        rank_zero: bool | None = None,
    ):
        if every < 1 or log_every < 1:
            raise ValueError(f"every and log_every must be >= 1, got {every} and {log_every}")
        if rank_zero is None:
            dist = torch.distributed
            rank_zero = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.recorder = RunRecorder(
            run_dir,
            model,
            canary=load_canary(canary),
            every=every,
            probe=probe,
            resume_step=resume_step,
            rank_zero=rank_zero,
            envelope=envelope_settings(envelope),
        )
        self.log_fn, self.log_every = log_fn, log_every

    def after_backward(self, step: int, loss: torch.Tensor | float | None = None) -> dict[str, Any] | None:
        """Log optimizer step ``step`` (counted from 1) from the ``.grad`` now; returns the
        metrics line on rank 0 when one was due. ``loss``: the step's loss (a tensor is read
        in the same host sync as the norms)."""
        record = self.recorder.log_step(step, loss=loss)
        if self.log_fn is not None and self.recorder.active and step % self.log_every == 0:
            self.log_fn(self.recorder.scalars(), step)
        return record

    def on_save(self, step: int) -> dict[str, Any] | None:
        """After saving ``checkpoint-<step>``: the canary probe (if a canary was given) and an
        fsync of the logs. Call it on every rank."""
        record = self.recorder.probe(step)
        self.recorder.sync()
        return record

    def close(self) -> None:
        self.recorder.close()

    def __enter__(self) -> MoeauditHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
