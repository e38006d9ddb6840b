"""A ``transformers.TrainerCallback`` that writes what ``moeaudit certify`` reads.

    from moeaudit.integrations.transformers import MoeauditCallback

    trainer = Trainer(model=model, args=TrainingArguments(output_dir="runs/a", save_steps=500),
                      train_dataset=data, callbacks=[MoeauditCallback(canary="canary.safetensors")])
    trainer.train()
    # moeaudit certify runs/a --canary runs/a/canary.safetensors

The Trainer itself saves ``runs/a/checkpoint-<step>/`` with ``save_pretrained`` (docs/decisions.md, "Checkpoints");
the callback adds ``metrics.jsonl``, ``canary.safetensors`` and ``canary_probe.jsonl``
(:mod:`moeaudit.integrations.core`).

The gradient is read in ``on_pre_optimizer_step``, the last point the Trainer exposes before
the update — *after* its gradient clipping (``max_grad_norm``, default 1.0). Clipping scales
every gradient by the same factor, so the normalised variance is unchanged, but the raw one
shrinks by its square on clipped steps: each line records ``clipped`` (the post-clip global
norm reached ``max_grad_norm``) so a reader can tell (docs/decisions.md). That global norm is the
sum of the per-parameter squared norms of the same fused pass over every gradient — no second
pass (docs/decisions.md, "No host sync on a Trainer step").

Under ``torch.distributed`` (DDP) the line's ``loss`` is the loss the Trainer logs for the step —
its own scaling by the data-parallel world size under ``average_tokens_across_devices`` and its
mean over ranks, one ``all_reduce`` on every rank at each logged step — not rank 0's share of it
(docs/decisions.md, "Distributed training").

Tracker: the callback moves itself ahead of the ``report_to`` integrations when the Trainer
first calls it (:mod:`moeaudit.integrations.ordering`; ``.attach(trainer)`` does the same
explicitly), so its ``on_log`` adds ``moe/layer_<i>/…`` scalars
(:mod:`moeaudit.integrations.summary`) to each training log before TensorBoard, W&B … write
it; they also land in ``log_history``. Where it cannot, it warns once. Envelope
events are logged as warnings on the ``moeaudit`` logger when they fire.

No host synchronisation on a training step: the pass is queued on the gradients' device and its
one vector copied back behind the step's kernels; the line is written when that copy has landed
(normally during the next step) and every pending line at the Trainer's log and save steps and at
the end of training (``RunRecorder(defer=True)``; docs/benchmarks.md §7). A process killed
between two log steps loses the lines still in flight: normally its last step's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from moeaudit.canary import Canary
from moeaudit.integrations.core import RunRecorder, envelope_settings, load_canary, log
from moeaudit.integrations.gradnorms import Sums
from moeaudit.integrations.ordering import lead
from moeaudit.policy import EnvelopeSettings, Policy

CLIP_TOLERANCE = 1e-3  # relative: torch clips to max_norm / (norm + 1e-6), just under max_norm


class MoeauditCallback(TrainerCallback):  # type: ignore[misc]
    """Log per-expert gradient norms every ``every`` optimizer steps to
    ``<output_dir>/metrics.jsonl``; write ``canary`` (a file or :class:`Canary`) into the
    output directory once and, with ``probe`` (default), its gradient norms at every save.
    ``envelope``: the constants of the online rules (a policy file, a :class:`Policy`, or its
    ``EnvelopeSettings``; default the built-in policy). The per-layer scalars go through the
    Trainer's logging path to every ``report_to`` tracker: the callback runs first (it moves
    itself there; :meth:`attach` does it explicitly)."""

    def __init__(
        self,
        canary: Canary | str | Path | None = None,
        *,
        every: int = 1,
        probe: bool = True,
        envelope: EnvelopeSettings | Policy | str | Path | None = None,
    ):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.canary = load_canary(canary)
        self.every = every
        self.probe = probe
        self.envelope = envelope_settings(envelope)
        self.recorder: RunRecorder | None = None
        self._handle: Any = None
        self._model: torch.nn.Module | None = None
        self._leads = False

    def attach(self, trainer: Any) -> MoeauditCallback:
        """Put this callback first among ``trainer``'s callbacks, so the ``moe/…`` scalars it
        adds to each training log reach every ``report_to`` integration (TensorBoard, W&B,
        MLflow …) that logs the same dict after it. Returns the callback."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._leads = lead(self)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kwargs: Any
    ) -> None:
        self._leads = lead(self) or self._leads  # added after __init__ (add_callback): placed now
        if not self._leads and _trackers(args):
            log.warning(
                "MoeauditCallback is not ahead of the report_to integrations %s: its moe/ scalars "
                "reach log_history only; call MoeauditCallback(...).attach(trainer)",
                _trackers(args),
            )
        if model is None:
            raise ValueError("MoeauditCallback needs the Trainer's model")
        self.recorder = RunRecorder(
            args.output_dir,
            model,
            canary=self.canary,
            every=self.every,
            probe=self.probe,
            resume_step=state.global_step or None,
            rank_zero=state.is_world_process_zero,
            total=True,
            envelope=self.envelope,
            defer=True,  # no host sync on a step: lines are written once their numbers are back
        )
        self._handle = model.register_forward_hook(self.recorder.meter.hook, with_kwargs=True)
        self._model = model

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is None:
            return
        max_norm = args.max_grad_norm or 0.0
        step = state.global_step + 1  # the Trainer increments after the update
        loss = self._reported_loss(args, step)
        self.recorder.log_step(step, loss, extra_of=lambda sums: {"clipped": _clipped(sums, max_norm)})

    def _reported_loss(self, args: Any, step: int) -> torch.Tensor | None:
        """Under ``torch.distributed``, the loss the Trainer logs for this step, on every rank
        (one ``all_reduce``); None in one process, where the meter's value is that loss.

        The Trainer's ``compute_loss`` multiplies a loss normalised by the step's token count
        across devices (``average_tokens_across_devices``, its default) by the number of data
        ranks, and its log is the mean over ranks (``nested_gather(tr_loss).mean()``): the
        global token-mean loss. The model's own output on one rank is only that rank's share
        of it (half of it on two ranks), so rank 0's meter alone cannot be logged
        (docs/decisions.md, "The training loss under distributed training")."""
        recorder = self.recorder
        assert recorder is not None
        dist = torch.distributed
        if not recorder.due(step) or not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        if world < 2:
            return None
        shares = recorder.meter.shares
        local = recorder.meter.take_tensor()
        device = local.device if local is not None else torch.device(args.device)
        value = torch.full((1,), math.nan, dtype=torch.float64, device=device) if local is None else local.reshape(1)
        if shares and getattr(args, "average_tokens_across_devices", False):
            tp = getattr(self._model, "_tp_size", None) or 1
            value = value * (world // tp)
        dist.all_reduce(value)
        return value[0] / world

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Add the ``moe/…`` scalars to a training log (the dict every later callback reports)
        and to its ``log_history`` entry (``trainer_state.json``)."""
        if self.recorder is None or logs is None or "loss" not in logs:
            return  # evaluation and summary logs carry no training scalars
        scalars = self.recorder.scalars()
        logs.update(scalars)
        last = state.log_history[-1] if state.log_history else None
        if isinstance(last, dict) and last.get("step") == state.global_step and "loss" in last:
            last.update(scalars)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.probe(state.global_step)
            self.recorder.sync()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.recorder is not None:
            self.recorder.close()


def _trackers(args: Any) -> list[str]:
    """The ``report_to`` integrations named in the Trainer's arguments."""
    report_to = getattr(args, "report_to", None) or []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    return [n for n in names if n != "none"]


def _clipped(sums: Sums, max_norm: float) -> bool:
    """Whether the Trainer's clipping scaled this step's gradient: the post-clip global norm,
    from the per-parameter squared norms of the same pass, reached ``max_norm``."""
    if max_norm <= 0 or sums.total is None:
        return False
    return math.sqrt(sums.total) >= max_norm * (1 - CLIP_TOLERANCE)
