"""The audit's FLOPs counted once per shape: a certify replay that runs the same products on the
same shapes as one already metered in this audit carries that replay's count (``flops_from``)
instead of being metered again (docs/compliance.md, "Measured quantities"; docs/benchmarks.md §13).

Why the carried count is the count. :class:`torch.utils.flop_counter.FlopCounterMode` adds
2·m·n·k per matrix product (and torch's formula per attention kernel) from the shapes that ran,
never from the values. Within one certify the canary, the receipt settings, the precision and
the device are the same for every checkpoint; what else fixes the shapes:

* the architecture and the stored tensors' names, shapes and dtypes (:func:`signature`);
* the routing, through the routed experts: an expert's products have as many rows as (token,
  slot) pairs were routed to it, and experts with none are skipped. When every routed expert of
  a layer has the same shapes, the sum over experts is N·k times one row's cost whatever the
  split (the overlap receipts' extra expert sets likewise: N·X rows). Not so where a routed slot
  costs nothing (LongCat's zero-computation experts) or where only some experts are computed
  here (an expert-parallel replay counts rank 0's): those replays are all metered
  (:func:`routing_dependent`);
* the W1/W3 products kept for the backward (``replay.stash``): a kept layer's backward forms two
  products fewer. By default the budget is a share of the host memory free when the replay
  starts, so it can differ between replays. A replay that carries a count runs with the budget of
  the replay it carries from, and only when its own budget is at least that (so it keeps the same
  layers and holds no more than the default allows); otherwise it is metered.

A window's count is not taken and scaled: the replay runs all W windows as one batch, so a
separate one-window replay costs about as many dispatched operations as metering the whole
(docs/benchmarks.md §13).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from moeaudit.precision import REFERENCE
from moeaudit.precision import current as current_precision


@dataclass(frozen=True)
class Reference:
    """A replay metered in this audit: its receipt, its count and the layers whose W1/W3
    products it kept (``replay.stash``)."""

    receipt: str
    flops: int
    kept_layers: tuple[int, ...]
    per_layer: int  # bytes one kept layer holds

    @property
    def budget(self) -> float:
        """The stash budget that keeps exactly these layers: the stash keeps layers in forward
        order while the next one fits, so k layers' bytes keep the same k."""
        return float(len(self.kept_layers) * self.per_layer)


@dataclass(frozen=True)
class Plan:
    """How one replay's FLOPs are obtained: ``meter`` (counted while it runs) or carried from
    ``carry``; ``budget``: the stash budget to run it with (None: the replay's default)."""

    meter: bool
    budget: float | None = None
    carry: Reference | None = None
    key: str | None = None  # the signature a metered replay becomes a reference for
    per_layer: int = 0


def routing_dependent(ckpt: Any) -> str | None:
    """Why this checkpoint's replay count depends on the routing (every replay is then metered),
    or None."""
    s = ckpt.spec
    if s.zero_experts:
        return "zero-computation experts: the count depends on how many slots reach them"
    from moeaudit.replay import dist

    if dist.active() is not None:
        return "expert-parallel replay: rank 0 counts only the rows routed to its experts"
    for layer in s.routed_layers:
        found = ckpt.expert_keys(layer)
        if isinstance(found, dict):  # fused: one tensor per name for all experts
            continue
        shapes = {tuple(sorted((n, _stored_shape(ckpt, k)) for n, k in e.items())) for e in found}
        if len(shapes) > 1:
            return f"layer {layer}'s routed experts differ in shape"
    return None


def _stored_shape(ckpt: Any, key: str) -> tuple[int, ...] | None:
    """A stored tensor's shape (an MXFP4 weight: its packed blocks'); None where none is stored."""
    if key in ckpt.packed:
        return tuple(ckpt.info(ckpt.packed[key][0]).shape)
    return tuple(ckpt.info(key).shape) if key in ckpt.key_file else None


def signature(ckpt: Any, canary_digest: str, settings: Any, device: str | None) -> str:
    """sha256 of what fixes a replay's shapes besides the routing and the stash: the model
    spec, every stored tensor's name, shape and dtype (the packed MXFP4 and scale names, the
    tensors left out), the canary, the receipt settings, the precision and the device."""
    tensors = sorted((k, list(ckpt.info(k).shape), ckpt.info(k).dtype) for k in ckpt.key_file)
    parts = [
        repr(ckpt.spec),
        tensors,
        sorted(ckpt.packed.items()),
        sorted(ckpt.scales.items()),
        [x.to_json() for x in ckpt.left_out],
        canary_digest,
        settings,
        current_precision(),
        str(device),
    ]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def memory_dependent_stash(device: str | None) -> bool:
    """Whether the stash budget can follow the free host memory (``replay.stash``: the default,
    capped by a quarter of the headroom): no budget in the environment and the replay on the host."""
    from moeaudit.replay.stash import ENV

    if os.environ.get(ENV):
        return False
    return device is None or str(device).split(":")[0] == "cpu"


@dataclass
class FlopReuse:
    """The references of one audit, by :func:`signature`; :meth:`plan` before each replay,
    :meth:`record` after it."""

    device: str | None = None
    references: dict[str, list[Reference]] = field(default_factory=dict)

    def plan(self, ckpt: Any, canary: Any, settings: Any) -> Plan:
        if routing_dependent(ckpt) is not None:
            return Plan(meter=True)
        if current_precision() != REFERENCE and memory_dependent_stash(self.device):
            return Plan(meter=True)  # the agreement's own replays keep what host memory allows
        from moeaudit.replay.stash import ExpertStash, default_budget

        key = signature(ckpt, canary.digest, settings, self.device)
        tokens, dtype = canary.num_windows * canary.window_len, _compute_dtype()
        budget = default_budget(self.device, ckpt.spec, tokens, dtype)
        per_layer = ExpertStash(ckpt.spec, tokens, 0.0, dtype).per_layer
        for ref in self.references.get(key, []):
            if ref.budget <= budget:
                return Plan(meter=False, budget=ref.budget, carry=ref, key=key, per_layer=per_layer)
        return Plan(meter=True, budget=budget, key=key, per_layer=per_layer)

    def record(self, plan: Plan, receipt: str, meter_record: dict[str, Any], kept_layers: list[int]) -> dict[str, Any]:
        """The replay's compute entry: what the meter recorded, or with a carried count,
        ``flops`` and ``flops_from`` of the reference (energy as measured either way).
        ``kept_layers``: the layers whose W1/W3 products the replay kept."""
        if plan.meter:
            if plan.key is not None:
                ref = Reference(receipt, int(meter_record["flops"]), tuple(kept_layers), plan.per_layer)
                self.references.setdefault(plan.key, []).append(ref)
            return meter_record
        assert plan.carry is not None
        if tuple(kept_layers) != plan.carry.kept_layers:  # the stash keeps a prefix: cannot happen
            raise RuntimeError(
                f"{receipt}: the replay kept the W1/W3 products of layers {kept_layers}, its FLOP "
                f"reference {plan.carry.receipt} those of {list(plan.carry.kept_layers)}"
            )
        return {**meter_record, "flops": plan.carry.flops, "flops_from": plan.carry.receipt}


def _compute_dtype() -> Any:
    import torch

    return torch.float32  # the replay's compute dtype (run_state: replay's default)


__all__ = ["FlopReuse", "Plan", "Reference", "memory_dependent_stash", "routing_dependent", "signature"]
