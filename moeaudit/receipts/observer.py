"""Computes a layer's state receipts during the forward pass, while its weights are resident
(docs/glossary.md, "Replay": layer-local; no extra full passes).

Where the taps are: on a device every statistic is computed there and the layer's receipts
come to the host in one copy (``deferred.resolve``: O(receipt size) bytes, not the taps'
(3 + min(E, 2k))·N·H floats — docs/decisions.md, "The GPU path: receipts on the device, copies ahead, inputs
offloaded"). The random draws (bootstrap windows, router noise, the random outside expert) are made on the host with CPU
generators, the same numbers on every device, and copied over once per layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moeaudit.canary import Canary
from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.policy import ReceiptSettings
from moeaudit.receipts.bootstrap import WindowBootstrap
from moeaudit.receipts.boundary import boundary_pending, eta_scale
from moeaudit.receipts.deferred import resolve
from moeaudit.receipts.gate import bias_telemetry_pending, gate_note
from moeaudit.receipts.monitors import monitors_pending
from moeaudit.receipts.occupancy import domain_routing_pending, occupancy_pending
from moeaudit.receipts.overlap import extra_experts, overlap_pending
from moeaudit.replay.device import HOST, moved
from moeaudit.replay.model import MoETap, Routing
from moeaudit.spec.config import ModelSpec


@dataclass
class AnchorStates:
    """What a pair comparison needs from one checkpoint's replay of one layer."""

    z_NH: torch.Tensor  # pre-gain normalised state
    y_NH: torch.Tensor  # this checkpoint's own post-gain gate input (h itself without a pre-norm)


@dataclass
class StateObserver:
    spec: ModelSpec
    canary: Canary
    settings: ReceiptSettings
    keep_states: bool = False
    layers: dict[int, dict[str, Any]] = field(default_factory=dict)
    states: dict[int, AnchorStates] = field(default_factory=dict)
    kept_layers: list[int] = field(default_factory=list)  # set by run_state: the replay's ``stash`` layers

    def _seed(self, layer: int) -> int:
        # one stream per layer, fixed by the policy seed
        return self.settings.seed * 1_000_003 + layer

    def extra_experts(self, layer: int, routing: Routing) -> dict[str, torch.Tensor]:
        """Asked by the replay before it runs a layer's experts (one conversion per expert)."""
        return extra_experts(routing, self._seed(layer))

    def __call__(self, tap: MoETap, lw: LayerWeights) -> None:
        s, r = self.settings, tap.routing
        seed = self._seed(tap.layer)
        dev = tap.y_NH.device
        boot = WindowBootstrap(self.canary.num_windows, s.bootstrap, seed).on(dev)
        router = {
            n: t.to(dev, non_blocking=True)
            for n in ("router", "router_bias", "router_logit_bias")
            if (t := lw.params.get(n)) is not None
        }  # where the layer ran: no copy
        bias_E = router.get("router_bias")
        boundary, m_N = boundary_pending(
            self.spec,
            r.scores_NE,
            router["router"],
            tap.y_NH,
            r.topk_NK,
            s,
            boot,
            seed,
            bias_E=bias_E,
            margin_N=r.margin_N,
            logit_bias_E=router.get("router_logit_bias"),
        )
        note = gate_note(self.spec)
        layer = {
            **({} if note is None else {"gate": {**note, "selection_bias": bias_telemetry_pending(bias_E)}}),
            "occupancy": occupancy_pending(r.topk_NK, r.probs_NE, boot, self.spec.zero_experts),
            "boundary": boundary,
            # boundary-layer tokens (m_t < boundary_layer_eta) on the same η units as B(η)
            "overlap": overlap_pending(tap, lw, m_N / eta_scale(self.spec), s, boot, seed, self.spec),
            "domains": domain_routing_pending(
                r.topk_NK, self.canary.domain_ids, self.canary.domains, self.spec.num_experts
            ),
            "monitors": monitors_pending(r.probs_NE, r.topk_NK, self.canary.num_windows),
        }
        if self.keep_states:  # the pair receipts' anchors, on the host (queued before the one wait)
            self.states[tap.layer] = moved(
                AnchorStates(tap.z_NH.detach().clone(), tap.y_NH.detach().clone()), HOST, non_blocking=True
            )
        self.layers[tap.layer] = resolve(layer)
