"""A ``transformers.TrainerCallback`` that writes what ``moeaudit certify`` reads.

    from moeaudit.integrations.transformers import MoeauditCallback

    trainer = Trainer(model=model, args=TrainingArguments(output_dir="runs/a", save_steps=500),
                      train_dataset=data, callbacks=[MoeauditCallback(canary="canary.safetensors")])
    trainer.train()
    # moeaudit certify runs/a --canary runs/a/canary.safetensors

The Trainer itself saves ``runs/a/checkpoint-<step>/`` with ``save_pretrained`` (SPEC §2.1);
the callback adds ``metrics.jsonl``, ``canary.safetensors`` and ``canary_probe.jsonl``
(:mod:`moeaudit.integrations.core`).

The gradient is read in ``on_pre_optimizer_step``, the last point the Trainer exposes before
the update — *after* its gradient clipping (``max_grad_norm``, default 1.0). Clipping scales
every gradient by the same factor, so the normalised variance is unchanged, but the raw one
shrinks by its square on clipped steps: each line records ``clipped`` (the post-clip global
norm reached ``max_grad_norm``) so a reader can tell (docs/decisions.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from moeaudit.canary import Canary
from moeaudit.integrations.core import RunRecorder, load_canary

CLIP_TOLERANCE = 1e-3  # relative: torch clips to max_norm / (norm + 1e-6), just under max_norm


class MoeauditCallback(TrainerCallback):  # type: ignore[misc]
    """Log per-expert gradient norms every ``every`` optimizer steps to
    ``<output_dir>/metrics.jsonl``; write ``canary`` (a file or :class:`Canary`) into the
    output directory once and, with ``probe`` (default), its gradient norms at every save."""

    def __init__(self, canary: Canary | str | Path | None = None, *, every: int = 1,
                 probe: bool = True):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.canary = load_canary(canary)
        self.every = every
        self.probe = probe
        self.recorder: RunRecorder | None = None
        self._handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise ValueError("MoeauditCallback needs the Trainer's model")
        self.recorder = RunRecorder(args.output_dir, model, canary=self.canary, every=self.every,
                                    probe=self.probe, resume_step=state.global_step or None,
                                    rank_zero=state.is_world_process_zero)
        self._handle = model.register_forward_hook(self.recorder.meter.hook, with_kwargs=True)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                              model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        loss = self.recorder.meter.take() if self.recorder is not None else None
        step = state.global_step + 1  # the Trainer increments after the update
        if self.recorder is None or not self.recorder.due(step):
            return
        max_norm = args.max_grad_norm or 0.0
        clipped = max_norm > 0 and model is not None and _clipped(model, max_norm)
        self.recorder.log_step(step, loss, clipped=clipped)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.probe(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.recorder is not None:
            self.recorder.close()


def _clipped(model: torch.nn.Module, max_norm: float) -> bool:
    """Whether the Trainer's clipping scaled this step's gradient (the post-clip global norm
    over all parameters reached ``max_norm``)."""
    sq = math.fsum(float(p.grad.detach().double().pow(2).sum()) for p in model.parameters()
                   if p.grad is not None)  # floats: parameters may sit on several devices
    return math.sqrt(sq) >= max_norm * (1 - CLIP_TOLERANCE)
