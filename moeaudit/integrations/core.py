"""What a trainer callback records for moeaudit, independent of the trainer (SPEC §2.2-2.3).

A :class:`RunRecorder` owns one run directory:

* ``metrics.jsonl`` — at every ``every``-th optimizer step, the per-expert gradient norms of
  that step's gradient (:class:`moeaudit.hooks.ExpertGradLogger`) and its training loss;
* ``canary.safetensors`` — the canary, written once (never replaced by a different one);
* ``canary_probe.jsonl`` — at each checkpoint save, the gradient norms of the canary loss
  under the saved weights (optional, ``probe=True``): the quantity a replay measures.

Step numbers are optimizer steps counted from 1, so the line for step N is the gradient that
turned ``checkpoint-(N-1)`` into ``checkpoint-N`` (the convention of the README's loop).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moeaudit import canary as canary_mod
from moeaudit.canary import Canary
from moeaudit.errors import CanaryError, InputError
from moeaudit.hooks import ExpertGradLogger

CANARY_FILE = "canary.safetensors"


def load_canary(canary: Canary | str | Path | None) -> Canary | None:
    return canary if canary is None or isinstance(canary, Canary) else canary_mod.load(canary)


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model in ``module``: itself, or its one direct child with a
    ``save_pretrained`` and a ``config`` (a LightningModule wrapping a transformers model)."""
    if hasattr(module, "save_pretrained") and hasattr(module, "config"):
        return module
    found = [m for m in module.children() if hasattr(m, "save_pretrained") and hasattr(m, "config")]
    if len(found) != 1:
        raise InputError(f"{type(module).__name__} holds {len(found)} Hugging Face models; expected "
                         "exactly one direct submodule with save_pretrained() and a config",
                         hint="pass the model with model=...")
    return found[0]


class RunRecorder:
    """Writes the run's moeaudit logs; every method is a no-op on a non-zero rank."""

    def __init__(self, run_dir: str | Path, model: torch.nn.Module, *, canary: Canary | None,
                 every: int, probe: bool, resume_step: int | None, rank_zero: bool = True):
        self.run_dir = Path(run_dir)
        self.model = model
        self.canary = canary
        self.probe_enabled = probe and canary is not None
        self.active = rank_zero
        self.logger: ExpertGradLogger | None = None
        self.meter = LossMeter()
        if not rank_zero:
            return
        if canary is not None:
            vocab = getattr(getattr(model, "config", None), "vocab_size", None)
            if isinstance(vocab, int):
                canary.check_vocab(vocab, where=type(model).__name__)
            self._save_canary(canary)
        self.logger = ExpertGradLogger(self.run_dir / "metrics.jsonl", model, every=every,
                                       resume_step=resume_step)

    def _save_canary(self, canary: Canary) -> None:
        """Write the canary into the run once; an existing different canary is an error."""
        path = self.run_dir / CANARY_FILE
        if path.exists():
            existing = canary_mod.load(path)
            if existing.digest != canary.digest:
                raise CanaryError(f"the run already holds a different canary (sha256:{existing.digest[:16]}…, "
                                  f"this one sha256:{canary.digest[:16]}…)", path=path,
                                  hint="use the run's canary, or a new output directory")
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        canary_mod.save(canary, path)

    def due(self, step: int) -> bool:
        return self.logger is not None and self.logger.due(step)

    def log_step(self, step: int, loss: float | None, **extra: Any) -> dict[str, Any] | None:
        """The metrics line of optimizer step ``step`` from the parameters' ``.grad`` now
        (a loss that was not seen is written as null)."""
        if self.logger is None:
            return None
        return self.logger.log(step, math.nan if loss is None else loss, **extra)

    def probe(self, step: int) -> dict[str, Any] | None:
        """The canary probe line for the weights saved at ``step`` (eval mode, no aux loss)."""
        if self.logger is None or not self.probe_enabled:
            return None
        assert self.canary is not None
        was_training = self.model.training
        self.model.eval()
        self.meter.paused = True
        try:
            with torch.enable_grad():
                loss = canary_loss(self.model, self.canary)
            return self.logger.probe(step, loss, canary=self.canary.digest)
        finally:
            self.meter.paused = False
            self.model.train(was_training)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


def canary_loss(model: torch.nn.Module, canary: Canary) -> torch.Tensor:
    """Mean next-token NLL over every canary window (SPEC §3), from the model's logits, so
    router auxiliary losses never enter it."""
    device = next(model.parameters()).device
    tokens_WT = canary.tokens.to(device=device, dtype=torch.long)
    logits_WTV = model(input_ids=tokens_WT).logits
    V = logits_WTV.shape[-1]
    return F.cross_entropy(logits_WTV[:, :-1].reshape(-1, V).float(), tokens_WT[:, 1:].reshape(-1))


class LossMeter:
    """The training loss of one optimizer step from the model's forward outputs.

    A micro-batch loss normalised by ``num_items_in_batch`` (the Trainer's token-count
    normalisation across gradient accumulation) is a share of the step's loss and is summed;
    a per-micro-batch mean is averaged. Forward passes without autograd (evaluation) and the
    canary probe (``paused``) are not training steps and are not counted."""

    def __init__(self) -> None:
        self._values: list[float] = []
        self._shares = False
        self.paused = False

    def hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        loss = getattr(output, "loss", None)
        if self.paused or not torch.is_grad_enabled() or not isinstance(loss, torch.Tensor):
            return
        self._values.append(float(loss.detach()))
        self._shares = kwargs.get("num_items_in_batch") is not None

    def take(self) -> float | None:
        values, self._values = self._values, []
        if not values:
            return None
        return math.fsum(values) if self._shares else math.fsum(values) / len(values)
