"""Gated DeltaNet linear attention (Qwen3-Next's ``linear_attention`` layers).

Per value head, a state S ∈ R^{d_k×d_v} is decayed and corrected toward each new pair
(Yang et al. 2024, "Gated Delta Networks", Eq. 10):

    S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ,   o_t = S_tᵀ q_t

with α_t = exp(−exp(A_log) · softplus(a_t + dt_bias)), β_t = σ(b_t), q and k L2-normalised
(q also scaled by d_k^−½), q, k, v after a causal depthwise conv1d + SiLU, and the output
RMS-normalised per head and gated by SiLU(z) before the output projection. This is the
recurrent form of transformers' ``torch_chunk_gated_delta_rule`` (the same recurrence, summed
in another order: agreement to float32 rounding, not bit-identity).

Shape suffixes: B windows, T tokens, k/v key/value heads, K/V key/value head dims, C conv
channels (2·k·K + v·V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LinearAttention:
    """Sizes of a gated DeltaNet layer (config ``linear_*`` keys)."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q_BTkK: torch.Tensor, k_BTkK: torch.Tensor, v_BTvV: torch.Tensor,
                     g_BTv: torch.Tensor, beta_BTv: torch.Tensor) -> torch.Tensor:
    """o_BTvV of the recurrence above from a zero state, in float32."""
    B, T, nv, V = v_BTvV.shape
    rep = nv // q_BTkK.shape[2]
    q, k = (_l2norm(t.float().repeat_interleave(rep, dim=2)) for t in (q_BTkK, k_BTkK))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = v_BTvV.float(), g_BTv.float(), beta_BTv.float()
    S = v.new_zeros(B, nv, q.shape[-1], V)
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        k_t = k[:, t]
        delta = (v[:, t] - (S * k_t[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + k_t[..., None] * delta[..., None, :]
        out.append((S * q[:, t, ..., None]).sum(-2))
    return torch.stack(out, dim=1).to(v_BTvV.dtype)


def _split_heads(la: LinearAttention, qkvz: torch.Tensor, ba: torch.Tensor):
    """transformers' ``fix_query_key_value_ordering``: projections grouped per key head."""
    B, T, _ = qkvz.shape
    nk, r = la.num_k_heads, la.num_v_heads // la.num_k_heads
    q, k, v, z = qkvz.view(B, T, nk, -1).split([la.k_dim, la.k_dim, r * la.v_dim, r * la.v_dim], dim=3)
    b, a = ba.view(B, T, nk, 2 * r).split([r, r], dim=3)
    nv = la.num_v_heads
    return (q, k, v.reshape(B, T, nv, la.v_dim), z.reshape(B, T, nv, la.v_dim),
            b.reshape(B, T, nv), a.reshape(B, T, nv))


def _causal_conv(x_BTC: torch.Tensor, w_C1K: torch.Tensor) -> torch.Tensor:
    T, C = x_BTC.shape[1], x_BTC.shape[2]
    y = F.conv1d(x_BTC.transpose(1, 2), w_C1K, padding=w_C1K.shape[-1] - 1, groups=C)
    return F.silu(y[:, :, :T]).transpose(1, 2)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """transformers' ``Qwen3NextRMSNormGated``: w ⊙ rmsnorm(x) ⊙ SiLU(gate) (the gain is the
    stored weight, not the zero-centred 1 + w of the other norms)."""
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
    return normed * F.silu(gate.float())


def gated_deltanet(la: LinearAttention, p: dict[str, torch.Tensor], x_BTH: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The linear-attention token mixer of one layer, for its normalised input x."""
    B, T, _ = x_BTH.shape
    q, k, v, z, b, a = _split_heads(la, F.linear(x_BTH, p["lin_qkvz"]), F.linear(x_BTH, p["lin_ba"]))
    mixed = _causal_conv(torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)],
                                   dim=-1), p["lin_conv"])
    key_dim = la.num_k_heads * la.k_dim
    q, k, v = mixed.split([key_dim, key_dim, la.num_v_heads * la.v_dim], dim=-1)
    g = -p["lin_A_log"].float().exp() * F.softplus(a.float() + p["lin_dt_bias"])
    o = gated_delta_rule(q.view(B, T, -1, la.k_dim), k.view(B, T, -1, la.k_dim),
                         v.view(B, T, -1, la.v_dim), g, b.sigmoid())
    o = gated_rms_norm(o, p["lin_norm"], z, eps).to(x_BTH.dtype)
    return F.linear(o.reshape(B, T, -1), p["lin_out"])
