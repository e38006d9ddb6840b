"""Gated DeltaNet linear attention (Qwen3-Next's ``linear_attention`` layers).

Per value head, a state S ∈ R^{d_k×d_v} is decayed and corrected toward each new pair
(Yang et al. 2024, "Gated Delta Networks", Eq. 10):

    S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ,   o_t = S_tᵀ q_t

with α_t = exp(−exp(A_log) · softplus(a_t + dt_bias)), β_t = σ(b_t), q and k L2-normalised
(q also scaled by d_k^−½), q, k, v after a causal depthwise conv1d + SiLU, and the output
RMS-normalised per head and gated by SiLU(z) before the output projection (transformers'
``Qwen3NextGatedDeltaNet`` with its pure-torch kernels, which run on CPU).

Shape suffixes: B windows, T tokens, k/v key/value heads, K/V key/value head dims, C conv
channels (2·k·K + v·V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.spec.config import LinearAttention


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prefix_sum(x_XC: torch.Tensor, lower_CC: torch.Tensor) -> torch.Tensor:
    """Σ_{i ≤ j} x_i along the last dim (a cumsum) as a masked row sum. Float ``cumsum`` has no
    deterministic CUDA kernel: under ``use_deterministic_algorithms(True)`` torch raises on it
    (moeaudit.replay.determinism). The mask selects, not multiplies, so an infinite x_i cannot
    turn the terms it is kept out of into NaN (0·∞). Summed in float64 and rounded once, as the
    CPU's float32 cumsum accumulates (in double): the float32 results are a cumsum's but for
    the rare sum that lands within float64 rounding of a float32 rounding boundary."""
    return torch.where(lower_CC, x_XC.double()[..., None, :], 0.0).sum(-1).to(x_XC.dtype)


def gated_delta_rule(
    q_BTkK: torch.Tensor,
    k_BTkK: torch.Tensor,
    v_BTvV: torch.Tensor,
    g_BTv: torch.Tensor,
    beta_BTv: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """o_BTvV of the recurrence above from a zero state, in float32, in chunks of ``chunk``
    tokens: within a chunk the delta rule's updates are solved at once as a unit lower-
    triangular system (the WY form, Gated DeltaNet §3.3), across chunks the state is carried.
    Same operations in the same order as transformers' ``torch_chunk_gated_delta_rule``, so
    the rounding matches it, and T/chunk sequential steps instead of T."""
    B, T, nv, V = v_BTvV.shape
    rep = nv // q_BTkK.shape[2]
    q, k = (t.repeat_interleave(rep, dim=2) for t in (q_BTkK, k_BTkK))
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (q, k, v_BTvV, beta_BTv, g_BTv)
    )  # heads before time
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (T + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(B, nv, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = _prefix_sum(g.reshape(B, nv, n, chunk), ~upper)  # log of the decay since the chunk start
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * cum.exp()[..., None]
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    S = new_v.new_zeros(B, nv, k.shape[-1], V)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = []
    for i in range(n):
        v_i = new_v[:, :, i] - k_cum[:, :, i] @ S
        out.append(q[:, :, i] @ S + intra[:, :, i] @ v_i)
        S = S * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_i
    o = torch.cat(out, dim=2)[:, :, :T]
    return o.transpose(1, 2).contiguous().to(v_BTvV.dtype)


def _split_heads(la: LinearAttention, qkvz: torch.Tensor, ba: torch.Tensor):
    """transformers' ``fix_query_key_value_ordering``: projections grouped per key head."""
    B, T, _ = qkvz.shape
    nk, r = la.num_k_heads, la.num_v_heads // la.num_k_heads
    q, k, v, z = qkvz.view(B, T, nk, -1).split([la.k_dim, la.k_dim, r * la.v_dim, r * la.v_dim], dim=3)
    b, a = ba.view(B, T, nk, 2 * r).split([r, r], dim=3)
    nv = la.num_v_heads
    return (
        q,
        k,
        v.reshape(B, T, nv, la.v_dim),
        z.reshape(B, T, nv, la.v_dim),
        b.reshape(B, T, nv),
        a.reshape(B, T, nv),
    )


def split_in_proj(la: LinearAttention, w_in: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Lara-Mini's fused ``in_proj`` [2·k·K + 2·v·V + 2·v, H] as Qwen3.5's four projections
    (q|k|v, z, b, a), the row split transformers' conversion mapping makes on load; views of
    the one tensor, so its gradient gathers all four."""
    key_dim, value_dim = la.num_k_heads * la.k_dim, la.num_v_heads * la.v_dim
    return tuple(w_in.split([2 * key_dim + value_dim, value_dim, la.num_v_heads, la.num_v_heads], dim=0))


def _causal_conv(x_BTC: torch.Tensor, w_C1K: torch.Tensor) -> torch.Tensor:
    T, C = x_BTC.shape[1], x_BTC.shape[2]
    y = F.conv1d(x_BTC.transpose(1, 2), w_C1K, padding=w_C1K.shape[-1] - 1, groups=C)
    return F.silu(y[:, :, :T]).transpose(1, 2)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen3NextRMSNormGated``: w ⊙ rmsnorm(x) ⊙ SiLU(gate) (the gain is the
    stored weight, not the zero-centred 1 + w of the other norms)."""
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
    return normed * F.silu(gate.float())


def gated_deltanet(la: LinearAttention, p: dict[str, torch.Tensor], x_BTH: torch.Tensor, eps: float) -> torch.Tensor:
    """The linear-attention token mixer of one layer, for its normalised input x."""
    B, T, _ = x_BTH.shape
    if "lin_qkv" in p or "lin_in" in p:  # Qwen3.5: q | k | v flat, z, b, a in their own projections
        w_qkv, w_z, w_b, w_a = (
            (p["lin_qkv"], p["lin_z"], p["lin_b"], p["lin_a"]) if "lin_qkv" in p else split_in_proj(la, p["lin_in"])
        )
        qkv = F.linear(x_BTH, w_qkv)
        z = F.linear(x_BTH, w_z).view(B, T, la.num_v_heads, la.v_dim)
        b, a = F.linear(x_BTH, w_b), F.linear(x_BTH, w_a)
    else:
        q, k, v, z, b, a = _split_heads(la, F.linear(x_BTH, p["lin_qkvz"]), F.linear(x_BTH, p["lin_ba"]))
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
    mixed = _causal_conv(qkv, p["lin_conv"])
    key_dim = la.num_k_heads * la.k_dim
    q, k, v = mixed.split([key_dim, key_dim, la.num_v_heads * la.v_dim], dim=-1)
    g = -p["lin_A_log"].float().exp() * F.softplus(a.float() + p["lin_dt_bias"])
    o = gated_delta_rule(
        q.view(B, T, -1, la.k_dim), k.view(B, T, -1, la.k_dim), v.view(B, T, -1, la.v_dim), g, b.sigmoid()
    )
    o = gated_rms_norm(o, p["lin_norm"], z, eps).to(x_BTH.dtype)
    return F.linear(o.reshape(B, T, -1), p["lin_out"])
