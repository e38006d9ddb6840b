"""Kimi Delta Attention (Kimi Linear's ``linear_attention`` layers): the gated delta rule of
:mod:`moeaudit.replay.deltanet` with a decay per key channel instead of one per head.

Per head, a state S ∈ R^{d_k×d_v} is decayed channel-wise and corrected toward each new pair:

    S_t = Diag(α_t) S_{t-1} + β_t k_t (v_t − (Diag(α_t) S_{t-1})ᵀ k_t)ᵀ,   o_t = S_tᵀ q_t

with log α_t = −exp(A_log_h) · softplus(W_fb W_fa x_t + dt_bias) ∈ R^{d_k} (one value per key
channel), β_t = σ(W_b x_t) per head, q and k L2-normalised (q also scaled by d_k^−½), q, k, v
after a causal depthwise conv1d + SiLU, and the output RMS-normalised per head and gated by
σ(W_gb W_ga x) before the output projection (transformers' ``KimiLinearDeltaAttention`` with its
pure-torch ``chunk_kimi_delta_attention``, which runs on CPU).

Shape suffixes: B windows, T tokens, h heads, K head dim (keys and values alike), n chunks,
C tokens per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.replay.deltanet import _causal_conv
from moeaudit.spec.config import LinearAttention


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``l2norm`` of Kimi Linear: x / sqrt(Σx² + ε)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunk_prefix_sum(g_XCK: torch.Tensor) -> torch.Tensor:
    """Σ_{i ≤ j} g_i along the chunk dim (-2): a cumsum as a lower-triangular matmul in float64,
    rounded once to float32. Float ``cumsum`` has no deterministic CUDA kernel (see
    :func:`moeaudit.replay.deltanet._prefix_sum`); a [C, C] · [C, K] product keeps the per-channel
    sums at the size of g itself."""
    C = g_XCK.shape[-2]
    lower = torch.ones(C, C, dtype=torch.float64, device=g_XCK.device).tril()
    return (lower @ g_XCK.double()).to(g_XCK.dtype)


def kda_rule(
    q_BThK: torch.Tensor,
    k_BThK: torch.Tensor,
    v_BThK: torch.Tensor,
    g_BThK: torch.Tensor,
    beta_BTh: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """o_BThK of the recurrence above from a zero state, in float32, in chunks of ``chunk``
    tokens: within a chunk the delta rule's updates are one unit lower-triangular solve (the WY
    form), across chunks the state is carried. The channel-wise decay between tokens i ≥ j of a
    chunk, exp(Σ_{j<s≤i} log α_s), is formed per channel ([C, C, K]) and never factored as
    exp(cum_i)·exp(−cum_j), which overflows; same operations as transformers'
    ``chunk_kimi_delta_attention``, so the rounding follows it."""
    B, T, h, K = k_BThK.shape
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (q_BThK, k_BThK, v_BThK, beta_BTh, g_BThK)
    )  # heads before time
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - T % chunk) % chunk
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, g, k_beta, v_beta = (x.reshape(B, h, n, chunk, x.shape[-1]) for x in (q, k, g, k_beta, v_beta))
    cum = _chunk_prefix_sum(g)  # log of the per-channel decay since the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(upper[..., None], float("-inf")).exp()
    system = (k_beta[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)  # [B, h, n, C, C]
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp(), upper=False, unitriangular=True)
    intra = (q[..., :, None, :] * k[..., None, :, :] * decay).sum(-1).masked_fill(upper, 0.0)
    S = new_v.new_zeros(B, h, K, v.shape[-1])
    q = q * cum.exp()
    last = cum[..., -1:, :]  # [B, h, n, 1, K]
    k = k * (last - cum).exp()
    chunk_decay = last.exp().transpose(-1, -2)  # [B, h, n, K, 1]
    out = []
    for i in range(n):
        v_i = new_v[:, :, i] - k_cum[:, :, i] @ S
        out.append(q[:, :, i] @ S + intra[:, :, i] @ v_i)
        S = S * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_i
    o = torch.cat(out, dim=2)[:, :, :T]
    return o.transpose(1, 2).contiguous().to(v_BThK.dtype)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """transformers' log(1 + exp(x)), x itself above 20; the exp clamped so that the branch not
    taken cannot put inf into the gradient (0 · inf)."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x.clamp(max=20.0))))


def kimi_delta_attention(
    la: LinearAttention, p: dict[str, torch.Tensor], x_BTH: torch.Tensor, eps: float, bound: float | None = None
) -> torch.Tensor:
    """The KDA token mixer of one layer, for its normalised input x. Kimi Linear's forget and
    output gates are low-rank (``kda_f_a`` → ``kda_f_b``, ``kda_g_a`` → ``kda_g_b``), Ling 3's
    full-rank (``kda_f``, ``kda_g``); ``bound``: Ling 3's bounded forget gate, log α =
    bound · σ(exp(A_log) · f) (else −exp(A_log) · softplus(f)), rounded to the activations' dtype
    as transformers does."""
    B, T, _ = x_BTH.shape
    h, K = la.num_v_heads, la.v_dim
    qkv = torch.cat([F.linear(x_BTH, p[n]) for n in ("kda_q", "kda_k", "kda_v")], dim=-1)
    conv = torch.cat([p["kda_q_conv"], p["kda_k_conv"], p["kda_v_conv"]])  # transformers stacks them on loading
    mixed = _causal_conv(qkv.to(conv.dtype), conv).to(qkv.dtype)
    q, k, v = (t.reshape(B, T, h, K) for t in mixed.split(h * K, dim=-1))
    if "kda_f" in p:
        f = F.linear(x_BTH, p["kda_f"])
    else:
        f = F.linear(F.linear(x_BTH, p["kda_f_a"]), p["kda_f_b"])
    f = (f.float() + p["kda_dt_bias"].float()).view(B, T, h, K)
    rate = p["kda_A_log"].float().exp().view(1, 1, h, 1)
    if "kda_f" not in p:  # Kimi Linear
        g = -rate * _softplus(f)
    else:  # Ling 3: bounded, or F.softplus's, and rounded to the activations' dtype
        g = (bound * torch.sigmoid(rate * f) if bound is not None else -rate * F.softplus(f)).to(x_BTH.dtype)
    beta = F.linear(x_BTH, p["kda_b"]).sigmoid()
    o = kda_rule(q, k, v, g, beta)
    if "kda_g" in p:
        gate = F.linear(x_BTH, p["kda_g"]).view(B, T, h, K)
    else:
        gate = F.linear(F.linear(x_BTH, p["kda_g_a"]), p["kda_g_b"]).view(B, T, h, K)
    o32 = o.float()
    normed = p["kda_norm"].float() * (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps))
    o = (normed * torch.sigmoid(gate.float())).to(o.dtype)
    return F.linear(o.reshape(B, T, h * K), p["kda_o"])
