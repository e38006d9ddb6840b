"""Softmax attention (``spec.blocks.Attention``): GQA, RoPE or NoPE, sliding windows, chunked
attention, sinks, q/k norms, gates on the query or the output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.replay.blocks.norms import _l2_norm, _linear, rms_norm
from moeaudit.replay.blocks.rope import (
    _rotate_interleaved,
    apply_rope,
    kind_rope,
)
from moeaudit.spec.blocks import Attention
from moeaudit.spec.config import ModelSpec


def attention(
    spec: ModelSpec,
    a: Attention,
    p: dict[str, torch.Tensor],
    x_BTH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    layer: int = -1,
) -> torch.Tensor:
    """Layer ``layer``'s attention ``a`` of its normed input (the model-wide choices, RoPE's pair
    layout and the softmax scale, are ``spec``'s)."""
    B, T, _ = x_BTH.shape
    D, nh, nkv, Dv, sinks = a.head_dim, a.heads, a.kv_heads, a.value_dim, a.sinks
    if a.attention_kind is not None:  # MiMo-V2-Flash, Mellum: this layer kind's own RoPE table
        rope = kind_rope(spec, rope, layer)
    if "qkv" in p:  # one fused [q | k | v] projection (Sarvam-30B)
        q, k, v = _linear(x_BTH, p, "qkv", "qkv_bias").split([nh * D, nkv * D, nkv * D], dim=-1)
    else:
        q, k, v = (_linear(x_BTH, p, n, f"{n}_bias") for n in ("q", "k", "v"))
    if a.value_scale != 1.0:  # MiMo: the values × attention_value_scale
        v = v * a.value_scale
    gate = None
    if a.gated_q:  # Qwen3-Next: per head [query | gate], the gate σ'd onto the output
        q, gate = q.view(B, T, nh, 2 * D).chunk(2, dim=-1)
        q, gate = q.reshape(B, T, nh * D), gate.reshape(B, T, nh * D)
    if a.qk_norm == "full":  # OLMoE: one norm over all heads, before the head split
        q, k = rms_norm(q, p["q_norm"], spec.rms_eps), rms_norm(k, p["k_norm"], spec.rms_eps)
    if a.clip is not None:  # DBRX
        c = a.clip
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    q_BTnD, k_BTnD, v_BTnD = q.view(B, T, nh, D), k.view(B, T, nkv, D), v.view(B, T, nkv, Dv)
    if a.qk_norm == "head":  # Qwen3: per-head norm
        q_BTnD = rms_norm(q_BTnD, p["q_norm"], spec.rms_eps)
        k_BTnD = rms_norm(k_BTnD, p["k_norm"], spec.rms_eps)
    cos, sin = rope
    q_BnTD = q_BTnD.transpose(1, 2)
    k_BnTD = k_BTnD.transpose(1, 2)
    nope = not a.rope  # Llama 4: no RoPE on these layers
    if not nope and spec.rope.interleaved:  # ERNIE 4.5, Llama 4: adjacent pairs; q and k permuted alike
        q_BnTD, k_BnTD = _rotate_interleaved(q_BnTD, cos, sin), _rotate_interleaved(k_BnTD, cos, sin)
    elif not nope:
        q_BnTD, k_BnTD = apply_rope(q_BnTD, cos, sin), apply_rope(k_BnTD, cos, sin)
    if a.qk_norm == "l2" and not nope:  # Llama 4: weightless RMS norm of the rotated q and k
        q_BnTD = _l2_norm(q_BnTD, spec.rms_eps)
        k_BnTD = _l2_norm(k_BnTD, spec.rms_eps)
    if nope and a.temperature is not None:  # Llama 4: query temperature grows with position
        attn_scale, floor_scale = a.temperature
        pos = torch.arange(T, device=x_BTH.device, dtype=torch.float32)
        q_BnTD = q_BnTD * (torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0)[:, None]
    if a.qk_norm == "head_after_rope":  # Hunyuan: per-head norm of the rotated q and k
        q_BnTD = rms_norm(q_BnTD, p["q_norm"], spec.rms_eps)
        k_BnTD = rms_norm(k_BnTD, p["k_norm"], spec.rms_eps)
    v_BnTD = v_BTnD.transpose(1, 2)
    if nkv != nh:
        k_BnTD = k_BnTD.repeat_interleave(nh // nkv, dim=1)
        v_BnTD = v_BnTD.repeat_interleave(nh // nkv, dim=1)
    mask = _causal_mask(T, a.window, x_BTH.device)
    if a.chunk is not None and a.chunk < T:
        mask = _chunked_mask(T, a.chunk, x_BTH.device)
    scale = D**-0.5 if spec.attention_scale is None else spec.attention_scale  # Granite: attention_multiplier
    if sinks:
        q_BnTD, k_BnTD, v_BnTD, mask = _with_sink_key(p["sinks"], q_BnTD, k_BnTD, v_BnTD, mask, scale)
    out = F.scaled_dot_product_attention(q_BnTD, k_BnTD, v_BnTD, attn_mask=mask, is_causal=mask is None, scale=scale)
    out_BTH = out.transpose(1, 2).reshape(B, T, nh * Dv)
    if gate is not None:
        out_BTH = out_BTH * torch.sigmoid(gate)
    if a.output_gate == "sigmoid":  # AFMoE: σ(W_g x) per channel
        out_BTH = out_BTH * torch.sigmoid(F.linear(x_BTH, p["g_proj"]))
    elif a.output_gate == "head_sigmoid":  # Step 3.5: σ(W_g x) per head, broadcast over its dims
        g = torch.sigmoid(F.linear(x_BTH, p["g_proj"]))
        out_BTH = (out_BTH.view(B, T, nh, Dv) * g[..., None]).view(B, T, nh * Dv)
    elif a.output_gate:  # Laguna: softplus(W_g x) per head (broadcast over its dims) or per channel
        g = F.softplus(F.linear(x_BTH, p["g_proj"]).float())
        out_BTH = (
            (out_BTH.view(B, T, nh, Dv) * g[..., None]).view(B, T, nh * Dv) if a.output_gate == "head" else out_BTH * g
        )
    return _linear(out_BTH, p, "o", "o_bias")


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


def _causal_mask(T: int, window: int | None, device: torch.device, force: bool = False) -> torch.Tensor | None:
    """The [T, T] boolean mask of a (sliding-window) causal attention; None where plain causal
    attention (``is_causal``) is the same, unless ``force``."""
    if (window is None or window >= T) and not force:
        return None
    window = T if window is None else window
    i = torch.arange(T, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)
