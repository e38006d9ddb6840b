"""Canary NLL with one routed expert removed from routing, forward only (the ablation receipt;
docs/decisions.md, "Ablation receipt").

One baseline forward keeps every layer's input (as the replay's forward does for its backward);
removing an expert of layer ℓ then recomputes only layers ℓ … L−1 and the LM head from layer
ℓ's stored input. The experts removed in one layer are carried through the later layers
together, so each later layer's weights are read once per ablated layer (not once per expert),
in groups whose hidden states fit a memory budget. Removal itself is the family's routing rule
with the expert's logit and selection score at −inf (:mod:`moeaudit.replay.excluded`).

Shape suffixes: W windows, T tokens per window, H hidden size, E experts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from moeaudit.checkpoint.checkpoint import Checkpoint
from moeaudit.replay.device import Device, moved, on_device, prepare_device, replay_scope, to_host, trimmer
from moeaudit.replay.engine import check_shared_index, forward_pass, hc_collapse, hc_head_weights
from moeaudit.replay.excluded import excluded
from moeaudit.replay.head import head_biases, lm_head_pass
from moeaudit.replay.model import decoder_layer, rope_tables
from moeaudit.replay.result import Progress
from moeaudit.spec.config import ModelSpec

STATE_BUDGET_BYTES = 1 << 30  # hidden states of the experts of one layer carried at once


@dataclass
class AblationNll:
    """Per-window mean next-token NLL [W] of the canary, as trained and per removed expert."""

    base_W: torch.Tensor
    removed_W: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, expert) → [W]
    layer_forwards: int = 0  # decoder layers computed, the baseline's included (the cost)


def removable(spec: ModelSpec, layer: int) -> str | None:
    """Why experts of routed ``layer`` cannot be removed from routing (None: they can)."""
    E, k = spec.num_experts, spec.top_k
    if E - 1 < k:
        return f"layer {layer} routes every token to all {E} experts (top-{k}): no routing without one of them"
    return None


def ablation_nll(
    ckpt: Checkpoint,
    tokens_WT: torch.Tensor,
    removals: Mapping[int, Sequence[int]],
    *,
    dtype: torch.dtype = torch.float32,
    device: Device = None,
    progress: Progress | None = None,
    budget_bytes: int = STATE_BUDGET_BYTES,
) -> AblationNll:
    """The canary's per-window NLL as trained and with each expert of ``removals``
    (routed layer → experts) removed from routing, one at a time."""
    spec = ckpt.spec
    for layer in removals:
        if layer not in spec.routed_layers:
            raise ValueError(f"layer {layer} is not a routed layer")
    check_shared_index(spec, tokens_WT.shape[-1])
    dev = prepare_device(device)
    tick = progress or (lambda *_: None)
    with replay_scope(dev), torch.no_grad():
        tokens_WT = tokens_WT.long()
        W, T = tokens_WT.shape
        rope = rope_tables(spec, T) if dev is None else moved(rope_tables(spec, T), dev, non_blocking=True)
        L = spec.num_layers
        total = L + sum(len(e) * (L - layer) for layer, e in removals.items())
        x, inputs, _ = forward_pass(ckpt, tokens_WT, rope, dtype=dtype, device=dev, keep_routing=False, tick=tick)
        head = _Head(ckpt, tokens_WT, dtype, dev)
        out = AblationNll(head.nll_W(x), layer_forwards=L)
        del x
        trim = trimmer(dev)
        done = L
        for layer in sorted(removals):
            experts = list(removals[layer])
            x_in = inputs[layer]
            per_state = max(1, x_in.numel() * x_in.element_size())
            group = max(1, budget_bytes // per_state)
            for a in range(0, len(experts), group):
                chunk = experts[a : a + group]
                states = _through(ckpt, layer, chunk, x_in, rope, dtype, dev, trim)
                out.layer_forwards += len(chunk) * (L - layer)
                done += len(chunk) * (L - layer)
                tick(f"ablation layer {layer}", done, total)
                for e, x_e in zip(chunk, states, strict=True):
                    out.removed_W[(layer, e)] = head.nll_W(x_e)
                del states
        return out


def _through(
    ckpt: Checkpoint,
    layer: int,
    experts: Sequence[int],
    x_in: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    dev: torch.device | None,
    trim: Callable[[], object],
) -> list[torch.Tensor]:
    """Layer ``layer`` from its stored input once per removed expert, then every later layer
    (its weights read once for all of them): the final hidden state of each."""
    spec = ckpt.spec
    lw = on_device(ckpt.layer_weights(layer, dtype, lazy_experts=True, device=dev), dev)
    E = int(lw.params["router"].shape[0])
    states = []
    for e in experts:
        mask = torch.zeros(E, dtype=torch.bool, device=x_in.device)
        mask[e] = True
        with excluded(mask):
            states.append(decoder_layer(spec, lw, x_in, rope)[0])
    del lw
    for j in range(layer + 1, spec.num_layers):
        lw = on_device(ckpt.layer_weights(j, dtype, lazy_experts=True, device=dev), dev)
        states = [decoder_layer(spec, lw, x, rope)[0] for x in states]
        del lw
        trim()
    return states


class _Head:
    """The final norm and LM head (HY-V4: the stream collapse first), read once."""

    def __init__(self, ckpt: Checkpoint, tokens_WT: torch.Tensor, dtype: torch.dtype, dev: torch.device | None):
        spec = self.spec = ckpt.spec
        final_norm, lm_head = ckpt.read_global("final_norm", dtype), ckpt.read_global("lm_head", dtype)
        biases = head_biases(ckpt, dtype)
        hc = hc_head_weights(ckpt, dtype) if spec.hc is not None else None
        if dev is not None:
            final_norm, lm_head, tokens_WT, biases, hc = moved(
                (final_norm, lm_head, tokens_WT, biases, hc), dev, non_blocking=True
            )
        self.final_norm, self.lm_head, self.tokens_WT, self.biases, self.hc, self.dev = (
            final_norm,
            lm_head,
            tokens_WT,
            biases,
            hc,
            dev,
        )

    def nll_W(self, x: torch.Tensor) -> torch.Tensor:
        if self.hc is not None:
            x = hc_collapse(self.spec, self.hc, x)
        h = lm_head_pass(self.spec, self.final_norm, self.lm_head, x, self.tokens_WT, None, **self.biases)
        return to_host(h.nll_WT1.mean(1), self.dev).double()
