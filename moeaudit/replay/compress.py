"""DeepSeek-V4's attention (:func:`v4_attention`) and its compressed branches: the keys/values
the attention appends to the sliding-window ones, and which of them each query may read.

A compressor pools every ``ratio`` tokens of a projection C = W_kv x into one entry: the softmax
over the window's positions of the gate Z = W_z x + B (a learned bias per position in the window,
float32), times C, summed; the entry RMSNorm'd and RoPE'd at the position of its window's first
token. Heavily compressed attention (HCA) pools non-overlapping windows; compressed sparse
attention (CSA) projects to two series (Ca, Cb: the first and second half of 2·D features) and
pools each window's Cb with the previous window's Ca (2·ratio slots; the first window has no
previous one). Query t may read entry w once its window has closed: w < (t + 1) // ratio. CSA
keeps, of those, the ``index_topk`` its lightning indexer scores highest —
``I[t, w] = Σ_h w_h(x_t) · ReLU(q_{t,h} · K_w) / √D_I`` with ``w = W_w x / √n_I``, queries from
the attention's query latent, keys from the indexer's own CSA compressor at D_I — the selection
discrete (no gradient through it, as in transformers).

RoPE here is V4's: adjacent pairs of the *last* ``2·len(inv_freq)`` dims rotated in place (the
output not de-interleaved), in float32 from cos/sin rounded to the tensor's dtype, written back in
its dtype. This follows transformers' ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` /
``DeepseekV4Indexer`` without a cache (every window of the sequence, the partial last one dropped).

Shape suffixes: B windows (batches), T tokens, W compressed entries, R window length (ratio),
C projected features, D entry dim, n indexer heads, K kept entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeaudit.replay.selection import keep_best


def v4_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] (heads, if any, before T) rotated at positions ``pos`` [T]: the last
    2·len(inv_freq) dims as adjacent pairs, the leading ones untouched."""
    freqs = pos.float()[:, None] * inv_freq.float()[None, :]
    cos = freqs.cos().to(x.dtype).repeat_interleave(2, dim=-1)
    sin = freqs.sin().to(x.dtype).repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def pool_windows(
    kv_BTC: torch.Tensor, gate_BTC: torch.Tensor, bias_RC: torch.Tensor, ratio: int, overlap: bool
) -> torch.Tensor:
    """[B, W, D] the softmax-gated sum over each window (CSA, ``overlap``: the previous window's
    Ca slots, then this window's Cb), in kv's dtype; the gate + bias and its softmax in float32."""
    B, T, C = kv_BTC.shape
    W = T // ratio
    kv = kv_BTC[:, : W * ratio].view(B, W, ratio, C)
    gate = gate_BTC[:, : W * ratio].view(B, W, ratio, C) + bias_RC.float()
    if overlap:
        D = C // 2
        none_kv = kv.new_zeros(B, 1, ratio, D)
        none_gate = gate.new_full((B, 1, ratio, D), float("-inf"))
        kv = torch.cat([torch.cat([none_kv, kv[:, :-1, :, :D]], dim=1), kv[..., D:]], dim=2)
        gate = torch.cat([torch.cat([none_gate, gate[:, :-1, :, :D]], dim=1), gate[..., D:]], dim=2)
    return (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)


def compressed_entries(
    x_BTH: torch.Tensor,
    w_kv: torch.Tensor,
    w_gate: torch.Tensor,
    bias_RC: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    ratio: int,
    overlap: bool,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """[B, W, D] a compressor's entries: pooled, RMSNorm'd (float32, back in x's dtype) and RoPE'd
    at w · ratio."""
    pooled = pool_windows(F.linear(x_BTH, w_kv), F.linear(x_BTH, w_gate), bias_RC, ratio, overlap)
    p32 = pooled.float()
    normed = (norm.float() * (p32 * torch.rsqrt(p32.square().mean(-1, keepdim=True) + eps))).to(x_BTH.dtype)
    pos = torch.arange(normed.shape[1], device=x_BTH.device) * ratio
    return v4_rope(normed, pos, inv_freq)


def visible_entries(T: int, W: int, ratio: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, W] bool: query t reads entry w once its window has closed, w < (t + 1) // ratio."""
    t = torch.arange(T, device=device)
    return torch.arange(W, device=device)[None, :] < ((t + 1) // ratio)[:, None]


@torch.no_grad()
def indexer_selection(
    x_BTH: torch.Tensor,
    q_latent_BTR: torch.Tensor,
    keys_BWD: torch.Tensor,
    w_q: torch.Tensor,
    w_weights: torch.Tensor,
    n_heads: int,
    topk: int,
    ratio: int,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """[B, T, W] bool: the compressed entries CSA's lightning indexer keeps for each query — the
    ``topk`` best-scoring among those it may read (all of them where it may read at most topk),
    exact ties at the cut going to the earlier entry (:func:`moeaudit.replay.selection.keep_best`)."""
    B, T, _ = x_BTH.shape
    W, D = keys_BWD.shape[1], keys_BWD.shape[2]
    visible_TW = visible_entries(T, W, ratio, x_BTH.device)
    if W == 0:
        return visible_TW.expand(B, T, W)
    q = F.linear(q_latent_BTR, w_q).view(B, T, n_heads, D).transpose(1, 2)
    q = v4_rope(q, torch.arange(T, device=x_BTH.device), inv_freq).transpose(1, 2)  # [B, T, n, D]
    scores = F.relu(torch.matmul(q.float(), keys_BWD.float().transpose(-1, -2).unsqueeze(1))) * D**-0.5
    weights = F.linear(x_BTH, w_weights).float() * n_heads**-0.5
    index_BTW = (scores * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~visible_TW, float("-inf"))
    return keep_best(index_BTW, topk) & visible_TW


@dataclass(frozen=True)
class V4Branch:
    """A DeepSeek-V4 attention layer's compressed branch: ``ratio`` tokens per entry; CSA
    (``overlap``) with its indexer's heads, head dim and top-k, HCA without (n_heads 0)."""

    ratio: int
    overlap: bool
    index_heads: int = 0
    index_topk: int = 0


def _v4_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``DeepseekV4RMSNorm`` (float32, a float32 gain, back in x's dtype) or, without a gain,
    ``DeepseekV4UnweightedRMSNorm`` (x times its float32 rsqrt rounded to x's dtype)."""
    x32 = x.float()
    r = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    if weight is None:
        return x * r.to(x.dtype)
    return (weight.float() * (x32 * r)).to(x.dtype)


def v4_attention(
    p: dict[str, torch.Tensor],
    x_BTH: torch.Tensor,
    *,
    n_heads: int,
    head_dim: int,
    window: int,
    eps: float,
    o_groups: int,
    inv_freq: torch.Tensor,
    branch: V4Branch | None,
) -> torch.Tensor:
    """``DeepseekV4Attention`` without a cache: a query latent q_r = norm(W_qa x), per-head
    queries norm(W_qb q_r) (no gain); one shared key-and-value head norm(W_kv x); V4's RoPE on
    both at t (``inv_freq``: the main base on sliding layers, the compressed one on CSA / HCA
    layers); each query reads the keys of its ``window`` (t − s < window) and the compressed
    entries it may read (:func:`visible_entries`, CSA: those its indexer keeps), with a learned
    sink logit per head in the softmax (float32); the output's rotary dims turned back by −t; the
    heads in ``o_groups`` groups, each projected by its block of W_oa, then W_ob.

    ``p``: q_a, q_a_norm, q_b, kv, kv_norm, sinks, o_a [g·r, nh·D/g], o_b; a branch's c_kv, c_gate,
    c_bias, c_norm and, CSA, its indexer's i_kv, i_gate, i_bias, i_norm, i_q, i_w."""
    B, T, _ = x_BTH.shape
    pos = torch.arange(T, device=x_BTH.device)
    q_latent = _v4_norm(F.linear(x_BTH, p["q_a"]), p["q_a_norm"], eps)
    q = _v4_norm(F.linear(q_latent, p["q_b"]).view(B, T, n_heads, head_dim).transpose(1, 2), None, eps)
    q = v4_rope(q, pos, inv_freq)  # [B, nh, T, D]
    kv = v4_rope(_v4_norm(F.linear(x_BTH, p["kv"]), p["kv_norm"], eps), pos, inv_freq)  # [B, T, D]
    diff = pos[:, None] - pos[None, :]
    mask = ((diff >= 0) & (diff < window)).expand(B, T, T)
    if branch is not None:
        entries = compressed_entries(
            x_BTH, p["c_kv"], p["c_gate"], p["c_bias"], p["c_norm"], eps, branch.ratio, branch.overlap, inv_freq
        )
        W = entries.shape[1]
        if branch.overlap:
            with torch.no_grad():
                keys = compressed_entries(
                    x_BTH, p["i_kv"], p["i_gate"], p["i_bias"], p["i_norm"], eps, branch.ratio, True, inv_freq
                )
            readable = indexer_selection(
                x_BTH, q_latent, keys, p["i_q"], p["i_w"], branch.index_heads, branch.index_topk, branch.ratio, inv_freq
            )
        else:
            readable = visible_entries(T, W, branch.ratio, x_BTH.device).expand(B, T, W)
        kv = torch.cat([kv, entries], dim=1)
        mask = torch.cat([mask, readable], dim=-1)
    logits = torch.matmul(q, kv.unsqueeze(1).transpose(-1, -2)) * head_dim**-0.5  # [B, nh, T, S]
    logits = logits.float().masked_fill(~mask.unsqueeze(1), float("-inf"))
    sinks = p["sinks"].float().view(1, n_heads, 1, 1).expand(B, n_heads, T, 1)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values  # as transformers (bf16 overflow guard)
    probs = combined.softmax(dim=-1)[..., :-1].to(kv.dtype)
    out = torch.matmul(probs, kv.unsqueeze(1))  # [B, nh, T, D]
    out = v4_rope(out, -pos, inv_freq).transpose(1, 2).reshape(B, T, o_groups, -1)
    w_oa = p["o_a"].view(o_groups, -1, out.shape[-1])
    grouped = torch.einsum("btgi,goi->btgo", out, w_oa).flatten(2)
    return F.linear(grouped, p["o_b"])
