"""Rotary position embeddings: the tables (default, YaRN, Llama 3, longrope; one per kind of
layer where a model has several) and their rotate-half and interleaved application."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from moeaudit.spec.blocks import Attention
from moeaudit.spec.config import AttentionKind, LayerSettings, Llama3Rope, ModelSpec, Rope, Yarn


def rope_tables(spec: ModelSpec, T: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos_TD, sin_TD of rotate-half RoPE (positions 0..T-1 of every window); D is the rotated
    part of a head (``spec.rope_dim``: all of it unless the rotary is partial).

    With attention per kind of layer (``spec.attention_kinds``): cos_KTD, sin_KTD, one table per
    kind stacked, each zero-padded to the widest kind's D (:func:`kind_rope` takes a layer's)."""
    if spec.attention_kinds:
        tables = [rope_tables(_kind_spec(spec, a), T, device) for a in spec.attention_kinds]
        width = max(c.shape[-1] for c, _ in tables)
        return (
            torch.stack([F.pad(c, (0, width - c.shape[-1])) for c, _ in tables]),
            torch.stack([F.pad(s, (0, width - s.shape[-1])) for _, s in tables]),
        )
    D = spec.rope_dim
    r = spec.rope
    Df = r.freq_dim or D  # the width the frequencies are computed for (transformers' ``dim``)
    inv_freq = 1.0 / (r.theta ** (torch.arange(0, Df, 2, dtype=torch.float32, device=device) / Df))
    if r.yarn is not None:
        inv_freq = yarn_inv_freq(r.yarn, r.theta, Df, device)
    if Df != D:  # Mistral 4: that table, broadcast over the D/2 rotated pairs as transformers does
        inv_freq = inv_freq.expand(D // 2)
    if r.llama3 is not None:
        inv_freq = _llama3_inv_freq(r.llama3, inv_freq)
    if (lr := r.longrope) is not None:  # transformers' Phi-3.5-MoE: short factors at every length
        shape = torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D
        inv_freq = 1.0 / (torch.tensor(lr.short_factor, dtype=torch.float32, device=device) * r.theta**shape)
    freqs_TD2 = torch.arange(T, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    emb_TD = torch.cat((freqs_TD2, freqs_TD2), dim=-1)
    if lr is not None:
        m = lr.short_mscale if T <= lr.original_max_positions else lr.long_mscale
        return emb_TD.cos() * m, emb_TD.sin() * m
    if r.yarn is not None:
        a = r.yarn.attention_factor
        return emb_TD.cos() * a, emb_TD.sin() * a
    return emb_TD.cos(), emb_TD.sin()


def _kind_spec(spec: ModelSpec, a: AttentionKind) -> ModelSpec:
    """``spec`` with one kind of layer's attention as its own (default RoPE of that kind)."""
    return replace(
        spec, head_dim=a.head_dim, rope=Rope(a.rope_theta, a.rotary_dim), attention_kinds=(), settings=LayerSettings()
    )


def kind_rope(
    spec: ModelSpec, rope: tuple[torch.Tensor, torch.Tensor], layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE table ``layer`` uses: ``rope`` itself, or its kind's from the stacked tables."""
    mixer = spec.layers[layer].mixer
    if not isinstance(mixer, Attention) or (k := mixer.attention_kind) is None:
        return rope
    D = spec.attention_kinds[k].rope_dim
    return rope[0][k, :, :D], rope[1][k, :, :D]


def yarn_inv_freq(y: Yarn, base: float, D: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters``: interpolate the low frequencies by the
    factor, keep the high ones, ramp linearly between the correction dims (D rotated dims,
    RoPE base ``base``; DeepSeek-V4's compressed branches: ``compress_rope_theta``)."""

    def correction_dim(rotations: float) -> float:
        return D * math.log(y.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, D, 2).to(device=device, dtype=torch.float) / D)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (y.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolation * (1 - keep) + extrapolation * keep


def _llama3_inv_freq(r: Llama3Rope, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' ``_compute_llama3_parameters``: long wavelengths ÷ factor, short ones kept,
    a linear blend in 1/wavelength between."""
    low_wavelen = r.original_max_positions / r.low_freq_factor
    high_wavelen = r.original_max_positions / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    if r.high_freq_factor == r.low_freq_factor:  # no band between: nothing to blend
        return scaled
    smooth = (r.original_max_positions / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x0, x1), (x2, x3), … (DeepSeek's layout), output de-interleaved
    as transformers' ``apply_rotary_pos_emb_interleave`` writes it; the same permutation hits
    q and k, so q·k equals that of the complex-pair form (V2)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` dims of each head, the rest passed
    through (partial rotary, transformers' ``apply_rotary_pos_emb`` of GLM-4-MoE and others)."""
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :R], x[..., R:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)
