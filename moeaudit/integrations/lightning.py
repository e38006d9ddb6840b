"""A Lightning ``Callback`` that writes what ``moeaudit certify`` reads, checkpoints included.

    from moeaudit.integrations.lightning import MoeauditCallback

    trainer = L.Trainer(max_steps=6000, default_root_dir="runs/a",
                        callbacks=[MoeauditCallback(canary="canary.safetensors", save_every=500)])
    trainer.fit(module)            # a LightningModule holding one transformers MoE model
    # moeaudit certify runs/a --canary runs/a/canary.safetensors

Lightning's own ``.ckpt`` files are pickles, which moeaudit never reads (docs/security.md), so
the callback saves the Hugging Face model itself: every ``save_every`` optimizer steps,
``save_pretrained`` into a hidden staging directory beside ``RUN/checkpoint-<step>/``, renamed
into place when complete (a crash leaves no half-written checkpoint under the real name). The
model is ``model=`` if given, else the LightningModule itself when it is a transformers model,
else its one direct submodule that is.

The gradient is read in ``on_before_optimizer_step``, which Lightning calls after the
backward pass and *before* gradient clipping, so the norms are of the unclipped gradient; the
loss is the transformers model's own ``output.loss`` of the step's forward pass(es)
(:class:`moeaudit.integrations.core.LossMeter`). Only global rank 0 writes. The per-layer
``moe/layer_<i>/…`` scalars (:mod:`moeaudit.integrations.summary`) go to every logger of the
Trainer (``trainer.loggers``) every ``log_every_n_steps`` steps; envelope events are warnings on
the ``moeaudit`` logger when they fire.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from moeaudit.canary import Canary
from moeaudit.errors import InputError
from moeaudit.integrations.core import RunRecorder, envelope_settings, hf_model, load_canary, log
from moeaudit.policy import EnvelopeSettings, Policy


class MoeauditCallback(Callback):  # type: ignore[misc]
    """``metrics.jsonl`` every ``every`` optimizer steps, ``canary`` written once, HF checkpoints
    every ``save_every`` steps (None: the caller saves them) each followed by a canary probe
    (``probe``), all under ``run_dir`` (default: the Trainer's ``default_root_dir``)."""

    def __init__(
        self,
        canary: Canary | str | Path | None = None,
        *,
        run_dir: str | Path | None = None,
        every: int = 1,
        save_every: int | None = None,
        probe: bool = True,
        model: torch.nn.Module | None = None,
        envelope: EnvelopeSettings | Policy | str | Path | None = None,
    ):
        for name, value in (("every", every), ("save_every", save_every or 1)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.canary = load_canary(canary)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.every, self.save_every, self.probe = every, save_every, probe
        self.model = model
        self.envelope = envelope_settings(envelope)
        self.recorder: RunRecorder | None = None
        self._handle: Any = None
        self._saved: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        model = self.model if self.model is not None else hf_model(pl_module)
        self.model = model
        self.run_dir = Path(self.run_dir or trainer.default_root_dir)
        if self.save_every is not None and trainer.global_step and trainer.is_global_zero:
            _refuse_saves_above(self.run_dir, trainer.global_step)
        if self.save_every is None and trainer.is_global_zero:
            log.warning(
                "moeaudit: MoeauditCallback(save_every=None): no checkpoint-<step>/ is saved (Lightning's "
                ".ckpt pickles are not audited) and no canary probe is logged; certify needs "
                "checkpoint-<step>/ directories: pass save_every=N, or save_pretrained them yourself"
            )
        self.recorder = RunRecorder(
            self.run_dir,
            model,
            canary=self.canary,
            every=self.every,
            probe=self.probe,
            resume_step=trainer.global_step or None,
            rank_zero=trainer.is_global_zero,
            envelope=self.envelope,
        )
        self._saved = trainer.global_step
        self._handle = model.register_forward_hook(self.recorder.meter.hook, with_kwargs=True)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.recorder is None:
            return
        step = trainer.global_step + 1  # incremented by the optimizer step that follows
        self.recorder.log_step(step)
        if self.recorder.active and step % max(1, trainer.log_every_n_steps) == 0:
            scalars = self.recorder.scalars()
            for logger in trainer.loggers:  # Lightning's loggers: TensorBoard, CSV, W&B …
                logger.log_metrics(scalars, step=step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.save_every is None or step == self._saved or step % self.save_every:
            return
        self._saved = step
        if self.recorder is None:
            return
        assert self.model is not None and self.run_dir is not None
        if self.recorder.active:
            save_checkpoint(self.model, self.run_dir / f"checkpoint-{step}")
        self.recorder.probe(step)  # on every rank when the gradients are sharded
        self.recorder.sync()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.recorder is not None:
            self.recorder.close()


def _refuse_saves_above(run_dir: Path, step: int) -> None:
    """A resume from ``step`` below saves already in ``run_dir``: those are the branch the resume
    abandons, and :func:`save_checkpoint` would stop training at the first of them (it never
    overwrites), so refuse before any step is trained or any log rewound."""
    found = [(int(m[1]), p.name) for p in run_dir.glob("checkpoint-*") if (m := _STEP.fullmatch(p.name))]
    above = [name for s, name in sorted(found) if s > step]
    if above:
        raise InputError(
            f"{', '.join(above)} already saved above the resume step {step}, by the branch this "
            "resume abandons; a checkpoint is never overwritten",
            path=run_dir,
            hint="move them out of the run directory (or use a new one), then resume again",
        )


_STEP = re.compile(r"checkpoint-([0-9]+)")


def save_checkpoint(model: torch.nn.Module, target: Path) -> None:
    """``model.save_pretrained`` (safetensors) into a staging directory, renamed to ``target``
    when whole; an existing ``target`` is an error, never overwritten."""
    if target.exists():
        raise InputError(
            "a checkpoint already exists here", path=target, hint="use a new run directory, or resume from this step"
        )
    staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, safe_serialization=True)  # type: ignore[operator]
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
