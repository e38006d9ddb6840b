"""Mamba (selective state-space) token mixers: Jamba's Mamba-1 and Mamba-2 / SSD (Granite 4.0).

Both keep, per channel c, a state h ∈ R^N updated by a decay and an input-dependent write and
read out by an input-dependent C (Gu & Dao 2023, "Mamba", Alg. 2; Dao & Gu 2024, "Transformers
are SSMs", §6-7):

    h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t x_t,   y_t = C_tᵀ h_t + D x_t

with Δ_t = softplus(dt_t + dt_bias), x after a causal depthwise conv1d + SiLU. Mamba-1 has a
decay per (channel, state) pair; Mamba-2 one scalar decay per head (A is a scalar per head),
which makes the chunked dual form (SSD) a few matrix products per chunk.

The code follows transformers' pure-torch paths (``JambaMambaMixer`` with
``mamba_selective_scan``; ``GraniteMoeHybridMambaLayer`` with ``mamba2_chunk_scan``), the
operations in the same order so the float32 rounding matches theirs, with one change: every
prefix sum is a float64 triangular matrix product rounded once, not a float ``cumsum``, which
has no deterministic CUDA kernel (``moeaudit.replay.determinism``; the CPU's float32 cumsum
also accumulates in double).

Shape suffixes: B windows, T tokens, I scan channels, N state size, h heads, P head dim,
G groups, L tokens per chunk, c chunks, R dt rank, C conv channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.spec.config import Mamba

MAMBA1_CHUNK = 64  # tokens discretised and read out together (Mamba-1); the recurrence steps one at a time


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def causal_conv(x_BTC: torch.Tensor, w_C1K: torch.Tensor, b_C: torch.Tensor | None) -> torch.Tensor:
    """SiLU of the causal depthwise conv1d (transformers' ``causal_conv1d_fn``)."""
    T, C = x_BTC.shape[1], x_BTC.shape[2]
    y = F.conv1d(x_BTC.transpose(1, 2), w_C1K, b_C, padding=w_C1K.shape[-1] - 1, groups=C)
    return F.silu(y[:, :, :T]).transpose(1, 2)


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ_{k ≤ i} x_k along the last dim, in float64 (a product with a triangular matrix of
    ones: deterministic on every backend, unlike a float cumsum on CUDA)."""
    L = x.shape[-1]
    upper = torch.ones(L, L, dtype=torch.float64, device=x.device).triu()
    return x.double() @ upper


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = Σ_{j < k ≤ i} x_k, −∞ above the diagonal (transformers'
    ``segment_sum``): differences of float64 prefix sums, rounded once to x's dtype."""
    cum = prefix_sum(x)
    L = x.shape[-1]
    out = (cum[..., :, None] - cum[..., None, :]).to(x.dtype)
    lower = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    return out.masked_fill(~lower, float("-inf"))


# ----- Mamba-1 (Jamba) ---------------------------------------------------------------------------


def selective_scan(
    x_BTI: torch.Tensor,
    dt_BTI: torch.Tensor,
    A_IN: torch.Tensor,
    B_BTN: torch.Tensor,
    C_BTN: torch.Tensor,
    chunk: int = MAMBA1_CHUNK,
) -> torch.Tensor:
    """y_BTI = Σ_n C_t[n] h_t[:, n] of the Mamba-1 recurrence from a zero state, in float32.

    Mamba-1's decay exp(Δ_t[c] A[c, n]) differs per (channel, state) pair, so the chunked dual
    form of SSD would hold an L×L decay matrix per pair (L times the recurrence's memory); the
    state is carried token by token as transformers' ``mamba_selective_scan`` does, and the
    discretisation (exp(ΔA), ΔB x) and the read-out by C are formed ``chunk`` tokens at a time,
    so without autograd only one chunk's [B, L, I, N] terms exist at once."""
    B, T, I = x_BTI.shape
    N = A_IN.shape[-1]
    h = x_BTI.new_zeros(B, I, N, dtype=torch.float32)
    out = []
    for s in range(0, T, chunk):
        dt = dt_BTI[:, s : s + chunk]
        dA = torch.exp(A_IN[None, None] * dt[..., None])
        dBu = (dt[..., None] * B_BTN[:, s : s + chunk, None, :].float()) * x_BTI[:, s : s + chunk, :, None].float()
        states = []
        for t in range(dt.shape[1]):
            h = dA[:, t] * h + dBu[:, t]
            states.append(h)
        out.append((torch.stack(states, dim=1) @ C_BTN[:, s : s + chunk, :, None].float()).squeeze(-1))
    return torch.cat(out, dim=1)


def mamba1_mixer(m: Mamba, p: dict[str, torch.Tensor], x_BTH: torch.Tensor) -> torch.Tensor:
    """Jamba's ``JambaMambaMixer`` on the normalised input x (no cache, no padding)."""
    I, N, R = m.inner, m.state, m.dt_rank
    xs, z = F.linear(x_BTH, p["ssm_in"], p.get("ssm_in_bias")).chunk(2, dim=-1)
    xs = causal_conv(xs, p["ssm_conv"], p.get("ssm_conv_bias"))
    dt, B, C = F.linear(xs, p["ssm_x"]).split([R, N, N], dim=-1)
    dt = _rms(dt, p["ssm_dt_norm"], m.eps)
    B, C = _rms(B, p["ssm_b_norm"], m.eps), _rms(C, p["ssm_c_norm"], m.eps)
    dt = F.softplus(F.linear(dt, p["ssm_dt"]) + p["ssm_dt_bias"].float())
    A = -torch.exp(p["ssm_A_log"].float())
    y = selective_scan(xs, dt, A, B, C)
    y = y + xs * p["ssm_D"].float()
    y = y * F.silu(z)
    assert y.shape[-1] == I
    return F.linear(y.to(x_BTH.dtype), p["ssm_out"], p.get("ssm_out_bias"))


# ----- Mamba-2 / SSD (Granite 4.0) ---------------------------------------------------------------


def _chunks(x: torch.Tensor, pad: int, L: int) -> torch.Tensor:
    """[B, T, ...] → [B, c, L, ...], zero-padded at the end to whole chunks."""
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, L, *x.shape[2:])


def ssd_scan(
    x_BThP: torch.Tensor,
    dt_BTh: torch.Tensor,
    A_h: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    D_h: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """y_BThP of the Mamba-2 recurrence from a zero state (transformers' ``mamba2_chunk_scan``):
    within a chunk, y = (C Bᵀ ⊙ decay) (Δ x) as a masked attention-like product; the state at
    each chunk's start from the chunk sums, decayed across chunks; plus D x."""
    Bsz, T, h, P = x_BThP.shape
    G = B_BTGN.shape[2]
    x = x_BThP.float()
    Bm, Cm = (
        t.float()[:, :, :, None, :].expand(Bsz, T, G, h // G, t.shape[-1]).reshape(Bsz, T, h, -1)
        for t in (B_BTGN, C_BTGN)
    )  # head j reads group j // (h / G)
    pad = (chunk - T % chunk) % chunk
    D_residual = D_h[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt_BTh[..., None].float()
    A = A_h.to(x.dtype) * dt_BTh.float()
    x, A, Bm, Cm = (_chunks(t, pad, chunk) for t in (x, A, Bm, Cm))  # b c l h (p|n)
    A = A.permute(0, 3, 1, 2)  # b h c l
    A_cum = prefix_sum(A).to(A.dtype)
    decay = torch.exp(segment_sum(A))  # b h c l s
    G_ = torch.einsum("bclhn,bcshn->bclsh", Cm, Bm)
    M = G_ * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay_states = torch.exp(A_cum[:, :, :, -1:] - A_cum)
    B_decay = Bm * decay_states.permute(0, 2, 3, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)[:, :-1]
    C_states = torch.einsum("bclhn,bchpn->bclhp", Cm, states)
    y_off = C_states * torch.exp(A_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(Bsz, -1, h, P) + D_residual
    return y[:, :T]


def gated_group_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """transformers' ``GraniteMoeHybridRMSNormGated``: w ⊙ groupwise-rmsnorm(y ⊙ SiLU(z))."""
    x = y.float() * F.silu(z.float())
    grouped = x.view(*x.shape[:-1], groups, -1)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view(x.shape).to(y.dtype)


def mamba2_mixer(m: Mamba, p: dict[str, torch.Tensor], x_BTH: torch.Tensor) -> torch.Tensor:
    """Granite 4.0's ``GraniteMoeHybridMambaLayer`` on the normalised input x (no cache, no
    padding): in_proj → [z | x B C | dt], conv + SiLU on x B C, the SSD scan, gated norm."""
    Bsz, T, _ = x_BTH.shape
    I, GN = m.inner, m.groups * m.state
    z, xBC, dt = F.linear(x_BTH, p["ssm_in"], p.get("ssm_in_bias")).split([I, m.conv_channels, m.heads], dim=-1)
    xBC = causal_conv(xBC, p["ssm_conv"], p.get("ssm_conv_bias"))
    xs, B, C = xBC.split([I, GN, GN], dim=-1)
    dt = F.softplus(dt + p["ssm_dt_bias"].to(dt.dtype))
    dt = dt.clamp(min=m.dt_min, max=m.dt_max)
    A = -torch.exp(p["ssm_A_log"].float())
    y = ssd_scan(
        xs.reshape(Bsz, T, m.heads, m.head_dim),
        dt,
        A,
        B.reshape(Bsz, T, m.groups, m.state),
        C.reshape(Bsz, T, m.groups, m.state),
        p["ssm_D"],
        m.chunk,
    )
    y = gated_group_norm(y.reshape(Bsz, T, I), z, p["ssm_norm"], m.groups, m.eps)
    return F.linear(y.to(x_BTH.dtype), p["ssm_out"], p.get("ssm_out_bias"))


def mamba_mixer(m: Mamba, p: dict[str, torch.Tensor], x_BTH: torch.Tensor) -> torch.Tensor:
    """The state-space token mixer of one layer, for its normalised input x."""
    return mamba1_mixer(m, p, x_BTH) if m.version == 1 else mamba2_mixer(m, p, x_BTH)
