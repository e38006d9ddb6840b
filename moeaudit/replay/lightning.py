"""Lightning attention (MiniMax-01, ``minimax``): linear attention with a per-head exponential decay.

Every head mixes o_t = Σ_{s≤t} exp(−λ_h (t − s)) (q_t · k_s) v_s, with q, k, v = SiLU(W_qkv x)
(one projection, per head [q | k | v]), no softmax and no 1/√D; the heads' outputs are
RMSNorm'd together, gated by σ(W_g x) and projected out. It follows transformers'
``MiniMaxLightningAttention`` block for block: blocks of ``block`` tokens, the decay inside a
block from the stored ``diagonal_decay`` table, the earlier blocks through a [D, D] state per
head carried with ``query_decay`` / ``key_decay`` and exp(−λ·block). The stored slope λ and
decay tables (buffers of the checkpoint) are the ones used, as transformers loads and uses
them. Only matrix products and elementwise ops: no cumulative sum, deterministic on every
backend.

Shape suffixes: B windows, T tokens, H hidden size, n heads, D head dim, C tokens of a block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NORM_EPS = 1e-6  # transformers builds the heads' RMSNorm with its default eps, not the config's


def lightning_attention(p: dict[str, torch.Tensor], x_BTH: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """The lightning attention block's output [B, T, H] for its normed input x."""
    B, T, _ = x_BTH.shape
    D = head_dim
    qkv = F.silu(F.linear(x_BTH, p["light_qkv"])).view(B, T, n_heads, 3 * D)
    q_BnTD, k_BnTD, v_BnTD = (t.transpose(1, 2) for t in qkv.split(D, dim=-1))
    slope_n11, q_decay, k_decay, diag_decay = (
        p[n] for n in ("light_slope", "light_qdecay", "light_kdecay", "light_ddecay")
    )
    block = q_decay.shape[1]
    state_BnDD = x_BTH.new_zeros(B, n_heads, D, D)
    out = []
    for s0 in range(0, T, block):
        C = min(block, T - s0)
        q, k, v = (t[:, :, s0 : s0 + C] for t in (q_BnTD, k_BnTD, v_BnTD))
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * diag_decay[:, :, :C, :C], v)
        inter = torch.matmul(q * q_decay[:, :C], state_BnDD)
        out.append(inter + intra)
        state_BnDD = state_BnDD * torch.exp(-slope_n11 * C) + torch.matmul((k * k_decay[:, -C:]).transpose(-1, -2), v)
    o = torch.cat(out, dim=-2).transpose(1, 2).reshape(B, T, n_heads * D)
    o32 = o.float()
    o = p["light_norm"] * (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + NORM_EPS))
    o = torch.sigmoid(F.linear(x_BTH, p["light_gate"])) * o
    return F.linear(o, p["light_out"])
