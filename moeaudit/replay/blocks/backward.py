"""The backward of one decoder layer over its typed blocks (``spec.blocks.Layer``), shared by the
one-process replay (``replay.engine``) and the expert-parallel replay (``replay.sharded``, which
passes its own MoE backward, as it passes its own MoE forward to ``decoder_layer``).

The layer is recomputed from its stored input and dL/d(output) pushed through it
(docs/glossary.md, "Replay"). Two registries choose the per-kind parts, as
:data:`~moeaudit.replay.blocks.layer.MIXERS` chooses a mixer's forward:

* :data:`FFN_BACKWARDS` (MLP / MoE record type → the layer's backward): a layer without routed
  experts is all autograd through ``decoder_layer``; a routed layer takes its experts' backward by
  hand, one expert at a time (``experts_backward``), and autograd for everything else;
* :data:`RESIDUALS` (the residual's wiring, ``Residual.wiring``, the keys of the forward's
  :data:`~moeaudit.replay.blocks.layer.RESIDUALS` → how the MoE block's input is formed and how
  dL/d(layer output) becomes dL/d(MoE output)): the additive residuals (sequential, parallel,
  single-block; their multiplier), DeepNorm's scales, LongCat's shortcut, HY-V4's
  hyper-connections.

A mixer kind needs no entry: autograd takes its backward. The order in which the autograd roots
are given (residual, y, combine, shared expert, MoE bias, output-norm gain) and the operations on
dL/d(output) are those of the hand-written backward this replaces: the gradient receipts' bits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.replay.blocks.experts import expert_slots, experts_backward, experts_forward_sets, input_scales
from moeaudit.replay.blocks.hc import hc_add, hc_mix
from moeaudit.replay.blocks.layer import (
    Rope,
    attention_block,
    decoder_layer,
    deepnorm_attention_block,
    hc_attention_block,
    shortcut_rest,
)
from moeaudit.replay.blocks.moe import moe_router, shared_expert
from moeaudit.replay.blocks.norms import rms_norm
from moeaudit.replay.blocks.router import Routing
from moeaudit.replay.head import backward_from
from moeaudit.replay.result import LayerGrads, layer_grads
from moeaudit.replay.stash import Kept
from moeaudit.spec import blocks
from moeaudit.spec.config import ModelSpec


class MoEBackward(Protocol):
    """The routed experts' part of a routed layer's backward: where they live and how their
    gradients are brought together (one process: :class:`LocalMoE`; ``replay.sharded``: the ranks')."""

    def routed_output(self, spec: ModelSpec, lw: LayerWeights, y_NH: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Σ_k c_k u_k of the block's tokens, formed again without autograd (for a residual or
        an output norm whose Jacobian depends on the block's output)."""
        ...

    def experts(
        self,
        spec: ModelSpec,
        lw: LayerWeights,
        moe_in_BTH: torch.Tensor,
        y_NH: torch.Tensor,
        routing: Routing,
        g_NH: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dL/dy, dL/dc of the block's tokens, each expert's squared gradient norm) for
        dL/d(routed output) ``g_NH``."""
        ...

    def finish(self, lw: LayerWeights) -> None:
        """After autograd filled the layer's ``.grad``s (the ranks sum theirs)."""
        ...


@dataclass
class LocalMoE:
    """One process: every expert here, with the forward's W1/W3 products where it ``kept`` them
    (``replay.stash``); the experts' slot order is found once for both sweeps where the routed
    output is formed again."""

    kept: Kept | None = None
    slots: tuple[torch.Tensor, list[int]] | None = None

    def routed_output(self, spec: ModelSpec, lw: LayerWeights, y_NH: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.slots = expert_slots(routing.topk_NK, len(lw.experts))  # one sync for both sweeps
        with torch.no_grad():
            sets = [routing.topk_NK]
            (u_NKH,) = experts_forward_sets(
                lw.experts,
                y_NH.detach(),
                sets,
                spec.expert_glu(lw.layer),
                input_scales(spec, routing, sets),
                sorted_slots=[self.slots],
            )
            return (u_NKH * routing.combine_NK.detach().to(u_NKH.dtype)[..., None]).sum(1)

    def experts(
        self,
        spec: ModelSpec,
        lw: LayerWeights,
        moe_in_BTH: torch.Tensor,
        y_NH: torch.Tensor,
        routing: Routing,
        g_NH: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        back = experts_backward(
            lw.experts,
            y_NH.detach(),
            routing.topk_NK,
            routing.combine_NK.detach(),
            g_NH,
            spec.expert_glu(lw.layer),
            spec.moe.scaled_inputs,
            sorted_slots=self.slots,
            kept=self.kept,
        )
        return back.y_NH, back.combine_NK, back.sq_E

    def finish(self, lw: LayerWeights) -> None:
        return None


@dataclass
class Wired:
    """What a residual wiring gives the routed layer's backward: its autograd roots and their
    gradients, dL/d(MoE block output) and an extra dL/dy (DeepNorm's α·dL/d(out))."""

    roots: list[torch.Tensor]
    grads: list[torch.Tensor]
    g_NH: torch.Tensor
    dy_NH: torch.Tensor | None = None


class Residual(Protocol):
    """A residual wiring's part of a routed layer's backward."""

    def enter(self, spec: ModelSpec, lw: LayerWeights, x: torch.Tensor, rope: Rope) -> tuple[Any, torch.Tensor]:
        """Under autograd: (what ``leave`` needs, the MoE block's input [B, T, H])."""
        ...

    def leave(
        self,
        spec: ModelSpec,
        lw: LayerWeights,
        state: Any,
        y_NH: torch.Tensor,
        grad: torch.Tensor,
        rope: Rope,
        block_out: Callable[[], torch.Tensor],
    ) -> Wired:
        """From dL/d(layer output) ``grad``: the residual's roots and dL/d(MoE block output);
        ``block_out()`` is the block's output (detached), formed on demand."""
        ...


class Additive:
    """out = h + m·MoE(y), h = x + m·mixer(norm(x)), y = norm(h) (m: Granite's multiplier)."""

    def enter(self, spec: ModelSpec, lw: LayerWeights, x: torch.Tensor, rope: Rope) -> tuple[Any, torch.Tensor]:
        h = attention_block(spec, lw, x, rope)
        return h, h

    def leave(
        self,
        spec: ModelSpec,
        lw: LayerWeights,
        state: Any,
        y_NH: torch.Tensor,
        grad: torch.Tensor,
        rope: Rope,
        block_out: Callable[[], torch.Tensor],
    ) -> Wired:
        m = spec.layers[lw.layer].residual.multiplier
        g_NH = grad.reshape(-1, grad.shape[-1])
        return Wired([self.rest(spec, lw, state, y_NH, rope)], [grad], g_NH if m == 1.0 else g_NH * m)

    def rest(self, spec: ModelSpec, lw: LayerWeights, h: torch.Tensor, y_NH: torch.Tensor, rope: Rope) -> torch.Tensor:
        return h


class Parallel(Additive):
    """Cohere: out = h + m·MoE(y), h = x + m·mixer(norm(x)), y = norm(x): the MoE reads the layer input."""

    def enter(self, spec: ModelSpec, lw: LayerWeights, x: torch.Tensor, rope: Rope) -> tuple[Any, torch.Tensor]:
        return attention_block(spec, lw, x, rope), x


class DeepNorm(Additive):
    """MiniMax-01: out = α·y + β·MoE(y), y = norm(h), h = α₁·norm(x) + β₁·mixer(norm(x)): no
    identity path from h; dL/dy = α·dL/d(out) + the experts'."""

    def enter(self, spec: ModelSpec, lw: LayerWeights, x: torch.Tensor, rope: Rope) -> tuple[Any, torch.Tensor]:
        h = deepnorm_attention_block(spec, lw, x, rope)
        return h, h

    def leave(
        self,
        spec: ModelSpec,
        lw: LayerWeights,
        state: Any,
        y_NH: torch.Tensor,
        grad: torch.Tensor,
        rope: Rope,
        block_out: Callable[[], torch.Tensor],
    ) -> Wired:
        scales = spec.layers[lw.layer].residual.scales
        assert scales is not None
        alpha, beta = scales[1]
        g_NH = grad.reshape(-1, grad.shape[-1])
        return Wired([], [], g_NH * beta, alpha * g_NH)


class Shortcut(Additive):
    """LongCat-Flash: out = rest(h, y) + MoE(y); the rest takes dL/d(out) as h does elsewhere."""

    def rest(self, spec: ModelSpec, lw: LayerWeights, h: torch.Tensor, y_NH: torch.Tensor, rope: Rope) -> torch.Tensor:
        with torch.enable_grad():
            return shortcut_rest(spec, lw, h, y_NH.view_as(h), rope)


class HyperConnected:
    """HY-V4, out = x1 + post ⊗ MoE(m), m = Σ pre_s x1_s: dL/d(block output) and dL/dpost need the
    block's output, so it is formed again and autograd takes the hyper-connection's output on a
    detached copy of it; the experts then get Σ_s post_s dL/dout_s."""

    def enter(self, spec: ModelSpec, lw: LayerWeights, x: torch.Tensor, rope: Rope) -> tuple[Any, torch.Tensor]:
        p = lw.params
        x1 = hc_attention_block(spec, lw, x, rope)
        post, m_BTH = hc_mix(spec, p["ffn_hc_fn"], p["ffn_hc_base"], p["ffn_hc_scale"], x1)
        assert post is not None
        return (x1, post), m_BTH

    def leave(
        self,
        spec: ModelSpec,
        lw: LayerWeights,
        state: Any,
        y_NH: torch.Tensor,
        grad: torch.Tensor,
        rope: Rope,
        block_out: Callable[[], torch.Tensor],
    ) -> Wired:
        x1, post = state
        B, T, _, H = grad.shape
        s_NH = block_out().requires_grad_(True)
        with torch.enable_grad():
            out = hc_add(post, s_NH.view(B, T, H), x1)
        (g_NH,) = torch.autograd.grad(out, s_NH, grad, retain_graph=True)
        return Wired([out], [grad], g_NH)


# the residual's wiring (``Residual.wiring``, as the forward's ``layer.RESIDUALS``) → its part of
# the routed layer's backward
RESIDUALS: dict[str, Residual] = {
    "sequential": Additive(),
    "parallel": Parallel(),
    "single_block": Additive(),  # Nemotron-H's MoE layer: h = x (the layer has no mixer)
    "deepnorm": DeepNorm(),
    "shortcut": Shortcut(),
    "hyper_connection": HyperConnected(),
}


def residual_backward(r: blocks.Residual) -> Residual:
    """The residual's wiring in the backward (:data:`RESIDUALS`)."""
    return RESIDUALS[r.wiring]


def _autograd(
    spec: ModelSpec,
    lw: LayerWeights,
    x: torch.Tensor,
    grad: torch.Tensor,
    rope: Rope,
    moe: MoEBackward,
    device: torch.device | None,
) -> LayerGrads | None:
    """A layer without routed experts: autograd through ``decoder_layer``."""
    with torch.enable_grad():
        out, _ = decoder_layer(spec, lw, x, rope)
    backward_from([out], [grad])
    return None


def _routed(
    spec: ModelSpec,
    lw: LayerWeights,
    x: torch.Tensor,
    grad: torch.Tensor,
    rope: Rope,
    moe: MoEBackward,
    device: torch.device | None,
) -> LayerGrads | None:
    """A routed layer: autograd covers the mixer, norms, router, shared expert, MoE bias and output
    norm (whose ``.grad`` it fills); the routed experts go through ``moe.experts``."""
    layer = spec.layers[lw.layer]
    ffn = layer.ffn
    assert isinstance(ffn, blocks.MoE) and lw.routed
    wiring = residual_backward(layer.residual)
    with torch.enable_grad():
        state, moe_in = wiring.enter(spec, lw, x, rope)
        y_NH, routing = moe_router(spec, lw, moe_in.reshape(-1, moe_in.shape[-1]))
        shared = shared_expert(spec, lw.params, y_NH, lw.layer) if ffn.shared is not None else None
        bias = lw.params["moe_bias"].expand_as(y_NH) if ffn.out_bias else None  # JetMoE

    formed: list[torch.Tensor] = []

    def block_input() -> torch.Tensor:
        """routed + shared (+ bias): what the output norm reads, or the block's output."""
        if not formed:
            s_NH = moe.routed_output(spec, lw, y_NH, routing)
            with torch.no_grad():
                if shared is not None:
                    s_NH = s_NH + shared.detach()
                if ffn.out_bias:
                    s_NH = s_NH + lw.params["moe_bias"].detach()
            formed.append(s_NH)
        return formed[0]

    def block_out() -> torch.Tensor:
        if not ffn.out_norm:
            return block_input()
        with torch.no_grad():
            return rms_norm(block_input(), lw.params["moe_out_norm"], spec.rms_eps)

    wired = wiring.leave(spec, lw, state, y_NH, grad, rope, block_out)
    g_NH, gain = wired.g_NH, None
    if ffn.out_norm:  # A.X-K1: out = h + norm(routed + shared); dL/d(routed + shared) through the norm
        s_NH = block_input().requires_grad_(True)
        with torch.enable_grad():
            out_NH = rms_norm(s_NH, lw.params["moe_out_norm"], spec.rms_eps)
        g_out_NH = g_NH
        (g_NH,) = torch.autograd.grad(out_NH, s_NH, g_out_NH, retain_graph=True)
        gain = (out_NH, g_out_NH)  # the norm's gain (its input is a detached leaf: nothing else moves)
    dy_NH, dc_NK, sq_E = moe.experts(spec, lw, moe_in, y_NH, routing, g_NH)
    if wired.dy_NH is not None:
        dy_NH = dy_NH + wired.dy_NH
    roots = [*wired.roots, y_NH, routing.combine_NK]
    grads = [*wired.grads, dy_NH, dc_NK]
    if shared is not None:
        roots.append(shared)
        grads.append(g_NH)
    if bias is not None:  # the bias on the MoE output gets dL/d(MoE output), summed over tokens
        roots.append(bias)
        grads.append(g_NH)
    if gain is not None:
        roots.append(gain[0])
        grads.append(gain[1])
    backward_from(roots, grads)
    moe.finish(lw)
    # a zero-computation expert (LongCat) has no weights, hence no gradient norm: not reported
    return layer_grads(lw, sq_E[: spec.parametric_experts], device)


# the layer's MLP / MoE record type → its backward (a kind not here, and a layer without an MLP /
# MoE block, is all autograd)
FFN_BACKWARDS: dict[type, Callable[..., LayerGrads | None]] = {
    blocks.DenseMLP: _autograd,
    blocks.MoE: _routed,
}


def layer_backward(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    grad_BTH: torch.Tensor,
    rope: Rope,
    device: torch.device | None = None,
    kept: Kept | None = None,
    moe: MoEBackward | None = None,
) -> tuple[torch.Tensor, LayerGrads | None]:
    """Recompute one layer from its input and push dL/d(output) through it: (dL/d(input),
    gradient norms where it is routed). ``moe``: the routed experts' backward where it is not
    :class:`LocalMoE` (with the forward's ``kept`` W1/W3 products)."""
    for t in lw.params.values():
        t.requires_grad_(True)
    x = x_BTH.detach().requires_grad_(True)
    backward = FFN_BACKWARDS.get(type(spec.layers[lw.layer].ffn), _autograd)
    grads = backward(spec, lw, x, grad_BTH, rope, moe or LocalMoE(kept), device)
    assert x.grad is not None
    return x.grad, grads
