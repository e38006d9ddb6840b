"""A training hook that logs per-expert gradient norms to ``metrics.jsonl`` (docs/envelope.md, "Reading
`metrics.jsonl`").

Attach an :class:`ExpertGradLogger` to a training loop and call :meth:`~ExpertGradLogger.log`
right after ``loss.backward()`` (before clipping and ``optimizer.step()``). On every K-th step
it appends one line::

    {"step": 500, "loss": 2.31,
     "expert_grad_norms": {"<layer>": [g_0, ..., g_{E-1}]},
     "router_grad_norms": {"<layer>": g_router},
     "shared_grad_norms": {"<layer>": g_shared},      # only for models with a shared expert
     ...extra fields...}

``g_e = ‖∇_{θ_e} L‖₂`` over all of expert e's weights (`000` Def. 6.1): one fused pass over the
gradients on their device, float32 norms of runs of 16384 values added in float64
(relative error ≤ 1e-6), one host sync per logged line (:mod:`moeaudit.integrations.gradnorms`).
A parameter without a gradient (frozen, or an expert that saw no token) counts as 0.
Non-finite numbers are written as ``null`` and named under ``"nonfinite"`` (README.md, "Schemas").

The logger reads parameters from either

* our own loop: a sequence of :class:`~moeaudit.checkpoint.LayerWeights`, or
* any ``torch.nn.Module`` (or ``named_parameters()`` pairs) in a family of
  :mod:`moeaudit.families` — per-expert modules (transformers v4, our on-disk
  layout) or fused ``experts.gate_up_proj [E,2I,H]`` / ``experts.down_proj [E,H,I]``
  (transformers v5). Parameter names are matched with regexes generated from the layout
  key templates, so a new family needs a layout table, not code here.

Each line reaches the kernel before :meth:`log` returns (a dead process loses none); lines are
fsynced at :meth:`~ExpertGradLogger.sync` (call it at checkpoint saves; :meth:`probe` does), on
close, at exit and on SIGTERM/SIGINT, so a crash of the machine loses at most the lines since
the last sync (:mod:`moeaudit.integrations.linelog`); a torn last line is dropped when the file
is reopened. Under ``torch.distributed`` only rank 0 writes.

**Canary probe** (:meth:`~ExpertGradLogger.probe`, optional): at save steps, the same norms of
the *canary* loss — the quantity ``moeaudit`` replays from the checkpoint — appended to
``canary_probe.jsonl`` next to ``metrics.jsonl``, in the same line format plus the canary's
digest. The training batches and the canary are different data: the per-step log says what
the training gradient did, the probe what a replay of that checkpoint will say
(docs/envelope.md, "Three sources").
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.errors import InputError
from moeaudit.families import FAMILIES
from moeaudit.integrations.gradnorms import GradOf, NormPass, Sums, dot_grad
from moeaudit.integrations.linelog import LineLog, repair
from moeaudit.run import PROBE_FILE  # the probe's log, next to metrics.jsonl
from moeaudit.spec.layouts import Layout

SHARED_NAMES = ("shared_w1", "shared_w3", "shared_w2", "shared_gate")
ROUTER_NAMES = ("router", "router_logit_bias")  # gpt-oss: the router is a biased linear layer


# --- parameter name → role, from the layout tables ----------------------------------------------


@dataclass(frozen=True)
class _Pattern:
    role: str  # "expert" | "fused" | "router" | "shared"
    regex: re.Pattern[str]


def template_regex(template: str) -> re.Pattern[str]:
    """``model.layers.{layer}.….{expert}.w1.weight`` → a regex with ``layer``/``expert`` groups.

    The leading ``model.`` is optional and any module prefix is allowed (a bare base model,
    DDP's ``module.``, PEFT's ``base_model.model.``), so we match on a dotted suffix.
    """
    body = re.escape(template.removeprefix("model."))
    body = body.replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(r"(?:^|\.)" + body + "$")


def layout_patterns(layouts: Iterable[Layout]) -> list[_Pattern]:
    """Regexes for every expert, fused-expert, router and shared-expert template."""
    seen: dict[str, _Pattern] = {}
    for layout in layouts:
        tables: list[tuple[str, list[tuple[str, ...]]]] = [
            ("expert", list(layout.expert.values())),
            ("fused", list(layout.fused.values())),
            ("router", [layout.layer[n] for n in ROUTER_NAMES if n in layout.layer]),
            ("shared", [layout.layer[n] for n in SHARED_NAMES if n in layout.layer]),
        ]
        for role, template_lists in tables:
            for templates in template_lists:
                for t in templates:
                    seen.setdefault(t, _Pattern(role, template_regex(t)))
    return list(seen.values())


# --- what the logger reads -----------------------------------------------------------------------


@dataclass
class _LayerParams:
    experts: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # expert → tensors
    fused: list[torch.Tensor] = field(default_factory=list)  # [E, ...] tensors
    router: list[torch.Tensor] = field(default_factory=list)
    shared: list[torch.Tensor] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        own = [t for ts in self.experts.values() for t in ts]
        return own + self.fused + self.router + self.shared

    def num_experts(self) -> int:
        sizes = {t.shape[0] for t in self.fused}
        if self.experts:
            sizes.add(max(self.experts) + 1)
        if len(sizes) != 1:
            raise InputError(f"inconsistent expert counts {sorted(sizes)} within one layer")
        return sizes.pop()


Source = torch.nn.Module | Sequence[LayerWeights] | Iterable[tuple[str, torch.Tensor]]


def _from_layer_weights(layers: Sequence[LayerWeights]) -> dict[int, _LayerParams]:
    out = {}
    for lw in layers:
        if not lw.routed:
            continue
        lp = _LayerParams()
        # LongCat's zero-computation experts (no weights, the last indices) have no gradient norm
        lp.experts = {e: list(w.values()) for e, w in enumerate(lw.experts) if w}
        lp.router = [lw.params[n] for n in ROUTER_NAMES if n in lw.params]
        lp.shared = [lw.params[n] for n in SHARED_NAMES if n in lw.params]
        out[lw.layer] = lp
    return out


# PEFT wraps a module it adapts and keeps the weight under ``<module>.base_layer.`` (LoRA on a
# Linear, or ``target_parameters`` on fused experts: one ``base_layer`` per targeted tensor), and a
# ``modules_to_save`` module as ``<module>.modules_to_save.<adapter>.`` beside the unused
# ``<module>.original_module.``: the layout's name is the one without them (docs/decisions.md,
# "PEFT / LoRA fine-tunes").
_PEFT_WRAPPERS = re.compile(r"\.base_layer(?=\.)|\.modules_to_save\.[^.]+(?=\.)")


def _from_named(named: Iterable[tuple[str, torch.Tensor]], layouts: Sequence[Layout]) -> dict[int, _LayerParams]:
    patterns = layout_patterns(layouts)
    out: dict[int, _LayerParams] = {}
    for name, param in named:
        if ".original_module." in name:
            continue
        name = _PEFT_WRAPPERS.sub("", name)
        for pat in patterns:
            m = pat.regex.search(name)
            if m is None:
                continue
            lp = out.setdefault(int(m["layer"]), _LayerParams())
            if pat.role == "expert":
                lp.experts.setdefault(int(m["expert"]), []).append(param)
            else:
                getattr(lp, pat.role).append(param)
            break
    return out


def _layouts_for(source: Any, family: str | None) -> list[Layout]:
    if family is not None:
        if family not in FAMILIES:
            known = ", ".join(FAMILIES)
            raise InputError(f"unknown MoE family {family!r}", hint=f"known families: {known}")
        return [FAMILIES[family].layout]
    model_type = getattr(getattr(source, "config", None), "model_type", None)
    if model_type in FAMILIES:
        return [FAMILIES[model_type].layout]
    return [f.layout for f in FAMILIES.values()]  # not a known family: try every layout's names


def collect_params(source: Source, family: str | None = None) -> dict[int, _LayerParams]:
    """Routed layers → their expert/router/shared parameters, validated."""
    if isinstance(source, torch.nn.Module):
        layers = _from_named(source.named_parameters(), _layouts_for(source, family))
    else:
        items = list(source)
        if items and all(isinstance(i, LayerWeights) for i in items):
            layers = _from_layer_weights(items)  # type: ignore[arg-type]
        else:
            layers = _from_named(items, _layouts_for(None, family))  # type: ignore[arg-type]
    if not layers:
        model_type = getattr(getattr(source, "config", None), "model_type", None)
        what = "" if not isinstance(source, torch.nn.Module) else f" in {type(source).__name__}"
        what += "" if model_type is None else f" (model_type {model_type!r})"
        raise InputError(
            f"no routed-expert parameters found{what}: moeaudit audits Mixture-of-Experts models",
            hint="pass the MoE model, its named_parameters(), or LayerWeights of routed layers "
            "(docs/families.md lists the families it reads)",
        )
    for layer, lp in layers.items():
        if not lp.experts and not lp.fused:  # LongCat's live model: fused experts with identity rows
            raise InputError(
                f"layer {layer}: a router but no expert parameters in a layout moeaudit reads",
                hint="pass the model's per-expert weights (as save_pretrained writes them) or LayerWeights",
            )
        E = lp.num_experts()
        missing = [e for e in range(E) if e not in lp.experts] if lp.experts else []
        if missing:
            raise InputError(f"layer {layer}: no parameters for experts {missing}")
        if not lp.router:
            raise InputError(f"layer {layer}: experts found but no router weight")
    return dict(sorted(layers.items()))


# --- norms ---------------------------------------------------------------------------------------


def grad_norms(layers: Mapping[int, _LayerParams], grad_of: GradOf = dot_grad) -> dict[str, dict[str, Any]]:
    """The three norm tables of one metrics line (finite or not; sanitised by the caller).
    ``grad_of(tensor)``: its gradient (default ``tensor.grad``), None for no gradient."""
    return norm_tables(NormPass(layers).sums(grad_of))


def norm_tables(sums: Sums) -> dict[str, dict[str, Any]]:
    """Squared norms → the ``expert_grad_norms`` / ``router_grad_norms`` / ``shared_grad_norms``
    tables of a metrics line (``math.sqrt`` keeps NaN and Inf for :func:`_finite`)."""
    out: dict[str, dict[str, Any]] = {
        "expert_grad_norms": {str(k): [math.sqrt(s) for s in v] for k, v in sums.experts.items()},
        "router_grad_norms": {str(k): math.sqrt(v) for k, v in sums.router.items()},
    }
    if sums.shared:
        out["shared_grad_norms"] = {str(k): math.sqrt(v) for k, v in sums.shared.items()}
    return out


def _finite(value: Any, path: str, bad: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(path)
        return None
    if isinstance(value, list):
        return [_finite(v, f"{path}.{i}", bad) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}", bad) for k, v in value.items()}
    return value


# --- the logger ----------------------------------------------------------------------------------


class ExpertGradLogger:
    """Append per-expert gradient norms to ``path`` every ``every`` steps.

    ``source``: a ``torch.nn.Module``, its ``named_parameters()``, or our ``LayerWeights``.
    ``family``: a layout name (``mixtral``…); by default the module's ``config.model_type``,
    else every known layout. ``resume_step``: when resuming from a checkpoint at that step,
    lines logged after it by the interrupted process are dropped first, so the log stays
    one line per step. ``probe_path``: where :meth:`probe` writes (default
    ``canary_probe.jsonl`` next to ``path``); it is repaired the same way.

    ``total``: also plan the global gradient norm over every parameter of the source
    (:meth:`measure` returns it; a trainer's clipping decision reads it, no second pass).
    ``rank_zero``: whether this process writes; by default global rank 0 when
    ``torch.distributed`` is initialised, else True. Other ranks write nothing; with sharded
    (DTensor) gradients they must call :meth:`log` / :meth:`measure` at the same steps, for
    the one ``all_reduce`` of the squared norms (:mod:`moeaudit.integrations.gradnorms`).
    """

    def __init__(
        self,
        path: str | Path,
        source: Source,
        *,
        every: int = 1,
        family: str | None = None,
        resume_step: int | None = None,
        probe_path: str | Path | None = None,
        total: bool = False,
        rank_zero: bool | None = None,
    ):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.path = Path(path)
        self.probe_path = Path(probe_path) if probe_path is not None else self.path.with_name(PROBE_FILE)
        self.every = every
        if not isinstance(source, torch.nn.Module):
            source = list(source)  # type: ignore[assignment]  # an iterator is read twice (total)
        self._source, self._family, self._total = source, family, total
        self.layers = collect_params(source, family)
        self._plan = self._make_plan()
        self._replanned = not isinstance(source, torch.nn.Module)
        self._scoped = False  # inside probe_scope (FSDP2)
        self.writes = _is_rank_zero() if rank_zero is None else rank_zero
        self._files = {p: LineLog(p) for p in (self.path, self.probe_path)}
        if self.writes:
            repair(self.path, resume_step)
            repair(self.probe_path, resume_step)

    def _make_plan(self) -> NormPass:
        """``total``: every parameter of a module, or every tensor of ``named_parameters()``
        pairs (our ``LayerWeights`` hold only routed layers: no global norm)."""
        if not self._total:
            return NormPass(self.layers)
        if isinstance(self._source, torch.nn.Module):
            return NormPass(self.layers, list(self._source.parameters()))
        pairs = [i for i in self._source if isinstance(i, tuple)]  # type: ignore[union-attr]
        return NormPass(self.layers, [t for _, t in pairs] if pairs else None)

    @property
    def num_experts(self) -> dict[int, int]:
        return {layer: lp.num_experts() for layer, lp in self.layers.items()}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @property
    def collective(self) -> bool:
        """Gradients are sharded (DTensor): every rank must measure at the same steps."""
        self._replan()
        return self._plan.collective

    def _replan(self) -> None:
        """A module's parameters are looked up again once, at first use: a wrapper that
        replaced them after this logger was made (FSDP2's ``fully_shard``) is then read."""
        if not self._replanned:
            self._replanned = True
            self.layers = collect_params(self._source, self._family)
            self._plan = self._make_plan()

    def measure(self, extras: Sequence[torch.Tensor] = ()) -> Sums:
        """Every squared norm of the gradients now, in one pass and one host sync (``extras``:
        device tensors brought back in the same sync)."""
        self._replan()
        return self._plan.sums(extras=extras)

    def vector(self, extras: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """:meth:`measure`'s numbers as one device vector, without the host sync (``NormPass.vector``)."""
        self._replan()
        return self._plan.vector(extras=extras)

    def unpack(self, values: list[float], extra_sizes: Sequence[int] = ()) -> Sums:
        """:class:`Sums` from a :meth:`vector` read on the host."""
        return self._plan.unpack(values, extra_sizes)

    @property
    def frozen(self) -> int:
        """How many routed-expert tensors do not require grad (a PEFT adapter's frozen base):
        a training step gives them no gradient, so a per-step line cannot measure them."""
        return sum(not t.requires_grad for lp in self.layers.values() for t in _expert_tensors(lp))

    @property
    def unthawable(self) -> list[str]:
        """The dtypes of frozen routed-expert tensors no gradient can be taken by (quantized
        storage, e.g. a QLoRA base): neither a step nor :meth:`probe_scope` measures them."""
        return sorted(
            {
                str(t.dtype).removeprefix("torch.")
                for lp in self.layers.values()
                for t in _expert_tensors(lp)
                if not t.requires_grad and not (t.is_leaf and t.is_floating_point())
            }
        )

    def log(self, step: int, loss: float | torch.Tensor, **extra: Any) -> dict[str, Any] | None:
        """Write the line for ``step`` if it is due; return the record written (or None; also
        None on a rank that does not write). Refused when routed-expert weights are frozen (their
        norms would be logged as 0: :func:`refuse_frozen`)."""
        if not self.due(step):
            return None
        refuse_frozen(self.frozen)
        if not self.writes and not self.collective:
            return None  # DDP: rank 0 holds the same all-reduced gradient
        return self.write(step, loss, self.measure(), **extra)

    __call__ = log

    def write(self, step: int, loss: float | torch.Tensor, sums: Sums, **extra: Any) -> dict[str, Any] | None:
        """The metrics line of ``step`` from norms :meth:`measure` returned."""
        if not self.writes:
            return None
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        record: dict[str, Any] = {"step": int(step), "loss": loss_value, **norm_tables(sums)}
        return self._record(self.path, record, extra)

    def probe(self, step: int, loss: torch.Tensor, *, canary: str | None = None, **extra: Any) -> dict[str, Any] | None:
        """Log the per-expert gradient norms of a canary ``loss`` to :attr:`probe_path`.

        Call it at save steps with the mean next-token NLL of the canary windows under the
        weights being saved (no auxiliary terms: the loss ``moeaudit`` replays, docs/glossary.md, "Replay"), and
        pass the canary's digest as ``canary``. The gradients come from
        ``torch.autograd.grad``: the parameters' ``.grad`` (the training step's) are left
        untouched and nothing accumulates. A parameter that does not require grad counts as 0.
        Both files are synced to disk afterwards (a save is a sync point). Under FSDP2, compute
        the loss inside :meth:`probe_scope` on every rank. A loss with no gradient path to any
        router is refused (InputError), never logged as zeros.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("probe needs the canary loss as a scalar tensor with a graph")
        if self.frozen:  # outside probe_scope, a frozen expert would be logged as 0
            raise InputError(
                f"canary probe: {self.frozen} routed-expert weight tensors are frozen (requires_grad False, "
                "e.g. a PEFT adapter's base), so their norms would be logged as 0",
                hint="compute the canary loss inside ExpertGradLogger.probe_scope(), which measures their gradient",
            )
        if _fsdp2(self._source):
            sums = self._fsdp2_probe(loss)
        else:
            tensors = list(dict.fromkeys(t for lp in self.layers.values() for t in lp.tensors() if t.requires_grad))
            grads = torch.autograd.grad(loss, tensors, allow_unused=True) if tensors else ()
            by_id = {id(t): g for t, g in zip(tensors, grads, strict=True)}
            if not self.writes and not self.collective:
                return None
            _refuse_no_path(self.layers, lambda t: by_id.get(id(t)))
            sums = self._plan.sums(lambda t: by_id.get(id(t)))  # every rank, when sharded
        if not self.writes:
            return None
        record: dict[str, Any] = {"step": int(step), "loss": float(loss.detach()), **norm_tables(sums)}
        if canary is not None:
            record["canary"] = canary
        precision = low_precision(self._source if isinstance(self._source, torch.nn.Module) else self.layers)
        if precision:  # the probe computed in its weights' precision, a replay in float32
            record["precision"] = precision
        out = self._record(self.probe_path, record, extra)
        self.sync()
        return out

    @contextmanager
    def probe_scope(self) -> Iterator[None]:
        """Compute the canary loss for :meth:`probe` inside this (every rank, under FSDP2).

        FSDP2 (``fully_shard``) computes with unsharded copies of its parameters that it
        all-gathers in the forward pass; the gradient reaches the sharded parameters only
        through its post-backward reduce-scatter, never through an autograd edge, so
        ``torch.autograd.grad`` of the sharded parameters finds nothing (every norm 0). Under
        FSDP2 the probe therefore runs ``backward`` like a training step: this scope lists the
        sharded parameters before the forward swaps the unsharded ones in, sets their ``.grad``
        aside (copies: a sharded gradient is a view of a reduce-scatter buffer FSDP2 may write
        again) and puts it back on exit. Without FSDP2 it does nothing."""
        if not _fsdp2(self._source):
            with self._thawed():
                yield
            return
        assert isinstance(self._source, torch.nn.Module)
        self._replan()
        params = [p for p in self._source.parameters() if p.requires_grad]
        kept = [None if p.grad is None else p.grad.detach().clone() for p in params]
        for p in params:
            p.grad = None
        self._scoped = True
        try:
            yield
        finally:
            self._scoped = False
            for p, g in zip(params, kept, strict=True):
                p.grad = g

    @contextmanager
    def _thawed(self) -> Iterator[None]:
        """Frozen router, expert and shared-expert weights (a PEFT adapter's base) require grad
        while the canary loss is computed and differentiated, and are frozen again on exit. Their
        gradient is the canary gradient at the weights the forward uses — under LoRA, at
        ``W + BA`` (dL/dW = dL/d(W + BA)) — which is what a replay of the merged checkpoint
        measures (docs/decisions.md, "PEFT / LoRA fine-tunes"). ``torch.autograd.grad`` fills no
        ``.grad``, so the optimizer never sees them."""
        thawed = [
            t
            for lp in self.layers.values()
            for t in lp.tensors()
            if not t.requires_grad and t.is_leaf and t.is_floating_point()
        ]
        thawed = list({id(t): t for t in thawed}.values())
        for t in thawed:
            t.requires_grad_(True)
        try:
            yield
        finally:
            for t in thawed:
                t.requires_grad_(False)

    def _fsdp2_probe(self, loss: torch.Tensor) -> Sums:
        """The probe's squared norms under FSDP2, on every rank: every rank computed the same
        loss on the whole canary, so the reduce-scatter's mean over ranks is that loss's
        gradient, sharded; its squared norms are summed over ranks
        (:mod:`moeaudit.integrations.gradnorms`; docs/decisions.md, "The canary probe under FSDP2")."""
        if not self._scoped:
            raise InputError(
                "canary probe under FSDP2: compute the canary loss inside ExpertGradLogger.probe_scope() "
                "(the sharded parameters have no autograd edge to the forward pass, so every norm would be 0)",
                hint="with ExpertGradLogger.probe_scope(): loss = canary_loss(model, canary); logger.probe(step, loss)",
            )
        loss.backward()
        _refuse_no_path(self.layers, dot_grad)
        return self._plan.sums()

    def _record(self, path: Path, record: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
        record.update(extra)
        bad: list[str] = []
        record = {k: _finite(v, k, bad) for k, v in record.items()}
        if bad:
            record["nonfinite"] = bad
        self._files[path].write(json.dumps(record, allow_nan=False, separators=(", ", ": ")) + "\n")
        return record

    def sync(self) -> None:
        """Make every line logged so far durable (fsync); call it at checkpoint saves."""
        for f in self._files.values():
            f.sync()

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> ExpertGradLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


LOW_PRECISION = (torch.bfloat16, torch.float16)  # weights a probe would compute in, unlike a replay


def low_precision(source: torch.nn.Module | Mapping[int, _LayerParams]) -> str | None:
    """``"bfloat16"`` (``"bfloat16/float16"``…) when weights of ``source`` are held in a
    reduced precision: a canary probe then computes in it, while a replay computes in float32
    (docs/decisions.md, "Training integrations"); None for float32 weights."""
    tensors: Iterable[torch.Tensor] = (
        source.parameters()
        if isinstance(source, torch.nn.Module)
        else (t for lp in source.values() for t in lp.tensors())
    )
    low = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype in LOW_PRECISION})
    return "/".join(low) or None


def _expert_tensors(lp: _LayerParams) -> list[torch.Tensor]:
    return [t for ts in lp.experts.values() for t in ts] + lp.fused


def refuse_frozen(frozen: int) -> None:
    """A per-step line over frozen routed-expert weights would log zeros the envelope reads as
    equal, healthy experts; refused (docs/decisions.md, "PEFT / LoRA fine-tunes")."""
    if frozen:
        raise InputError(
            f"{frozen} routed-expert weight tensors are frozen (requires_grad False, e.g. a PEFT adapter's base): "
            "a training step gives them no gradient, and logging 0 would read as healthy experts",
            hint="log only the canary probe at saves (ExpertGradLogger.probe inside probe_scope()), "
            "or train the experts' weights",
        )


def _fsdp2(source: Any) -> bool:
    """Whether ``source`` is a module with FSDP2 (``fully_shard``) modules in it."""
    if not isinstance(source, torch.nn.Module) or not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in source.modules())


def _refuse_no_path(layers: Mapping[int, _LayerParams], grad_of: GradOf) -> None:
    """A canary probe in which no router parameter got a gradient measured nothing: every
    token is routed, so the loss reaches each router unless the parameters read are not the
    ones the forward pass used (a wrapper's copies). Refused rather than logged as zeros."""
    routers = [t for lp in layers.values() for t in lp.router if t.requires_grad]
    if routers and all(grad_of(t) is None for t in routers):
        raise InputError(
            "canary probe: the canary loss has no gradient path to the model's router parameters, "
            "so every norm would be logged as 0",
            hint="pass the module the forward pass runs (with FSDP2, the fully_shard-ed model itself)",
        )


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
