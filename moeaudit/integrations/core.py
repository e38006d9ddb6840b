"""What a trainer callback records for moeaudit, independent of the trainer (docs/glossary.md, "Canary";
README.md, "Logging from your training loop").

A :class:`RunRecorder` owns one run directory:

* ``metrics.jsonl`` — at every ``every``-th optimizer step, the per-expert gradient norms of
  that step's gradient (:class:`moeaudit.integrations.hooks.ExpertGradLogger`) and its training loss;
* ``canary.safetensors`` — the canary, written once (never replaced by a different one);
* ``canary_probe.jsonl`` — at each checkpoint save, the gradient norms of the canary loss
  under the saved weights (optional, ``probe=True``): the quantity a replay measures.

Step numbers are optimizer steps counted from 1, so the line for step N is the gradient that
turned ``checkpoint-(N-1)`` into ``checkpoint-N`` (the convention of the README's loop).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moeaudit import canary as canary_mod
from moeaudit.canary import Canary
from moeaudit.errors import CanaryError, InputError
from moeaudit.integrations.gradnorms import Readback, Sums
from moeaudit.integrations.hooks import ExpertGradLogger, low_precision
from moeaudit.integrations.online import OnlineEnvelope
from moeaudit.integrations.summary import RoutingCounts, Summary
from moeaudit.metrics import read_metrics
from moeaudit.policy import EnvelopeSettings, Policy, load_policy
from moeaudit.run import PROBE_FILE

log = logging.getLogger("moeaudit")

CANARY_FILE = "canary.safetensors"
EVENTS_FILE = "events.jsonl"


def load_canary(canary: Canary | str | Path | None) -> Canary | None:
    return canary if canary is None or isinstance(canary, Canary) else canary_mod.load(canary)


def envelope_settings(envelope: EnvelopeSettings | Policy | str | Path | None) -> EnvelopeSettings:
    """The online rules' constants: given, from a policy (file), or the built-in policy's."""
    if envelope is None:
        return EnvelopeSettings()
    if isinstance(envelope, EnvelopeSettings):
        return envelope
    if isinstance(envelope, Policy):
        return envelope.envelope
    return load_policy(envelope).envelope


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model in ``module``: itself, or its one direct child with a
    ``save_pretrained`` and a ``config`` (a LightningModule wrapping a transformers model)."""
    if hasattr(module, "save_pretrained") and hasattr(module, "config"):
        return module
    found = [m for m in module.children() if hasattr(m, "save_pretrained") and hasattr(m, "config")]
    if len(found) != 1:
        raise InputError(
            f"{type(module).__name__} holds {len(found)} Hugging Face models; expected "
            "exactly one direct submodule with save_pretrained() and a config",
            hint="pass the model with model=...",
        )
    return found[0]


class RunRecorder:
    """Writes the run's moeaudit logs on rank 0. Other ranks write nothing; with sharded
    (DTensor) gradients they take part in the one ``all_reduce`` of the squared norms, so every
    rank must call :meth:`log_step` and :meth:`probe` at the same steps.

    ``total``: plan the global gradient norm too (a trainer's clipping decision reads it).
    ``envelope``: the constants of the online rules (:mod:`moeaudit.integrations.online`;
    default: the built-in policy's). ``routing``: count routed tokens for the tracker scalars
    (:mod:`moeaudit.integrations.summary`). ``defer``: :meth:`log_step` stops the host never
    (its lines are written once their numbers are back; :meth:`flush`)."""

    def __init__(
        self,
        run_dir: str | Path,
        model: torch.nn.Module,
        *,
        canary: Canary | None,
        every: int,
        probe: bool,
        resume_step: int | None,
        rank_zero: bool = True,
        total: bool = False,
        envelope: EnvelopeSettings | None = None,
        routing: bool = True,
        defer: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.model = model
        self.canary = canary
        self.probe_enabled = probe and canary is not None
        self.active = rank_zero
        self.meter = LossMeter()
        self.settings = envelope if envelope is not None else EnvelopeSettings()
        self.summary = Summary()
        self.monitor: OnlineEnvelope | None = None
        self.defer = defer  # log_step's default: the line written once its numbers are back
        self._readback = Readback()  # deferred lines
        self.routing: RoutingCounts | None = None
        if rank_zero and canary is not None:
            config = getattr(model, "config", None)
            vocab = getattr(config, "vocab_size", None)
            if isinstance(vocab, int):
                canary.check_vocab(vocab, where=type(model).__name__)
            context = getattr(config, "max_position_embeddings", None)
            canary.check_context({"max_position_embeddings": context}, where=type(model).__name__)
            self._check_canary(canary)
        if rank_zero and self.probe_enabled:
            low = low_precision(model)
            if low:  # mixed precision keeps float32 weights, and the probe turns autocast off
                log.warning(
                    "moeaudit: the model's weights are %s, so the canary probe computes in %s while a replay computes "
                    "in float32: probe and replay agree only to that rounding (each probe line records "
                    '"precision"; `moeaudit envelope --compare` shows how far); keep float32 weights and train in '
                    "mixed precision for a probe that matches",
                    low,
                    low,
                )
        if rank_zero and resume_step is None:
            for name in ("metrics.jsonl", PROBE_FILE):
                _refuse_earlier_log(self.run_dir / name)
        self.logger = ExpertGradLogger(
            self.run_dir / "metrics.jsonl",
            model,
            every=every,
            resume_step=resume_step,
            total=total,
            rank_zero=rank_zero,
        )
        # frozen routed experts (a PEFT adapter's base): a training step gives them no gradient, so
        # no per-step line; the probe measures them (docs/decisions.md, "PEFT / LoRA fine-tunes")
        self.per_step = not self.logger.frozen
        if self.logger.unthawable:
            raise InputError(
                f"routed-expert weights are frozen and stored as {'/'.join(self.logger.unthawable)} (a quantized "
                "base, e.g. QLoRA): no gradient can be taken by them, so moeaudit has nothing to log for this model",
                hint="train without the moeaudit callback and audit merged full-precision checkpoints afterwards",
            )
        if rank_zero and not self.per_step:
            log.warning(
                "moeaudit: %d routed-expert weight tensors are frozen (a PEFT/LoRA fine-tune?): a training step "
                "gives them no gradient, so metrics.jsonl is not written%s",
                self.logger.frozen,
                "; the canary probe logs their gradient at each save (canary_probe.jsonl)"
                if self.probe_enabled
                else " and nothing is logged: pass a canary for the probe at each save",
            )
        if rank_zero and canary is not None:  # only once the model is known to be one we read
            self._save_canary(canary)
        if rank_zero:
            if resume_step is not None:
                self._declare_resume(resume_step)
            self.monitor = OnlineEnvelope(self.settings, every=every)
            self._prime(resume_step)
            self.routing = RoutingCounts(model, self.logger.layers) if routing and self.per_step else None

    def _declare_resume(self, step: int) -> None:
        """The resume in ``events.jsonl``: the logs were rewound to ``step``, and saves above it
        belong to the branch it abandoned, which certify names (docs/decisions.md, "Abandoned
        checkpoints"). A resume at ``step`` that is already the file's last line is not repeated."""
        path = self.run_dir / EVENTS_FILE
        raw = path.read_bytes() if path.is_file() else b""
        last = next((ln for ln in reversed(raw.splitlines()) if ln.strip()), b"")
        try:
            previous = json.loads(last) if last else None
        except ValueError:
            previous = None
        if isinstance(previous, dict) and previous.get("step") == step and previous.get("event") == "resume":
            return
        event = {"step": step, "event": "resume", "note": f"training resumed from step {step} (moeaudit callback)"}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write((b"\n" if raw and not raw.endswith(b"\n") else b"") + json.dumps(event).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def _prime(self, resume_step: int | None) -> None:
        """On resume, replay the kept lines into the online rules (no events raised again)."""
        path = self.logger.path
        if resume_step is None or self.monitor is None or not path.is_file():
            return
        try:
            series = read_metrics(path)
        except InputError as exc:
            log.warning("moeaudit: online envelope rules start afresh: %s", exc.diagnostics())
            return
        for j, step in enumerate(series.steps):
            self.monitor.push(step, {k: v[j] for k, v in series.norms.items()})
        self.monitor.events.clear()

    def _check_canary(self, canary: Canary) -> None:
        """An existing different canary in the run is an error."""
        path = self.run_dir / CANARY_FILE
        if path.exists():
            existing = canary_mod.load(path)
            if existing.digest != canary.digest:
                raise CanaryError(
                    f"the run already holds a different canary (sha256:{existing.digest[:16]}…, "
                    f"this one sha256:{canary.digest[:16]}…)",
                    path=path,
                    hint="use the run's canary, or a new output directory",
                )

    def _save_canary(self, canary: Canary) -> None:
        """Write the canary into the run once (:meth:`_check_canary` has compared an existing one)."""
        path = self.run_dir / CANARY_FILE
        if not path.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            canary_mod.save(canary, path)

    def due(self, step: int) -> bool:
        return self.logger.due(step)

    def log_step(
        self,
        step: int,
        loss: torch.Tensor | float | None = None,
        *,
        extra_of: Callable[[Sums], dict[str, Any]] | None = None,
        defer: bool | None = None,
        **extra: Any,
    ) -> dict[str, Any] | None:
        """The metrics line of optimizer step ``step`` from the parameters' ``.grad`` now and
        ``loss`` (default: what the meter saw; null when none was seen); ``extra``: more fields
        for the line as given (a hand-written loop's ``ce_loss=…, aux_loss=…``, as before);
        ``extra_of(sums)``: more fields from the same pass (the transformers callback's
        ``clipped``). One host sync: the norms, the loss and the routing counts come back
        together.

        ``defer`` (default: the recorder's ``defer``): no host sync at all — the numbers are
        reduced on the device now and copied back behind the step's kernels
        (:class:`~moeaudit.integrations.gradnorms.Readback`); the line is written by a later
        call once its copy has landed (normally the next step's), or by :meth:`flush` (also run
        by :meth:`scalars`, :meth:`sync` and :meth:`close`: the trainer's log and save steps).
        Returns None then."""
        if callable(loss):  # the earlier positional form log_step(step, extra_of)
            extra_of, loss = loss, None
        if not self.per_step or not self.due(step) or not (self.active or self.logger.collective):
            self.meter.clear()
            return None
        layers, counts, tokens = self.routing.take() if self.routing is not None else ([], [], {})
        if loss is None:
            loss = self.meter.take_tensor()
        else:
            self.meter.clear()
            loss = torch.as_tensor(loss).detach().reshape(())
        extras = [*counts, *([] if loss is None else [loss])]
        line = _Line(step, [x.numel() for x in extras], layers, tokens, loss is not None, extra, extra_of)
        if not (self.defer if defer is None else defer):
            return self._write(line, self.logger.measure(extras=extras))
        self._readback.push(self.logger.vector(extras), line)
        self._drain(wait=False)
        return None

    def flush(self) -> list[dict[str, Any]]:
        """Write every deferred line now (one host sync when any is still in flight)."""
        return self._drain(wait=True)

    def _drain(self, wait: bool) -> list[dict[str, Any]]:
        out = []
        for values, line in self._readback.ready(wait):
            record = self._write(line, self.logger.unpack(values, line.sizes))
            if record is not None:
                out.append(record)
        return out

    def _write(self, line: _Line, sums: Sums) -> dict[str, Any] | None:
        n = len(line.layers)
        loss_value = sums.extras[n][0] if line.has_loss else math.nan
        fields = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in line.extra.items()}
        more = line.extra_of(sums) if line.extra_of else {}
        record = self.logger.write(line.step, loss_value, sums, **fields, **more)
        if record is None or self.monitor is None:
            return record
        for event in self.monitor.push(line.step, record["expert_grad_norms"]):
            log.warning(event.message())
        if self.routing is not None:
            self.summary.add_counts(line.layers, sums.extras[:n], line.tokens, self.routing.k)
        self.summary.update(record, self.monitor.margins, len(self.monitor.events), self.settings.starve_share)
        return record

    def scalars(self) -> dict[str, float]:
        """The tracker scalars now (``moe/layer_3/pi_min`` …); routing counts start afresh."""
        self.flush()
        return self.summary.take() if self.active else {}

    def sync(self) -> None:
        """A checkpoint save: every line logged so far written and made durable (fsync)."""
        self.flush()
        self.logger.sync()

    def probe(self, step: int) -> dict[str, Any] | None:
        """The canary probe line for the weights saved at ``step`` (eval mode, no aux loss)."""
        if not self.probe_enabled or not (self.active or self.logger.collective):
            return None
        assert self.canary is not None
        was_training = self.model.training
        self.model.eval()
        self.meter.paused = True
        if self.routing is not None:
            self.routing.paused = True
        try:
            with torch.enable_grad(), self.logger.probe_scope(), float32_forward(self.model):
                loss = canary_loss(self.model, self.canary)
                return self.logger.probe(step, loss, canary=self.canary.digest)
        finally:
            self.meter.paused = False
            if self.routing is not None:
                self.routing.paused = False
            self.model.train(was_training)

    def close(self) -> None:
        self.flush()
        if self.routing is not None:
            self.routing.remove()
        self.logger.close()


def _refuse_earlier_log(path: Path) -> None:
    """A run starting from step 0 where ``path`` already logs an earlier run: its step 1 would
    follow that run's last step, a log certify refuses as out of order — after the training."""
    if not path.is_file():
        return
    last = next((ln for ln in reversed(path.read_bytes().splitlines()) if ln.strip()), None)
    if last is None:
        return
    try:
        step = json.loads(last).get("step")
    except (ValueError, AttributeError):
        step = None
    raise InputError(
        f"{path.name} already holds the log of an earlier run (last step {step}), and this run starts at step 0",
        path=path.parent,
        hint="resume from one of its checkpoints (resume_from_checkpoint / ckpt_path / resume_step), "
        "or train into a new directory",
    )


@dataclass
class _Line:
    """What a metrics line needs besides the numbers that are still on their way back."""

    step: int
    sizes: list[int]  # the extras' numel: routing counts per layer, then the loss
    layers: list[int]
    tokens: dict[int, int]
    has_loss: bool
    extra: dict[str, Any]
    extra_of: Callable[[Sums], dict[str, Any]] | None


@contextmanager
def float32_forward(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` without autocast, as a replay computes it: an enclosing autocast is turned
    off, and so is the mixed-precision forward accelerate installs on the model itself (the
    Trainer's ``bf16=True`` wraps ``model.forward`` in autocast and keeps the original as
    ``_original_forward``), restored on exit."""
    original = model.__dict__.get("_original_forward")
    wrapped = model.__dict__.get("forward")
    if original is not None:
        model.forward = original
    try:
        with torch.autocast(next(model.parameters()).device.type, enabled=False):
            yield
    finally:
        if original is not None:
            if wrapped is None:
                del model.forward
            else:
                model.forward = wrapped


def canary_loss(model: torch.nn.Module, canary: Canary) -> torch.Tensor:
    """Mean next-token NLL over every canary window (docs/glossary.md, "Replay"), from the model's logits, so
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
        self._values: list[torch.Tensor] = []  # on the device: read only on a logged step
        self._shares = False
        self.paused = False

    def hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        loss = getattr(output, "loss", None)
        if self.paused or not torch.is_grad_enabled() or not isinstance(loss, torch.Tensor):
            return
        self._values.append(loss.detach().reshape(()))
        self._shares = kwargs.get("num_items_in_batch") is not None

    @property
    def shares(self) -> bool:
        """The last loss seen was normalised by ``num_items_in_batch`` (a share of the step's)."""
        return self._shares

    def take_tensor(self) -> torch.Tensor | None:
        """The step's loss as a float64 device scalar (no host sync), or None if none was seen."""
        values, self._values = self._values, []
        if not values:
            return None
        total = torch.stack([v.to(values[0].device, torch.float64) for v in values]).sum()
        return total if self._shares else total / len(values)

    def take(self) -> float | None:
        loss = self.take_tensor()
        return None if loss is None else float(loss)

    def clear(self) -> None:
        self._values = []
