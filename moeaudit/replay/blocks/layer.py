"""The decoder layer over its typed blocks (``spec.blocks.Layer``): three registries, each the only
switch on its kind, from a token mixer's record type to its forward (:data:`MIXERS`), from the MLP /
MoE block's to its forward (:data:`FFNS`) and from the residual's wiring (``Residual.wiring``:
sequential, parallel and single-block layers with their multiplier, DeepNorm scales, LongCat's
shortcut, HY-V4's hyper-connections) to the layer's forward (:data:`RESIDUALS`), and the one
decoder-layer function that the one-process replay, the trainer and the expert-parallel replay
(``replay.sharded``, with its own MoE forward) share. The backward's residual registry
(``replay.blocks.backward.RESIDUALS``) has the same keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.replay.blocks.attention import attention
from moeaudit.replay.blocks.hc import hc_add, hc_mix
from moeaudit.replay.blocks.mla import mla_attention
from moeaudit.replay.blocks.mlp import mlp
from moeaudit.replay.blocks.moe import ExtraExperts, MoETap, mlp_norm, moe_block
from moeaudit.replay.blocks.norms import block_norm, rms_norm
from moeaudit.replay.deltanet import gated_deltanet
from moeaudit.replay.kda import kimi_delta_attention
from moeaudit.replay.lightning import lightning_attention
from moeaudit.replay.mamba import mamba_mixer
from moeaudit.replay.moa import moa_attention
from moeaudit.replay.shortconv import short_conv
from moeaudit.spec import blocks
from moeaudit.spec.config import SECOND_BLOCK, ModelSpec

Rope = tuple[torch.Tensor, torch.Tensor]
# (spec, the block, the layer's tensors, the normed input [B, T, H], RoPE, layer index) → output
MixerForward = Callable[[ModelSpec, Any, dict[str, torch.Tensor], torch.Tensor, Rope, int], torch.Tensor]
# (spec, layer, what the MoE block reads [B, T, H]) → (its output, its taps)
MoEForward = Callable[[ModelSpec, LayerWeights, torch.Tensor], tuple[torch.Tensor, MoETap | None]]


def _attention(
    spec: ModelSpec, a: blocks.Attention, p: dict[str, torch.Tensor], x: torch.Tensor, rope: Rope, layer: int
) -> torch.Tensor:
    out = attention(spec, a, p, x, rope, layer)
    if a.out_norm:  # AFMoE: an RMSNorm on the attention output before the residual add
        out = rms_norm(out, p["attn_out_norm"], spec.rms_eps)
    return out


MIXERS: dict[type, MixerForward] = {
    blocks.Attention: _attention,
    blocks.MLAttention: mla_attention,
    blocks.DeltaNet: lambda spec, m, p, x, rope, layer: gated_deltanet(m.la, p, x, spec.rms_eps),
    # Kimi Linear: delta rule with a per-channel decay
    blocks.KDA: lambda spec, m, p, x, rope, layer: kimi_delta_attention(m.la, p, x, spec.rms_eps, m.gate_bound),
    # Jamba, Granite 4.0, Nemotron-H: a selective state-space scan
    blocks.MambaMixer: lambda spec, m, p, x, rope, layer: mamba_mixer(m.mamba, p, x),
    blocks.Lightning: lambda spec, m, p, x, rope, layer: lightning_attention(p, x, m.heads, m.head_dim),
    blocks.ShortConv: lambda spec, m, p, x, rope, layer: short_conv(p, x),  # LFM2
    # JetMoE: routed q/o projections over shared k/v
    blocks.MoA: lambda spec, m, p, x, rope, layer: moa_attention(p, x, rope, m.top_k, m.kv_heads, m.head_dim),
}


def mixer_forward(
    spec: ModelSpec, mixer: blocks.Mixer, p: dict[str, torch.Tensor], x_BTH: torch.Tensor, rope: Rope, layer: int
) -> torch.Tensor:
    """The token mixer's output for its normed input (:data:`MIXERS`)."""
    return MIXERS[type(mixer)](spec, mixer, p, x_BTH, rope, layer)


def _moe(
    spec: ModelSpec,
    lw: LayerWeights,
    ffn: blocks.MoE,
    moe_in: torch.Tensor,
    extra: ExtraExperts | None,
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
    moe: MoEForward | None,
) -> tuple[torch.Tensor, torch.Tensor | None, MoETap | None]:
    """The MoE block: (its output, None, its taps: the normed input y it read is ``tap.y_NH``,
    all N tokens' where ``moe`` is the expert-parallel replay's)."""
    assert lw.routed
    tap: MoETap | None
    if moe is None:
        out, tap = moe_block(spec, lw, moe_in, extra, keep)
    else:
        out, tap = moe(spec, lw, moe_in)
    if ffn.out_norm:  # A.X-K1: RMSNorm on routed + shared before the residual add
        out = rms_norm(out, lw.params["moe_out_norm"], spec.rms_eps)
    return out, None, tap


def _dense(
    spec: ModelSpec,
    lw: LayerWeights,
    ffn: blocks.DenseMLP,
    moe_in: torch.Tensor,
    extra: ExtraExperts | None,
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
    moe: MoEForward | None,
) -> tuple[torch.Tensor, torch.Tensor | None, MoETap | None]:
    """A dense MLP: (its output, its normed input y, no taps)."""
    p = lw.params
    residual = spec.layers[lw.layer].residual
    w, b = mlp_norm(residual)
    # post-norm layers: the stream itself
    y = block_norm(spec, moe_in, p[w], p.get(b)) if residual.pre_norm else moe_in
    out = mlp(spec, p, "mlp_", y, lw.layer)
    if ffn.out_norm:  # AFMoE: normed as the MoE output is
        out = rms_norm(out, p["moe_out_norm"], spec.rms_eps)
    return out, y, None


# (spec, layer, the block, what it reads [B, T, H], the observers' extra sets, the experts'
# products to keep, the MoE forward where it is not ``moe_block``) → (output, y, taps)
FFNForward = Callable[
    [
        ModelSpec,
        LayerWeights,
        Any,
        torch.Tensor,
        ExtraExperts | None,
        dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
        MoEForward | None,
    ],
    tuple[torch.Tensor, torch.Tensor | None, MoETap | None],
]

# the layer's MLP / MoE record type → its forward (the only switch on the FFN's kind)
FFNS: dict[type, FFNForward] = {blocks.DenseMLP: _dense, blocks.MoE: _moe}


def _mixed(spec: ModelSpec, lw: LayerWeights, x_BTH: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the mixer reads: norm(x), or in OLMo-2's post-norm layers, ``pre_norm`` false, x
    itself; the mixer's output)."""
    layer, p = spec.layers[lw.layer], lw.params
    assert layer.mixer is not None
    x_norm = block_norm(spec, x_BTH, p["input_norm"], p.get("input_norm_bias")) if layer.residual.pre_norm else x_BTH
    return x_norm, mixer_forward(spec, layer.mixer, p, x_norm, rope, lw.layer)


def _added(r: blocks.Residual, h_BTH: torch.Tensor, out_BTH: torch.Tensor) -> torch.Tensor:
    """h + m·out, m the residual multiplier (Granite; the product is skipped where m = 1)."""
    return h_BTH + (out_BTH if r.multiplier == 1.0 else out_BTH * r.multiplier)


def attention_block(spec: ModelSpec, lw: LayerWeights, x_BTH: torch.Tensor, rope: Rope) -> torch.Tensor:
    """h = x + m·mixer(norm(x)): the residual stream entering the MLP / MoE block of an additive
    wiring (x itself where a single-block layer is only that block, Nemotron-H)."""
    if spec.layers[lw.layer].mixer is None:
        return x_BTH
    _, out = _mixed(spec, lw, x_BTH, rope)
    return _added(spec.layers[lw.layer].residual, x_BTH, out)


def deepnorm_attention_block(spec: ModelSpec, lw: LayerWeights, x_BTH: torch.Tensor, rope: Rope) -> torch.Tensor:
    """MiniMax-01's DeepNorm: h = α·norm(x) + β·mixer(norm(x)), no identity path from x."""
    x_norm, out = _mixed(spec, lw, x_BTH, rope)
    scales = spec.layers[lw.layer].residual.scales
    assert scales is not None
    a, b = scales[0]
    return x_norm * a + out * b


def shortcut_rest(
    spec: ModelSpec, lw: LayerWeights, h_BTH: torch.Tensor, y_BTH: torch.Tensor, rope: Rope
) -> torch.Tensor:
    """A LongCat-Flash layer without its MoE: from h = x + attention₁(norm(x)) and y = post_norm(h)
    (the MoE's input too), m = h + MLP₁(y), a = m + attention₂(norm₂(m)), a + MLP₂(post_norm₂(a)).
    The layer's output is this plus the MoE output (``Residual.shortcut``)."""
    layer, p = spec.layers[lw.layer], lw.params
    assert layer.mixer is not None
    second = {n.removeprefix(SECOND_BLOCK): t for n, t in p.items() if n.startswith(SECOND_BLOCK)}
    m = h_BTH + mlp(spec, p, "mlp_", y_BTH)
    a = m + mixer_forward(spec, layer.mixer, second, block_norm(spec, m, second["input_norm"]), rope, lw.layer)
    return a + mlp(spec, second, "mlp_", block_norm(spec, a, second["post_norm"]))


def hc_attention_block(spec: ModelSpec, lw: LayerWeights, x_BTSH: torch.Tensor, rope: Rope) -> torch.Tensor:
    """HY-V4: the streams after the attention sub-block, x_s + post_s · attention(norm(Σ pre x))."""
    layer, p = spec.layers[lw.layer], lw.params
    assert layer.mixer is not None
    post, a_BTH = hc_mix(spec, p["attn_hc_fn"], p["attn_hc_base"], p["attn_hc_scale"], x_BTSH)
    assert post is not None
    out = mixer_forward(spec, layer.mixer, p, block_norm(spec, a_BTH, p["input_norm"]), rope, lw.layer)
    return hc_add(post, out, x_BTSH)


Keep = dict[int, tuple[torch.Tensor, torch.Tensor]]
Tapped = tuple[torch.Tensor, MoETap | None]


def _ffn(
    spec: ModelSpec,
    lw: LayerWeights,
    moe_in: torch.Tensor,
    extra: ExtraExperts | None,
    keep: Keep | None,
    moe: MoEForward | None,
) -> tuple[torch.Tensor, torch.Tensor | None, MoETap | None]:
    """The layer's MLP / MoE block on what it reads (:data:`FFNS`)."""
    ffn = spec.layers[lw.layer].ffn
    return FFNS[type(ffn)](spec, lw, ffn, moe_in, extra, keep, moe)


def _sequential(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    rope: Rope,
    extra: ExtraExperts | None,
    keep: Keep | None,
    moe: MoEForward | None,
) -> Tapped:
    """h = x + m·mixer(norm(x)), then h + m·f(norm(h))."""
    h = attention_block(spec, lw, x_BTH, rope)
    out, _, tap = _ffn(spec, lw, h, extra, keep, moe)
    return _added(spec.layers[lw.layer].residual, h, out), tap


def _parallel(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    rope: Rope,
    extra: ExtraExperts | None,
    keep: Keep | None,
    moe: MoEForward | None,
) -> Tapped:
    """Cohere: x + m·mixer(norm(x)) + m·f(norm(x)), the MLP / MoE block reading the layer input
    (through the one norm, ``moe.mlp_norm``), added as (x + m·mixer) + m·f."""
    h = attention_block(spec, lw, x_BTH, rope)
    out, _, tap = _ffn(spec, lw, x_BTH, extra, keep, moe)
    return _added(spec.layers[lw.layer].residual, h, out), tap


def _single_block(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    rope: Rope,
    extra: ExtraExperts | None,
    keep: Keep | None,
    moe: MoEForward | None,
) -> Tapped:
    """Nemotron-H: the layer is one block, x + m·f(norm(x)), f its mixer or its MLP / MoE block."""
    h = attention_block(spec, lw, x_BTH, rope)  # x where the block is the MLP / MoE
    if spec.layers[lw.layer].ffn is None:
        return h, None
    out, _, tap = _ffn(spec, lw, h, extra, keep, moe)
    return _added(spec.layers[lw.layer].residual, h, out), tap


def _deepnorm(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    rope: Rope,
    extra: ExtraExperts | None,
    keep: Keep | None,
    moe: MoEForward | None,
) -> Tapped:
    """MiniMax-01: h = α₁·norm(x) + β₁·mixer(norm(x)), then α₂·y + β₂·f(y), y = norm(h) (the
    MoE's: in its taps)."""
    h = deepnorm_attention_block(spec, lw, x_BTH, rope)
    out, y, tap = _ffn(spec, lw, h, extra, keep, moe)
    y = y if tap is None else tap.y_NH.view_as(out)
    scales = spec.layers[lw.layer].residual.scales
    assert y is not None and scales is not None
    alpha, beta = scales[1]
    return y * alpha + out * beta, tap


def _shortcut(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    rope: Rope,
    extra: ExtraExperts | None,
    keep: Keep | None,
    moe: MoEForward | None,
) -> Tapped:
    """LongCat-Flash: the MoE reads the stream after the first attention, h, and its output is
    added at the end (:func:`shortcut_rest`). Not expert-parallel (``Residual.sharded``)."""
    assert moe is None
    h = attention_block(spec, lw, x_BTH, rope)
    moe_out, moe_tap = moe_block(spec, lw, h, extra, keep)
    return shortcut_rest(spec, lw, h, moe_tap.y_NH.view_as(h), rope) + moe_out, moe_tap


def hc_decoder_layer(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTSH: torch.Tensor,
    rope: Rope,
    extra: ExtraExperts | None = None,
    keep: Keep | None = None,
    moe: MoEForward | None = None,
) -> Tapped:
    """A HY-V4 layer on its streams x [B, T, hc, H]: the attention sub-block, then the MLP / MoE
    block reading the mix m = Σ pre_s x_s its own hyper-connection forms (the MoE's h, whose norm
    gives y = γ ⊙ z), its output added onto every stream × post_s. Not expert-parallel
    (``Residual.sharded``)."""
    assert moe is None
    p = lw.params
    x1 = hc_attention_block(spec, lw, x_BTSH, rope)
    post, m_BTH = hc_mix(spec, p["ffn_hc_fn"], p["ffn_hc_base"], p["ffn_hc_scale"], x1)
    assert post is not None
    tap = None
    if lw.routed:
        out, tap = moe_block(spec, lw, m_BTH, extra, keep)
    else:
        out = mlp(spec, p, "mlp_", block_norm(spec, m_BTH, p["post_norm"]))
    return hc_add(post, out, x1), tap


# (spec, layer, its input, RoPE, the observers' extra sets, the experts' products to keep, the MoE
# forward where it is not ``moe_block``) → (the layer's output, the MoE block's taps)
ResidualForward = Callable[
    [ModelSpec, LayerWeights, torch.Tensor, Rope, ExtraExperts | None, Keep | None, MoEForward | None], Tapped
]

# the residual's wiring (``Residual.wiring``) → the layer's forward (the only switch on it)
RESIDUALS: dict[str, ResidualForward] = {
    "sequential": _sequential,
    "parallel": _parallel,
    "single_block": _single_block,
    "deepnorm": _deepnorm,
    "shortcut": _shortcut,
    "hyper_connection": hc_decoder_layer,
}


def decoder_layer(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    rope: Rope,
    extra: ExtraExperts | None = None,
    keep: Keep | None = None,
    moe: MoEForward | None = None,
) -> Tapped:
    """One decoder layer: (its output, the MoE block's taps where it is routed), by its residual
    wiring (:data:`RESIDUALS`). ``moe``: the MoE block's forward where it is not
    :func:`moe_block` (the expert-parallel replay's, whose taps only rank 0 keeps)."""
    return RESIDUALS[spec.layers[lw.layer].residual.wiring](spec, lw, x_BTH, rope, extra, keep, moe)
