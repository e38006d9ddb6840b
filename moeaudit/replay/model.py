"""The decoder of every supported family as plain functions of canonical weights.

One implementation serves the streaming replay (weights read one layer at a time), the
sample-run trainer (weights are leaf parameters) and the oracle tests. It follows
transformers' modeling code for each family (RMSNorm in float32, rotate-half RoPE, GQA,
softmax over all experts then top-k, optional renormalisation, SwiGLU experts).

Shape suffixes: B windows, T tokens per window, N = B·T tokens, H hidden size, E experts,
K top-k, V vocabulary, nh/nkv heads, D head dim, I expert dim, S residual streams (HY-V4's hc_mult).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moeaudit.checkpoint.checkpoint import LayerWeights
from moeaudit.replay import precision
from moeaudit.replay.deltanet import gated_deltanet
from moeaudit.replay.device import announce
from moeaudit.replay.dsa import sparse_causal_mask
from moeaudit.replay.excluded import exclude
from moeaudit.replay.kda import kimi_delta_attention
from moeaudit.replay.lightning import lightning_attention
from moeaudit.replay.mamba import mamba_mixer
from moeaudit.replay.moa import moa_attention
from moeaudit.replay.shortconv import short_conv
from moeaudit.spec.config import MLA_NORM_EPS, SECOND_BLOCK, AttentionKind, ClampedGLU, Gate, ModelSpec, Yarn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def block_norm(
    spec: ModelSpec,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """The decoder's block and final norm: RMSNorm, or LayerNorm with a bias (Phi-3.5-MoE);
    ``eps`` the final norm's (``spec.final_eps``) where it differs from the layers' (JetMoE)."""
    eps = spec.rms_eps if eps is None else eps
    if spec.layer_norm:
        return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
    return rms_norm(x, weight, eps)


def embed(
    spec: ModelSpec, table_VH: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The decoder's input: the tokens' embedding rows (× Granite's ``embedding_multiplier``).
    The rows are cast to the compute ``dtype`` before any scaling: a multiplier applied in the
    stored bf16/fp16 would round there, so the file's dtype would change the math (issue 24)."""
    x = F.embedding(tokens.long(), table_VH)
    x = x if dtype is None else x.to(dtype)
    x = x if spec.embedding_multiplier == 1.0 else x * spec.embedding_multiplier
    if spec.hc_mult:  # HY-V4: the same row on each of the hc_mult residual streams, [B, T, hc, H]
        return x.unsqueeze(-2).expand(*x.shape[:-1], spec.hc_mult, x.shape[-1]).contiguous()
    return x


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
    Df = spec.rope_freq_dim or D  # the width the frequencies are computed for (transformers' ``dim``)
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, Df, 2, dtype=torch.float32, device=device) / Df))
    if spec.yarn is not None:
        inv_freq = _yarn_inv_freq(spec, Df, device)
    if Df != D:  # Mistral 4: that table, broadcast over the D/2 rotated pairs as transformers does
        inv_freq = inv_freq.expand(D // 2)
    if spec.llama3_rope is not None:
        inv_freq = _llama3_inv_freq(spec, inv_freq)
    if (lr := spec.longrope) is not None:  # transformers' Phi-3.5-MoE: short factors at every length
        shape = torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D
        inv_freq = 1.0 / (torch.tensor(lr.short_factor, dtype=torch.float32, device=device) * spec.rope_theta**shape)
    freqs_TD2 = torch.arange(T, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    emb_TD = torch.cat((freqs_TD2, freqs_TD2), dim=-1)
    if lr is not None:
        m = lr.short_mscale if T <= lr.original_max_positions else lr.long_mscale
        return emb_TD.cos() * m, emb_TD.sin() * m
    if spec.yarn is not None:
        a = spec.yarn.attention_factor
        return emb_TD.cos() * a, emb_TD.sin() * a
    return emb_TD.cos(), emb_TD.sin()


def _kind_spec(spec: ModelSpec, a: AttentionKind) -> ModelSpec:
    """``spec`` with one kind of layer's attention as its own (default RoPE of that kind)."""
    return replace(
        spec,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        rope_theta=a.rope_theta,
        rotary_dim=a.rotary_dim,
        attention_sinks=a.sinks,
        yarn=None,
        llama3_rope=None,
        longrope=None,
        attention_kinds=(),
        layer_kinds=(),
    )


def kind_rope(
    spec: ModelSpec, rope: tuple[torch.Tensor, torch.Tensor], layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE table ``layer`` uses: ``rope`` itself, or its kind's from the stacked tables."""
    a = spec.attention_kind(layer)
    if a is None:
        return rope
    k, D = spec.layer_kinds[layer], a.rope_dim
    return rope[0][k, :, :D], rope[1][k, :, :D]


def _yarn_inv_freq(spec: ModelSpec, D: int, device: torch.device | str) -> torch.Tensor:
    assert spec.yarn is not None
    return yarn_inv_freq(spec.yarn, spec.rope_theta, D, device)


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


def _llama3_inv_freq(spec: ModelSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' ``_compute_llama3_parameters``: long wavelengths ÷ factor, short ones kept,
    a linear blend in 1/wavelength between."""
    r = spec.llama3_rope
    assert r is not None
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


def _linear(x: torch.Tensor, p: dict[str, torch.Tensor], w: str, b: str) -> torch.Tensor:
    return F.linear(x, p[w], p.get(b))


def mla_attention(
    spec: ModelSpec,
    p: dict[str, torch.Tensor],
    x_BTH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    layer: int = -1,
) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3): the query through a low-rank bottleneck
    with its own RMSNorm, keys and values expanded from one normalised latent per token, and a
    single rotary key shared by every head; heads are ``qk_nope + qk_rope`` wide."""
    m = spec.mla
    assert m is not None
    B, T, _ = x_BTH.shape
    nh, nope, rot = spec.num_heads, m.qk_nope_dim, m.qk_rope_dim
    q_lat = None
    eps = MLA_NORM_EPS if spec.mla_norm_eps is None else spec.mla_norm_eps
    if m.q_lora_rank:
        q_lat = rms_norm(_linear(x_BTH, p, "q_a", "q_a_bias"), p["q_a_norm"], eps)
        q = F.linear(q_lat, p["q_b"])
    else:
        q = F.linear(x_BTH, p["q"])
    if spec.mla_lora_scale:  # LongCat: the query (nope and rope parts) × √(H / q_lora_rank)
        q = q * (spec.hidden_size / m.q_lora_rank) ** 0.5
    q_nope, q_rot = q.view(B, T, nh, m.qk_head_dim).transpose(1, 2).split([nope, rot], dim=-1)
    kv_lat, k_rot = _linear(x_BTH, p, "kv_a", "kv_a_bias").split([m.kv_lora_rank, rot], dim=-1)
    kv_lat = rms_norm(kv_lat, p["kv_a_norm"], eps)
    if spec.mla_lora_scale:  # LongCat: the normed latent × √(H / kv_lora_rank), before its expansion
        kv_lat = kv_lat * (spec.hidden_size / m.kv_lora_rank) ** 0.5
    k_rot = k_rot.view(B, 1, T, rot)
    cos, sin = rope
    if layer in spec.nope_layers:  # Kimi Linear: the "rope" dims are used as they are
        pass
    elif m.rope_interleave:
        q_rot, k_rot = _rotate_interleaved(q_rot, cos, sin), _rotate_interleaved(k_rot, cos, sin)
    else:
        q_rot = q_rot * cos + _rotate_half(q_rot) * sin
        k_rot = k_rot * cos + _rotate_half(k_rot) * sin
    kv = F.linear(kv_lat, p["kv_b"]).view(B, T, nh, nope + m.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([nope, m.v_head_dim], dim=-1)
    q_BnTD = torch.cat([q_nope, q_rot], dim=-1)
    if spec.query_position_scale is not None:  # Mistral 4: 1 + β·log(1 + ⌊pos / L⌋), 1 below L
        beta, length = spec.query_position_scale
        pos = torch.arange(T, device=x_BTH.device, dtype=torch.float32)
        q_BnTD = q_BnTD * (1 + beta * torch.log(1 + torch.floor(pos / length)))[:, None].to(q_BnTD.dtype)
    k_BnTD = torch.cat([k_nope, k_rot.expand(B, nh, T, rot)], dim=-1)
    mask = None
    if (si := spec.sparse_index) is not None and T > si.topk:  # T ≤ topk: DSA keeps every causal key
        if layer in spec.shared_index_layers:  # refused before the replay starts (engine.check_replayable)
            raise ValueError(f"layer {layer} reuses another layer's DSA key selection, which is not replayed")
        assert q_lat is not None  # the config reader requires q_lora_rank for DSA
        mask = sparse_causal_mask(
            p,
            x_BTH,
            q_lat,
            rope,
            si.n_heads,
            si.head_dim,
            si.topk,
            spec.index_rope_interleave,
            spec.index_rope_last,
            spec.index_norm_eps,
        )
    scale = spec.attention_scale
    if spec.attention_sinks:  # HY-V4: a learned sink logit per head, as gpt-oss's
        assert scale is not None  # MLA's scale is always set (config.rope)
        q_BnTD, k_BnTD, v, mask = _with_sink_key(p["sinks"], q_BnTD, k_BnTD, v, mask, scale)
    out = F.scaled_dot_product_attention(q_BnTD, k_BnTD, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    if spec.output_gate == "head_sigmoid":  # Ling 3: σ(W_g x) per head, rounded to the activations' dtype
        gate = torch.sigmoid(F.linear(x_BTH, p["g_proj"]).float()).to(x_BTH.dtype)
        out = out * gate.transpose(1, 2)[..., None]
    out_BTX = out.transpose(1, 2).reshape(B, T, nh * m.v_head_dim)
    if spec.output_gate == "sigmoid":  # HY-V4: σ(W_g x) per channel of every head's output
        out_BTX = out_BTX * torch.sigmoid(F.linear(x_BTH, p["g_proj"]))
    return _linear(out_BTX, p, "o", "o_bias")


def attention(
    spec: ModelSpec,
    p: dict[str, torch.Tensor],
    x_BTH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    window: int | None,
    layer: int = -1,
) -> torch.Tensor:
    if spec.mla is not None:
        return mla_attention(spec, p, x_BTH, rope, layer)
    B, T, _ = x_BTH.shape
    D, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    Dv, sinks = D, spec.attention_sinks
    if (kind := spec.attention_kind(layer)) is not None:  # MiMo-V2-Flash, Mellum: this layer kind's own
        D, nh, nkv, Dv, sinks = kind.head_dim, kind.num_heads, kind.num_kv_heads, kind.value_dim, kind.sinks
        rope = kind_rope(spec, rope, layer)
    if "qkv" in p:  # one fused [q | k | v] projection (Sarvam-30B)
        q, k, v = _linear(x_BTH, p, "qkv", "qkv_bias").split([nh * D, nkv * D, nkv * D], dim=-1)
    else:
        q, k, v = (_linear(x_BTH, p, n, f"{n}_bias") for n in ("q", "k", "v"))
    if kind is not None and kind.value_scale != 1.0:  # MiMo: the values × attention_value_scale
        v = v * kind.value_scale
    gate = None
    if spec.gated_attention:  # Qwen3-Next: per head [query | gate], the gate σ'd onto the output
        q, gate = q.view(B, T, nh, 2 * D).chunk(2, dim=-1)
        q, gate = q.reshape(B, T, nh * D), gate.reshape(B, T, nh * D)
    if spec.qk_norm == "full":  # OLMoE: one norm over all heads, before the head split
        q, k = rms_norm(q, p["q_norm"], spec.rms_eps), rms_norm(k, p["k_norm"], spec.rms_eps)
    if spec.clip_qkv is not None:
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    q_BTnD, k_BTnD, v_BTnD = q.view(B, T, nh, D), k.view(B, T, nkv, D), v.view(B, T, nkv, Dv)
    if spec.qk_norm == "head":  # Qwen3: per-head norm
        q_BTnD = rms_norm(q_BTnD, p["q_norm"], spec.rms_eps)
        k_BTnD = rms_norm(k_BTnD, p["k_norm"], spec.rms_eps)
    cos, sin = rope
    q_BnTD = q_BTnD.transpose(1, 2)
    k_BnTD = k_BTnD.transpose(1, 2)
    nope = layer in spec.nope_layers  # Llama 4: no RoPE on these layers
    if not nope and spec.rope_interleaved:  # ERNIE 4.5, Llama 4: adjacent pairs; q and k permuted alike
        q_BnTD, k_BnTD = _rotate_interleaved(q_BnTD, cos, sin), _rotate_interleaved(k_BnTD, cos, sin)
    elif not nope:
        q_BnTD, k_BnTD = apply_rope(q_BnTD, cos, sin), apply_rope(k_BnTD, cos, sin)
    if spec.qk_norm == "l2" and not nope:  # Llama 4: weightless RMS norm of the rotated q and k
        q_BnTD = _l2_norm(q_BnTD, spec.rms_eps)
        k_BnTD = _l2_norm(k_BnTD, spec.rms_eps)
    if nope and spec.attn_temperature is not None:  # Llama 4: query temperature grows with position
        attn_scale, floor_scale = spec.attn_temperature
        pos = torch.arange(T, device=x_BTH.device, dtype=torch.float32)
        q_BnTD = q_BnTD * (torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0)[:, None]
    if spec.qk_norm == "head_after_rope":  # Hunyuan: per-head norm of the rotated q and k
        q_BnTD = rms_norm(q_BnTD, p["q_norm"], spec.rms_eps)
        k_BnTD = rms_norm(k_BnTD, p["k_norm"], spec.rms_eps)
    v_BnTD = v_BTnD.transpose(1, 2)
    if nkv != nh:
        k_BnTD = k_BnTD.repeat_interleave(nh // nkv, dim=1)
        v_BnTD = v_BnTD.repeat_interleave(nh // nkv, dim=1)
    mask = _causal_mask(T, window, x_BTH.device)
    if layer in spec.chunked_layers and spec.attention_chunk is not None and spec.attention_chunk < T:
        mask = _chunked_mask(T, spec.attention_chunk, x_BTH.device)
    scale = D**-0.5 if spec.attention_scale is None else spec.attention_scale  # Granite: attention_multiplier
    if sinks:
        q_BnTD, k_BnTD, v_BnTD, mask = _with_sink_key(p["sinks"], q_BnTD, k_BnTD, v_BnTD, mask, scale)
    out = F.scaled_dot_product_attention(q_BnTD, k_BnTD, v_BnTD, attn_mask=mask, is_causal=mask is None, scale=scale)
    out_BTH = out.transpose(1, 2).reshape(B, T, nh * Dv)
    if gate is not None:
        out_BTH = out_BTH * torch.sigmoid(gate)
    if spec.output_gate == "sigmoid":  # AFMoE: σ(W_g x) per channel
        out_BTH = out_BTH * torch.sigmoid(F.linear(x_BTH, p["g_proj"]))
    elif spec.output_gate == "head_sigmoid":  # Step 3.5: σ(W_g x) per head, broadcast over its dims
        g = torch.sigmoid(F.linear(x_BTH, p["g_proj"]))
        out_BTH = (out_BTH.view(B, T, nh, Dv) * g[..., None]).view(B, T, nh * Dv)
    elif spec.output_gate:  # Laguna: softplus(W_g x) per head (broadcast over its dims) or per channel
        g = F.softplus(F.linear(x_BTH, p["g_proj"]).float())
        out_BTH = (
            (out_BTH.view(B, T, nh, Dv) * g[..., None]).view(B, T, nh * Dv)
            if spec.output_gate == "head"
            else out_BTH * g
        )
    return _linear(out_BTH, p, "o", "o_bias")


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def _chunked_mask(T: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Causal attention within blocks of ``chunk`` tokens (Llama 4's chunked attention)."""
    i = torch.arange(T, device=device)
    return (i[:, None] >= i[None, :]) & (i[:, None] // chunk == i[None, :] // chunk)


def _with_sink_key(
    sinks_n: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_TT: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's attention sinks as one more key: softmax over [q·k_j·scale …, sink_h], the
    sink's share dropped, is attention with an extra key scoring sink_h for every query and
    carrying a zero value. Each head gets a (D+1)-th dim: 1 in the queries, 0 in the real keys,
    sink_h/scale in the sink key; the sink key is visible to every query. So the kernel stays
    ``scaled_dot_product_attention`` (no [T, T] scores in Python) and autograd reaches the sinks."""
    B, nh, T, D = q.shape
    q1 = torch.cat([q, q.new_ones(B, nh, T, 1)], dim=-1)
    k1 = torch.cat([k, k.new_zeros(B, nh, T, 1)], dim=-1)
    sink_key = torch.cat([k.new_zeros(nh, D), (sinks_n.to(k.dtype) / scale)[:, None]], dim=-1)
    k1 = torch.cat([sink_key[None, :, None].expand(B, nh, 1, D + 1), k1], dim=2)
    v1 = torch.cat([v.new_zeros(B, nh, 1, v.shape[-1]), v], dim=2)  # MLA (HY-V4): values v_head_dim wide
    causal = mask_TT if mask_TT is not None else _causal_mask(T, None, q.device, force=True)
    assert causal is not None  # [T, T], or DSA's [B, 1, T, T] (HY-V4)
    mask = torch.cat([causal.new_ones(*causal.shape[:-1], 1), causal], dim=-1)
    return q1, k1, v1, mask


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` dims of each head, the rest passed
    through (partial rotary, transformers' ``apply_rotary_pos_emb`` of GLM-4-MoE and others)."""
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :R], x[..., R:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


def _causal_mask(T: int, window: int | None, device: torch.device, force: bool = False) -> torch.Tensor | None:
    """The [T, T] boolean mask of a (sliding-window) causal attention; None where plain causal
    attention (``is_causal``) is the same, unless ``force``."""
    if (window is None or window >= T) and not force:
        return None
    window = T if window is None else window
    i = torch.arange(T, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def relu2_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's non-gated MLP: W2 relu(W1 x)² (transformers' ``relu2`` activation)."""
    return F.linear(torch.square(F.relu(F.linear(x, w1))), w2)


def mlp(spec: ModelSpec, p: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """A dense MLP (``mlp_``) or shared expert (``shared_``) of the family's kind; on a layer
    with a clamp after the activation (Step 3.5 ``swiglu_limits_shared``, ``spec.mlp_glu_limit``),
    W2(min(silu(W1 x), L) ⊙ clamp(W3 x, ±L)) as Step3p7MLP."""
    if spec.mlp_act == "relu2":
        return relu2_mlp(x, p[prefix + "w1"], p[prefix + "w2"])
    if limit := spec.mlp_glu_limit(layer):
        gate = F.silu(F.linear(x, p[prefix + "w1"])).clamp(max=limit)
        return F.linear(gate * F.linear(x, p[prefix + "w3"]).clamp(-limit, limit), p[prefix + "w2"])
    return swiglu(x, p[prefix + "w1"], p[prefix + "w3"], p[prefix + "w2"])


def clamped_glu(glu: ClampedGLU, a1: torch.Tensor, a3: torch.Tensor) -> torch.Tensor:
    """gpt-oss: (clamp(up, ±limit) + 1) ⊙ g σ(α g), g = min(gate, limit); with ``glu.after``
    (Step 3.5): (clamp(up, ±limit) + offset) ⊙ min(silu(gate), limit)."""
    if glu.after:
        assert glu.alpha == 1.0  # silu, as transformers' act_fn
        return (a3.clamp(-glu.limit, glu.limit) + glu.offset) * F.silu(a1).clamp(max=glu.limit)
    g = a1.clamp(max=glu.limit)
    return (a3.clamp(-glu.limit, glu.limit) + glu.offset) * (g * torch.sigmoid(glu.alpha * g))


def expert_mlp(w: dict[str, torch.Tensor], x: torch.Tensor, glu: ClampedGLU | None = None) -> torch.Tensor:
    """One routed expert's output u(x): SwiGLU, Nemotron-H's ReLU² (no ``w3``), or gpt-oss's
    biased clamped GLU; an expert without weights is a zero-computation expert, u(x) = x (LongCat)."""
    if not w:
        return x
    if "w3" not in w:
        return relu2_mlp(x, w["w1"], w["w2"])
    if glu is None:
        return swiglu(x, w["w1"], w["w3"], w["w2"])
    h = clamped_glu(glu, F.linear(x, w["w1"], w.get("b1")), F.linear(x, w["w3"], w.get("b3")))
    return F.linear(h, w["w2"], w.get("b2"))


@dataclass
class Routing:
    """Router outputs for N tokens of one layer (SPEC §3 taps s, ρ, R_k, c_e)."""

    scores_NE: torch.Tensor  # s: the selection scores (W_r y; DeepSeek-V3: σ(W_r y) + b)
    probs_NE: torch.Tensor  # ρ, the full gate distribution (sigmoid routers: σ(W_r y)/Σσ)
    topk_NK: torch.Tensor  # R_k, ordered by decreasing score
    combine_NK: torch.Tensor  # c_e for e in R_k
    logits_NE: torch.Tensor | None = None  # W_r y when s is not it (what transformers returns)
    margin_N: torch.Tensor | None = None  # distance to a routing change when groups limit R_k


def route(
    spec: ModelSpec,
    router_EH: torch.Tensor,
    y_NH: torch.Tensor,
    bias_E: torch.Tensor | None = None,
    logit_bias_E: torch.Tensor | None = None,
) -> Routing:
    """The family's routing rule (transformers' routers): softmax then top-k (Mixtral, OLMoE,
    Qwen, DeepSeek-V2 greedy) or sigmoid scores, a selection-only bias ``bias_E`` and
    group-limited top-k (DeepSeek-V3); optional renormalisation, then ``routed_scaling_factor``.
    ``logit_bias_E`` is part of the logits (gpt-oss's router is a biased linear layer)."""
    g = spec.gate
    logits = F.linear(y_NH, router_EH, logit_bias_E)
    if spec.router_softcap:  # Laguna: c·tanh(logit / c), in float32
        logits = torch.tanh(logits.float() / spec.router_softcap) * spec.router_softcap
    logits, bias_E = exclude(logits, bias_E)  # experts removed by the ablation receipt (replay.excluded)
    margin = None
    if g.scoring == "sparsemixer":
        return _sparsemixer(spec, logits)
    if g.scoring == "softmax":
        probs = torch.softmax(logits.float(), dim=-1)
        select = probs
        if bias_E is not None:  # ERNIE 4.5: softmax probabilities + a selection-only bias
            scores = probs + bias_E.float()
            top_idx = torch.topk(scores, spec.top_k, dim=-1).indices
            top_vals, raw_logits = probs.gather(1, top_idx), logits
        else:
            if g.grouped:  # DeepSeek-V2 group_limited_greedy: a group's score is its max
                # (Mistral 4: the sum of its best two probabilities, so margins in probabilities:
                # a sum of two logits does not order the groups as the sum of two probabilities)
                ranked = probs if g.group_score == "top2sum" else logits
                allowed, margin = _group_limit(g, probs, ranked.double(), spec.top_k)
                select = probs.masked_fill(~allowed, 0.0)
            top_vals, top_idx = torch.topk(select, spec.top_k, dim=-1)
            scores, raw_logits = logits, None
    else:
        sig = positive_scores(g.scoring, logits)
        probs = sig / sig.sum(dim=-1, keepdim=True)
        scores = sig if bias_E is None else sig + bias_E.float()
        # without a bias or groups, choose on the logits (Llama 4's router does): σ is monotone,
        # but saturates to 1.0 in float32 above ~17, where choosing on σ would meet ties
        # (Flint's router chooses on σ itself: ``sigmoid_select``)
        select = scores if bias_E is not None or g.grouped or spec.sigmoid_select else logits.float()
        if g.grouped:
            allowed, margin = _group_limit(g, scores, scores.double(), spec.top_k)
            select = scores.masked_fill(~allowed, float("-inf"))
        top_idx = torch.topk(select, spec.top_k, dim=-1).indices
        top_vals, raw_logits = sig.gather(1, top_idx), logits
    if spec.norm_topk_prob:
        eps = spec.renorm_eps or (1e-20 if g.scoring in POSITIVE_SCORES else 0.0)  # transformers' V3 denominator
        denom = top_vals.sum(dim=-1, keepdim=True) + eps
        top_vals = top_vals / (denom.clamp_min(spec.renorm_min) if spec.renorm_min else denom)
    if g.scaling != 1.0:
        top_vals = top_vals * g.scaling
    return Routing(scores, probs, top_idx, top_vals, raw_logits, margin)


POSITIVE_SCORES = ("sigmoid", "sqrtsoftplus")


def positive_scores(scoring: str, logits_NE: torch.Tensor) -> torch.Tensor:
    """A sigmoid-style router's scores, in float32: σ(logits), or DeepSeek-V4's √softplus(logits)."""
    if scoring == "sqrtsoftplus":
        return F.softplus(logits_NE.float()).sqrt()
    return torch.sigmoid(logits_NE.float())


def hash_route(spec: ModelSpec, router_EH: torch.Tensor, y_NH: torch.Tensor, topk_NK: torch.Tensor) -> Routing:
    """DeepSeek-V4's hash-routed layers (``DeepseekV4HashRouter``): the active set is fixed by
    the token id (R_k = ``tid2eid[token]``, in the table's order, not ordered by score); the
    learned router only weights it — its scores s gathered on R_k, renormalised (+1e-20),
    × ``routed_scaling_factor``. No selection happens, so there is no boundary."""
    logits = F.linear(y_NH, router_EH)
    scores = positive_scores(spec.gate.scoring, logits)
    top_vals = scores.gather(1, topk_NK)
    if spec.norm_topk_prob:
        top_vals = top_vals / (top_vals.sum(dim=-1, keepdim=True) + (spec.renorm_eps or 1e-20))
    if spec.gate.scaling != 1.0:
        top_vals = top_vals * spec.gate.scaling
    return Routing(scores, scores / scores.sum(dim=-1, keepdim=True), topk_NK, top_vals, logits)


def _sparsemixer(spec: ModelSpec, logits_NE: torch.Tensor) -> Routing:
    """Phi-3.5-MoE's sparsemixer in evaluation mode (transformers' ``sparsemixer`` with
    ``training=False``): the top-2 of the logits; each chosen expert's combine weight is its
    softmax over the experts whose logit lies within a relative band 2ε of its own (the first
    expert's rivals include every expert; the second's exclude the first). ρ is the plain
    softmax of the logits; the selection scores are the logits."""
    eps = spec.sparsemixer_eps or 0.0
    s = logits_NE.float()
    first_val, first = s.max(dim=-1, keepdim=True)
    masked = s.scatter(-1, first, float("-inf"))
    second_val, second = masked.max(dim=-1, keepdim=True)
    combine = []
    for rivals, top_val, idx in ((s, first_val, first), (masked, second_val, second)):
        with torch.no_grad():  # transformers computes the band without gradient
            far = ((top_val - s) / s.abs().clamp(min=top_val)) > 2 * eps
        combine.append(torch.softmax(rivals.masked_fill(far, float("-inf")), dim=-1).gather(-1, idx))
    return Routing(s, torch.softmax(s, dim=-1), torch.cat([first, second], dim=-1), torch.cat(combine, dim=-1))


def _group_limit(g: Gate, select_NE: torch.Tensor, s_NE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts allowed to compete [N, E], margin to a routing change [N]).

    The groups are chosen on ``select_NE`` exactly as transformers chooses them (float32; V2:
    softmax probabilities, V3: biased sigmoid scores). The margin, in float64 on the selection
    scores ``s_NE`` (V2: the logits, in which softmax margins are measured), is the smaller of
    the in-group margin s_(k) − s_(k+1) among the allowed experts and the gap between the
    weakest chosen and the strongest other group score, divided by how much moving every score
    by ±m/2 moves that gap (2 for a sum of two scores, 1 for a max), so both are in the units
    of the ungrouped margin (docs/decisions.md)."""
    N, E = select_NE.shape
    per = E // g.n_group

    def group_scores(x_NE: torch.Tensor) -> torch.Tensor:
        x = x_NE.view(N, g.n_group, per)
        return x.topk(2, dim=-1).values.sum(-1) if g.group_score == "top2sum" else x.amax(-1)

    chosen_idx = group_scores(select_NE).topk(g.topk_group, dim=-1).indices
    chosen = torch.zeros(N, g.n_group, dtype=torch.bool, device=select_NE.device)
    chosen.scatter_(1, chosen_idx, True)
    allowed = chosen[:, :, None].expand(N, g.n_group, per).reshape(N, E)
    g_NG = group_scores(s_NE)
    unit = 2.0 if g.group_score == "top2sum" else 1.0
    group_gap = (
        g_NG.masked_fill(~chosen, float("inf")).amin(-1) - g_NG.masked_fill(chosen, float("-inf")).amax(-1)
    ) / unit
    inner = torch.full_like(group_gap, float("inf"))
    if per * g.topk_group > k:
        ranked = s_NE.masked_fill(~allowed, float("-inf")).topk(k + 1, dim=-1).values
        inner = ranked[:, k - 1] - ranked[:, k]
    return allowed, torch.minimum(inner, group_gap)


def _expert_slots(topk_NK: torch.Tensor, E: int) -> tuple[torch.Tensor, list[int]]:
    """(slots of [N·K] sorted by expert, stable; tokens per expert)."""
    return _slots_of_sets([topk_NK], E)[0]


expert_slots = _expert_slots  # for callers that sweep the experts twice with one host sync (engine)


def _slots_of_sets(sets: Sequence[torch.Tensor], E: int) -> list[tuple[torch.Tensor, list[int]]]:
    """:func:`_expert_slots` of each set, the tokens per expert of all of them brought to the
    host together: one synchronisation per sweep over the experts, not one per set."""
    flat = [idx.reshape(-1) for idx in sets]
    counts = torch.stack([torch.bincount(f, minlength=E) for f in flat]).tolist()
    return [(torch.argsort(f, stable=True), c) for f, c in zip(flat, counts, strict=True)]


def experts_forward_sets(
    experts: Sequence[dict[str, torch.Tensor]],
    y_NH: torch.Tensor,
    sets: Sequence[torch.Tensor],
    glu: ClampedGLU | None = None,
    scales: Sequence[torch.Tensor] | None = None,
    only: range | None = None,
    sorted_slots: list[tuple[torch.Tensor, list[int]]] | None = None,
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """Raw expert outputs u_NXH (SPEC §3) for several expert-index sets [N, X] in one sweep
    over the experts: each expert is fetched once (lazy experts are converted once), and each
    set gets its own gathered batch, so its values are exactly those it would get alone.
    Each expert's outputs are written into their rows of the result as the sweep goes, so
    besides the result only one expert's temporaries exist at a time (issue 31 §6).

    ``scales`` (Llama 4, one [N, X] per set: the combine weight c each expert gets or would
    get) makes the input of expert e c·y and its output u_e(c·y)/c, so that Σ_k c_k u_k is the
    block's output Σ_k u_k(c_k y) and the receipts keep their (c, u) form (docs/families.md).

    ``only`` (expert-parallel replay, ``replay.sharded``): compute the experts in that range and
    leave the rows of the others zero; each expert's rows are those it gets in the full sweep.
    ``sorted_slots``: the sets' ``_slots_of_sets``, when the caller has them (one host sync fewer).

    ``keep`` (``replay.stash``): for the first set, each SwiGLU expert's products (W1 x, W3 x)
    are put there under its index, for the backward to use instead of forming them again; the
    output is the one :func:`swiglu` gives (the same products in the same order)."""
    slots = _slots_of_sets(sets, len(experts)) if sorted_slots is None else sorted_slots
    if precision.low_precision_experts():  # --precision bf16 (replay.precision)
        precision.check_sweep(glu is not None, scales is not None, only is not None)
        return precision.forward_sets(experts, y_NH, sets, slots)
    announce(
        experts,
        [
            e
            for e in range(len(experts))  # the experts read below, in order
            if any(counts[e] for _, counts in slots) and (only is None or e in only)
        ],
    )
    out = [y_NH.new_zeros(idx.numel(), y_NH.shape[-1]) for idx in sets]  # rows: flat (token, slot)
    starts = [0] * len(sets)
    for e in range(len(experts)):
        if not any(counts[e] for _, counts in slots) or (only is not None and e not in only):
            for i, (_, counts) in enumerate(slots):
                starts[i] += counts[e]
            continue
        w = experts[e]
        for i, (order, counts) in enumerate(slots):
            c = counts[e]
            if c:
                slots_c = order[starts[i] : starts[i] + c]
                tok = slots_c // sets[i].shape[1]
                if keep is not None and i == 0 and glu is None and scales is None and "w3" in w:
                    a1, a3 = F.linear(y_NH[tok], w["w1"]), F.linear(y_NH[tok], w["w3"])
                    u = F.linear(F.silu(a1) * a3, w["w2"])
                    keep[e] = (a1, a3)
                elif scales is None:
                    u = expert_mlp(w, y_NH[tok], glu)
                else:
                    s_C1 = scales[i].reshape(-1)[slots_c].to(y_NH.dtype)[:, None]
                    u = expert_mlp(w, y_NH[tok] * s_C1, glu)
                    u = torch.where(s_C1 > 0, u / s_C1.clamp_min(torch.finfo(u.dtype).tiny), 0.0)
                out[i][slots_c] = u
                del u
            starts[i] += c
        del w
    return [u.view(idx.shape[0], idx.shape[1], y_NH.shape[-1]) for u, idx in zip(out, sets, strict=True)]


def experts_forward(
    experts: Sequence[dict[str, torch.Tensor]],
    y_NH: torch.Tensor,
    topk_NK: torch.Tensor,
    glu: ClampedGLU | None = None,
    scales_NK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw expert outputs u_NKH (SPEC §3), batched per expert: gather its tokens, one MLP."""
    return experts_forward_sets(experts, y_NH, [topk_NK], glu, None if scales_NK is None else [scales_NK])[0]


def input_scales(spec: ModelSpec, routing: Routing, sets: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Llama 4: the combine weight σ(W_r y)_e each (token, expert) of ``sets`` gets, or would get
    were the expert chosen — the scale of that expert's input (``experts_forward_sets``); None
    for the other families."""
    if not spec.scaled_expert_inputs:
        return None
    assert routing.logits_NE is not None  # sigmoid routers keep their logits
    sig_NE = torch.sigmoid(routing.logits_NE.float())
    return [sig_NE.gather(1, idx) for idx in sets]


@dataclass
class ExpertsBackward:
    """Gradients through Σ_k c_k u_k(y) of one layer (see :func:`experts_backward`)."""

    y_NH: torch.Tensor  # dL/dy through the experts
    combine_NK: torch.Tensor  # dL/dc
    sq_E: torch.Tensor  # ‖∇_{θ_e} L‖² per expert, float64 (`000` Def. 6.1)
    dx_SH: torch.Tensor | None = None  # dL/dy per (token, slot) instead of y_NH (``slot_dx``)


def _swiglu_grads(
    x_MH: torch.Tensor,
    w: dict[str, torch.Tensor],
    g_out_MH: torch.Tensor,
    c_M1: torch.Tensor,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Backward of c·W2(silu(W1 x) ⊙ W3 x) given dL/d(out) = g_out: (dL/dx, dL/dc, [dW1, dW3, dW2]).
    The forward's W2 product is never needed: ⟨u, g⟩ = ⟨silu(a1)⊙a3, g W2⟩. ``kept``: the
    forward's (W1 x, W3 x) for these rows (``replay.stash``), instead of forming them again."""
    a1, a3 = (F.linear(x_MH, w["w1"]), F.linear(x_MH, w["w3"])) if kept is None else kept
    s, sig = F.silu(a1), torch.sigmoid(a1)
    h_MI = s * a3
    p_MI = g_out_MH @ w["w2"]  # dL/dh before the combine weight
    dc_M = (h_MI * p_MI).sum(-1)
    dh_MI = p_MI.mul_(c_M1)  # p is not needed again: the [M, I] temporaries are formed in place
    dw2 = (g_out_MH * c_M1).T @ h_MI
    da3 = dh_MI * s
    dsilu = torch.rsub(sig, 1).mul_(a1).add_(1).mul_(sig)  # silu'(a) = σ(a)(1 + a(1 − σ(a)))
    da1 = dh_MI.mul_(a3).mul_(dsilu)
    dx = da1 @ w["w1"] + da3 @ w["w3"]
    return dx, dc_M, [da1.T @ x_MH, da3.T @ x_MH, dw2]


def _relu2_grads(
    x_MH: torch.Tensor, w: dict[str, torch.Tensor], g_out_MH: torch.Tensor, c_M1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`_swiglu_grads` for Nemotron-H's non-gated c·W2 relu(a)², a = W1 x:
    (dL/dx, dL/dc, [dW1, dW2]); d relu(a)²/da = 2 relu(a)."""
    r_MI = F.relu(F.linear(x_MH, w["w1"]))
    h_MI = r_MI * r_MI
    p_MI = g_out_MH @ w["w2"]  # dL/dh before the combine weight
    dc_M = (h_MI * p_MI).sum(-1)
    dw2 = (g_out_MH * c_M1).T @ h_MI
    da1 = p_MI.mul_(c_M1).mul_(r_MI).mul_(2)
    return da1 @ w["w1"], dc_M, [da1.T @ x_MH, dw2]


def _clamped_glu_grads(
    glu: ClampedGLU, x_MH: torch.Tensor, w: dict[str, torch.Tensor], g_out_MH: torch.Tensor, c_M1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`_swiglu_grads` for gpt-oss's c·(W2 h + b2), h = (clamp(u, ±L) + 1) ⊙ g σ(α g),
    g = min(a, L), a = W1 x + b1, u = W3 x + b3: (dL/dx, dL/dc, [dW1, dW3, dW2, db1, db3, db2]).
    A clamped entry passes no gradient (torch's clamp backward: only min ≤ x ≤ max does).
    ``glu.after`` (Step 3.5): h = (clamp(u, ±L) + offset) ⊙ min(silu(a), L), the gate's gradient
    silu'(a) where silu(a) ≤ L, none where it is clamped."""
    L, alpha = glu.limit, glu.alpha
    a1, a3 = F.linear(x_MH, w["w1"], w.get("b1")), F.linear(x_MH, w["w3"], w.get("b3"))
    if glu.after:
        g, u = a1, a3.clamp(-L, L)
        sig, silu = torch.sigmoid(a1), F.silu(a1)
        act = silu.clamp(max=L)
    else:
        g, u = a1.clamp(max=L), a3.clamp(-L, L)
        sig = torch.sigmoid(alpha * g)
        act = g * sig
    h_MI = (u + glu.offset) * act
    p_MI = g_out_MH @ w["w2"]
    dc_M = (h_MI * p_MI).sum(-1)
    if "b2" in w:  # gpt-oss; HY-V4's clamped SwiGLU has no biases
        dc_M = dc_M + g_out_MH @ w["b2"]
    gc_MH = g_out_MH * c_M1
    dh_MI = p_MI * c_M1
    da3 = (dh_MI * act).masked_fill_((a3 < -L) | (a3 > L), 0.0)
    da1 = (dh_MI * (u + glu.offset) * sig * (1 + alpha * g * (1 - sig))).masked_fill_(
        (silu > L) if glu.after else (a1 > L), 0.0
    )
    dx = da1 @ w["w1"] + da3 @ w["w3"]
    biases = [da1.sum(0), da3.sum(0), gc_MH.sum(0)] if "b1" in w else []
    return dx, dc_M, [da1.T @ x_MH, da3.T @ x_MH, gc_MH.T @ h_MI, *biases]


def experts_backward(
    experts: Sequence[dict[str, torch.Tensor]],
    y_NH: torch.Tensor,
    topk_NK: torch.Tensor,
    combine_NK: torch.Tensor,
    grad_NH: torch.Tensor,
    glu: ClampedGLU | None = None,
    scaled_inputs: bool = False,
    only: range | None = None,
    slot_dx: bool = False,
    sorted_slots: tuple[torch.Tensor, list[int]] | None = None,
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> ExpertsBackward:
    """The backward pass of the routed experts, one expert at a time (SPEC §3 layer-local):
    each expert's weight gradients are formed, measured (sum of squares in float64) and
    dropped before the next expert is converted, so a layer's gradients never coexist.

    Expert-parallel replay (``replay.sharded``): ``only`` runs the experts in that range (the
    others' norms, dL/dc and dL/dy contributions stay zero); ``slot_dx`` returns each (token,
    slot)'s dL/dy in ``dx_SH`` [N·K, H] rather than their sum per token (``y_NH`` is then empty),
    so that the sum can be formed after the ranks' slots are brought together, in this order.
    ``sorted_slots``: ``expert_slots`` of ``topk_NK``, when the caller has them (one host sync fewer).
    ``kept``: the forward's (W1 x, W3 x) per expert (``replay.stash``), each dropped once used."""
    N, K = topk_NK.shape
    order, counts = _expert_slots(topk_NK, len(experts)) if sorted_slots is None else sorted_slots
    if precision.low_precision_experts():  # --precision bf16 (replay.precision)
        precision.check_sweep(glu is not None, scaled_inputs, only is not None or slot_dx)
        return ExpertsBackward(*precision.backward(experts, y_NH, topk_NK, combine_NK, grad_NH, order, counts))
    announce(experts, [e for e, c in enumerate(counts) if c and (only is None or e in only)])  # read below
    dy_NH = y_NH.new_zeros((0, y_NH.shape[1])) if slot_dx else torch.zeros_like(y_NH)
    dx_SH = y_NH.new_zeros((N * K, y_NH.shape[1])) if slot_dx else None
    dc_S = combine_NK.new_zeros(N * K)
    c_S = combine_NK.reshape(-1).to(y_NH.dtype)
    sq_E = y_NH.new_zeros(len(experts), dtype=torch.float64)  # stays where it is computed
    start = 0
    for e, c in enumerate(counts):
        if c and (only is None or e in only):
            slots = order[start : start + c]
            tok = slots // K
            x, c_M1 = y_NH[tok], c_S[slots, None]
            w = experts[e]  # fetched (converted, sent to the device) once
            if not w:  # LongCat's zero-computation expert: c·y; no weights, so no norm (sq_E[e] stays 0)
                g_M = grad_NH[tok]
                dx, dc = g_M * c_M1, (g_M * x).sum(-1)
                grads: list[torch.Tensor] = []
            elif "w3" not in w:  # Nemotron-H: non-gated ReLU²
                dx, dc, grads = _relu2_grads(x, w, grad_NH[tok], c_M1)
            elif scaled_inputs:  # Llama 4: out += u_e(c·y): backward through the input c·y
                xs, ones = x * c_M1, torch.ones_like(c_M1)
                if glu is None:
                    dxs, _, grads = _swiglu_grads(xs, w, grad_NH[tok], ones)
                else:
                    dxs, _, grads = _clamped_glu_grads(glu, xs, w, grad_NH[tok], ones)
                dx, dc = dxs * c_M1, (dxs * x).sum(-1)
            elif glu is None:
                dx, dc, grads = _swiglu_grads(x, w, grad_NH[tok], c_M1, None if kept is None else kept.pop(e, None))
            else:
                dx, dc, grads = _clamped_glu_grads(glu, x, w, grad_NH[tok], c_M1)
            if dx_SH is not None:
                dx_SH[slots] = dx
            else:
                dy_NH.index_add_(0, tok, dx)
            dc_S[slots] = dc.to(dc_S.dtype)
            norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
            del dx, dc, grads, x, c_M1, w  # before the next expert is converted
            sq_E[e] = _sum_of_squares(norms) if norms else 0.0
        start += c
    return ExpertsBackward(dy_NH, dc_S.view(N, K), sq_E, dx_SH)


def _sum_of_squares(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ n² in float64, summed left to right from 0 as the Python float sum it replaces."""
    total = norms[0].new_zeros(())
    for n in norms:
        total = total + n * n
    return total


ExtraExperts = Callable[[int, Routing], dict[str, torch.Tensor]]  # (layer, routing) → sets


@dataclass
class MoETap:
    """Per-layer taps of SPEC §3 for the N canary tokens."""

    layer: int
    h_NH: torch.Tensor  # residual stream entering the MoE block
    y_NH: torch.Tensor  # post-gain gate input γ ⊙ z (h itself without a pre-norm: ``spec.pre_norm``)
    routing: Routing
    u_NKH: torch.Tensor  # raw expert outputs for the active set
    extra_u: dict[str, torch.Tensor] = field(default_factory=dict)  # outputs observers asked for

    @property
    def r_N(self) -> torch.Tensor:
        return self._h_centred().pow(2).mean(-1).add(self._eps).sqrt()

    _eps: float = 0.0
    _centred: bool = False  # LayerNorm (Phi-3.5-MoE): the norm subtracts the mean first

    def _h_centred(self) -> torch.Tensor:
        return self.h_NH - self.h_NH.mean(-1, keepdim=True) if self._centred else self.h_NH

    @property
    def z_NH(self) -> torch.Tensor:
        """Pre-gain normalised state, ‖z‖² ≈ H (LayerNorm: also mean 0)."""
        return self._h_centred() / self.r_N[:, None]


def moe_router(spec: ModelSpec, lw: LayerWeights, h_NH: torch.Tensor) -> tuple[torch.Tensor, Routing]:
    """(y = γ ⊙ z, routing) of the MoE block for the residual h entering it; without a pre-norm
    (``spec.pre_norm`` false, OLMo-2 post-norm layers) the router and experts read h itself: y = h."""
    if not spec.pre_norm:
        return h_NH, route_layer(spec, lw.params, h_NH)
    w, b = mlp_norm(spec)
    y_NH = block_norm(spec, h_NH, lw.params[w], lw.params.get(b))
    return y_NH, route_layer(spec, lw.params, y_NH)


def mlp_norm(spec: ModelSpec) -> tuple[str, str]:
    """The norm (gain, bias) in front of the MLP / MoE block: ``post_norm``, or with a parallel
    block (Cohere) the one norm both branches read, ``input_norm`` (so that its gradient
    gathers both branches', as transformers' single norm parameter does), or a single-block
    layer's only norm (Nemotron-H)."""
    single = spec.parallel_block or bool(spec.block_kinds)
    return ("input_norm", "input_norm_bias") if single else ("post_norm", "post_norm_bias")


def mlp_input(spec: ModelSpec, x_BTH: torch.Tensor, h_BTH: torch.Tensor) -> torch.Tensor:
    """What the MLP / MoE block reads: h = x + attention(norm(x)), or with a parallel block
    (Cohere: x + attention(norm(x)) + mlp(norm(x))) the layer input x itself."""
    return x_BTH if spec.parallel_block else h_BTH


def route_layer(spec: ModelSpec, p: dict[str, torch.Tensor], y_NH: torch.Tensor) -> Routing:
    """:func:`route` with a layer's router tensors (weight, selection bias, logit bias)."""
    return route(spec, p["router"], y_NH, p.get("router_bias"), p.get("router_logit_bias"))


def shared_expert(spec: ModelSpec, p: dict[str, torch.Tensor], y_NH: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """The always-on expert: behind a sigmoid gate (Qwen2-MoE) or not (DeepSeek, whose
    ``n_shared_experts`` are stored as one MLP of their summed width); ``layer``: for a clamp
    per layer (Step 3.5, :func:`mlp`)."""
    if spec.shared_clamped:  # DeepSeek-V4: silu(min(gate, limit)) ⊙ clamp(up, ±limit), as DeepseekV4MLP
        assert spec.clamped_glu is not None  # validated with the spec
        limit = spec.clamped_glu.limit
        gate = F.linear(y_NH, p["shared_w1"]).clamp(max=limit)
        out = F.linear(F.silu(gate) * F.linear(y_NH, p["shared_w3"]).clamp(-limit, limit), p["shared_w2"])
    else:
        out = mlp(spec, p, "shared_", y_NH, layer)
    if spec.shared_gated:
        out = torch.sigmoid(F.linear(y_NH, p["shared_gate"])) * out
    return out if spec.shared_scale == 1.0 else out * spec.shared_scale


def moe_block(
    spec: ModelSpec,
    lw: LayerWeights,
    h_BTH: torch.Tensor,
    extra: ExtraExperts | None = None,
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, MoETap]:
    """The MoE block; ``extra(layer, routing)`` names more expert-index sets [N, X] whose
    outputs observers need (overlap receipts): they are computed in the same sweep over the
    experts, so each expert is converted once, and handed over in ``tap.extra_u``."""
    B, T, H = h_BTH.shape
    h_NH = h_BTH.reshape(-1, H)
    y_NH, routing = moe_router(spec, lw, h_NH)
    wanted = extra(lw.layer, routing) if extra is not None else {}
    sets = [routing.topk_NK, *wanted.values()]
    u_NKH, *more = experts_forward_sets(
        lw.experts, y_NH, sets, spec.expert_glu(lw.layer), input_scales(spec, routing, sets), keep=keep
    )
    out_NH = (u_NKH * routing.combine_NK.to(u_NKH.dtype)[..., None]).sum(1)
    if spec.shared_dim:
        out_NH = out_NH + shared_expert(spec, lw.params, y_NH, lw.layer)
    if spec.moe_bias:  # JetMoE: a bias on the block's output
        out_NH = out_NH + lw.params["moe_bias"]
    tap = MoETap(
        lw.layer,
        h_NH,
        y_NH,
        routing,
        u_NKH,
        dict(zip(wanted, more, strict=True)),
        _eps=spec.rms_eps,
        _centred=spec.layer_norm,
    )
    return out_NH.view(B, T, H), tap


def attention_block(
    spec: ModelSpec, lw: LayerWeights, x_BTH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """h = x + attention(norm(x)): the residual stream entering the MLP / MoE block (x itself
    where a single-block layer is only that block, Nemotron-H)."""
    p = lw.params
    if spec.block_kind(lw.layer) in ("mlp", "moe"):
        return x_BTH
    # OLMo-2 post-norm layers (``pre_norm`` false): attention reads the stream itself
    x_norm = block_norm(spec, x_BTH, p["input_norm"], p.get("input_norm_bias")) if spec.pre_norm else x_BTH
    if lw.layer in spec.linear_layers:
        assert spec.linear_attention is not None
        return x_BTH + gated_deltanet(spec.linear_attention, p, x_norm, spec.rms_eps)
    if lw.layer in spec.kda_layers:  # Kimi Linear: delta rule with a per-channel decay
        assert spec.linear_attention is not None
        return x_BTH + kimi_delta_attention(spec.linear_attention, p, x_norm, spec.rms_eps, spec.kda_gate_bound)
    if spec.residual_scales is not None:  # MiniMax-01: α·norm(x) + β·mixer(norm(x))
        light = lw.layer in spec.lightning_layers
        a, b = spec.residual_scales[1 if light else 0]
        out = (
            lightning_attention(p, x_norm, spec.num_heads, spec.head_dim)
            if light
            else attention(spec, p, x_norm, rope, spec.attention_window(lw.layer), lw.layer)
        )
        return x_norm * a + out * b
    if lw.layer in spec.mamba_layers:  # Jamba, Granite 4.0: a selective state-space scan
        assert spec.mamba is not None
        out = mamba_mixer(spec.mamba, p, x_norm)
        return x_BTH + (out if spec.residual_multiplier == 1.0 else out * spec.residual_multiplier)
    if lw.layer in spec.conv_layers:  # LFM2: a short causal convolution
        return x_BTH + short_conv(p, x_norm)
    if spec.moa:  # JetMoE: a mixture of attention heads (routed q/o projections over shared k/v)
        return x_BTH + moa_attention(p, x_norm, rope, spec.top_k, spec.num_kv_heads, spec.head_dim)
    out = attention(spec, p, x_norm, rope, spec.attention_window(lw.layer), lw.layer)
    if spec.attn_out_norm:  # AFMoE: an RMSNorm on the attention output before the residual add
        out = rms_norm(out, p["attn_out_norm"], spec.rms_eps)
    return x_BTH + (out if spec.residual_multiplier == 1.0 else out * spec.residual_multiplier)


def shortcut_rest(
    spec: ModelSpec, lw: LayerWeights, h_BTH: torch.Tensor, y_BTH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """A LongCat-Flash layer without its MoE: from h = x + attention₁(norm(x)) and y = post_norm(h)
    (the MoE's input too), m = h + MLP₁(y), a = m + attention₂(norm₂(m)), a + MLP₂(post_norm₂(a)).
    The layer's output is this plus the MoE output (``shortcut_moe``)."""
    p = lw.params
    second = {n.removeprefix(SECOND_BLOCK): t for n, t in p.items() if n.startswith(SECOND_BLOCK)}
    m = h_BTH + mlp(spec, p, "mlp_", y_BTH)
    a = m + attention(spec, second, block_norm(spec, m, second["input_norm"]), rope, None, lw.layer)
    return a + mlp(spec, second, "mlp_", block_norm(spec, a, second["post_norm"]))


def decoder_layer(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    extra: ExtraExperts | None = None,
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, MoETap | None]:
    if spec.hc_mult:  # HY-V4: x is [B, T, hc, H], the layer's residual streams
        return hc_decoder_layer(spec, lw, x_BTH, rope, extra, keep)
    h = attention_block(spec, lw, x_BTH, rope)
    if spec.shortcut_moe:  # LongCat: the MoE reads the stream after the first attention, adds at the end
        moe_out, moe_tap = moe_block(spec, lw, h, extra, keep)
        return shortcut_rest(spec, lw, h, moe_tap.y_NH.view_as(h), rope) + moe_out, moe_tap
    if spec.block_kind(lw.layer) in ("mamba", "attention"):  # Nemotron-H: the mixer is the layer
        return h, None
    r = spec.residual_multiplier
    if lw.routed:
        mlp_out, tap = moe_block(spec, lw, mlp_input(spec, x_BTH, h), extra, keep)
        if spec.moe_out_norm:  # A.X-K1: RMSNorm on routed + shared before the residual add
            mlp_out = rms_norm(mlp_out, lw.params["moe_out_norm"], spec.rms_eps)
        if spec.residual_scales is not None:  # MiniMax-01: α·y + β·MoE(y), y = norm(h)
            alpha, beta = spec.residual_scales[2]
            return tap.y_NH.view_as(mlp_out) * alpha + mlp_out * beta, tap
        return h + (mlp_out if r == 1.0 else mlp_out * r), tap
    p = lw.params
    w, b = mlp_norm(spec)
    y = mlp_input(spec, x_BTH, h)
    y = block_norm(spec, y, p[w], p.get(b)) if spec.pre_norm else y  # post-norm layers: the stream itself
    out = mlp(spec, p, "mlp_", y, lw.layer)
    if spec.dense_out_norm:  # AFMoE: the dense MLP's output normed as the MoE output is
        out = rms_norm(out, p["moe_out_norm"], spec.rms_eps)
    if spec.residual_scales is not None:
        alpha, beta = spec.residual_scales[2]
        return y * alpha + out * beta, None
    return h + (out if r == 1.0 else out * r), None


class HCWrite(NamedTuple):
    """How a hyper-connection writes a sub-block's output f back onto the streams: x_s + post_s · f
    (HY-V4), or, with a residual mixing matrix (DeepSeek-V4's mHC), Σ_j comb_js x_j + post_s · f."""

    post_BTS: torch.Tensor
    comb_BTSS: torch.Tensor | None = None


def sinkhorn(comb_BTSS: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """DeepSeek-V4's projection of softmax(·, rows) + ε onto doubly-stochastic matrices, as
    ``DeepseekV4HyperConnection`` does it: the columns normalised once, then ``iters`` − 1 times
    the rows then the columns, each sum + ε."""
    comb = comb_BTSS / (comb_BTSS.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mix(
    spec: ModelSpec, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, x_BTSH: torch.Tensor, head: bool = False
) -> tuple[HCWrite | None, torch.Tensor]:
    """A hyper-connection's read (transformers' ``HYV4HyperConnection`` / ``DeepseekV4HyperConnection``,
    in float32): logits W_fn · flat(x) / rms(flat(x)) from the S streams flattened, pre = σ(logit·scale
    + base) + ε, the sub-block's input Σ_s pre_s x_s (in x's dtype); post = magnitude · σ(·) + ε from
    the next S logits. ``spec.hc_sinkhorn_iters`` > 0 (DeepSeek-V4): post = magnitude · σ(·) without
    ε, and the last S² logits give the residual mixing matrix comb = Sinkhorn(softmax(logit·scale +
    base) + ε). ``head``: the final hyper head, pre only (no write)."""
    S = spec.hc_mult
    flat = x_BTSH.flatten(-2).float()
    mixes = F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + spec.rms_eps)
    write = None
    if head:
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + spec.hc_eps
    elif spec.hc_sinkhorn_iters:
        pre_l, post_l, comb_l = mixes.split([S, S, S * S], dim=-1)
        pre_b, post_b, comb_b = base.float().split([S, S, S * S], dim=-1)
        pre_s, post_s, comb_s = scale.float().unbind(0)
        pre = torch.sigmoid(pre_l * pre_s + pre_b) + spec.hc_eps
        post = spec.hc_magnitude * torch.sigmoid(post_l * post_s + post_b)
        logits = comb_l.unflatten(-1, (S, S)) * comb_s + comb_b.view(S, S)
        comb = torch.softmax(logits, dim=-1) + spec.hc_eps
        write = HCWrite(post, sinkhorn(comb, spec.hc_sinkhorn_iters, spec.hc_eps))
    else:
        pre_b, post_b = base.split(S, dim=-1)
        pre_s, post_s = scale.unbind(0)
        pre_l, post_l = mixes.split(S, dim=-1)
        pre = torch.sigmoid(pre_l * pre_s + pre_b) + spec.hc_eps
        write = HCWrite(spec.hc_magnitude * torch.sigmoid(post_l * post_s + post_b) + spec.hc_eps)
    return write, (pre.unsqueeze(-1) * x_BTSH).sum(dim=-2).to(x_BTSH.dtype)


def hc_add(write: HCWrite, out_BTH: torch.Tensor, x_BTSH: torch.Tensor) -> torch.Tensor:
    """A sub-block's output onto every stream: x_s + post_s · f, in float32, back in x's dtype; with
    a mixing matrix (DeepSeek-V4), Σ_j comb_js x_j + post_s · f in x's dtype, as transformers does."""
    if write.comb_BTSS is not None:
        dt = x_BTSH.dtype
        mixed = torch.matmul(write.comb_BTSS.to(dt).transpose(-1, -2), x_BTSH)
        return write.post_BTS.to(dt).unsqueeze(-1) * out_BTH.to(dt).unsqueeze(-2) + mixed
    post_BTS = write.post_BTS
    return (post_BTS.float().unsqueeze(-1) * out_BTH.float().unsqueeze(-2) + x_BTSH.float()).to(x_BTSH.dtype)


def hc_attention_block(
    spec: ModelSpec, lw: LayerWeights, x_BTSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """HY-V4: the streams after the attention sub-block, x_s + post_s · attention(norm(Σ pre x))."""
    p = lw.params
    post, a_BTH = hc_mix(spec, p["attn_hc_fn"], p["attn_hc_base"], p["attn_hc_scale"], x_BTSH)
    assert post is not None
    out = attention(spec, p, block_norm(spec, a_BTH, p["input_norm"]), rope, None, lw.layer)
    return hc_add(post, out, x_BTSH)


def hc_decoder_layer(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTSH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    extra: ExtraExperts | None = None,
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, MoETap | None]:
    """A HY-V4 layer on its streams: the attention sub-block, then the MLP / MoE block reading
    the mix m = Σ pre_s x_s its own hyper-connection forms (the MoE's h, whose norm gives y = γ ⊙ z),
    its output added onto every stream × post_s."""
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


def token_nll(
    spec: ModelSpec,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
    x_BTH: torch.Tensor,
    tokens_BT: torch.Tensor,
    *,
    final_norm_bias: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(nll_B(T-1) next-token cross-entropy in nats, logits_BTV)."""
    logits = F.linear(
        block_norm(spec, x_BTH, final_norm, final_norm_bias, spec.final_eps), lm_head, lm_head_bias
    ).float()
    if spec.logits_scaling != 1.0:
        logits = logits / spec.logits_scaling
    B, T, V = logits.shape
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens_BT[:, 1:].reshape(-1).long(), reduction="none")
    return nll.view(B, T - 1), logits
