"""DeepSeek-V4's compressed attention branches: the keys/values its attention appends to the
sliding-window ones, and which of them each query may read.

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

import torch
import torch.nn.functional as F


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
    ``topk`` best-scoring among those it may read (all of them where it may read at most topk)."""
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
    top_BTK = index_BTW.topk(min(topk, W), dim=-1).indices
    kept = torch.zeros(B, T, W, dtype=torch.bool, device=x_BTH.device).scatter_(-1, top_BTK, True)
    return kept & visible_TW
