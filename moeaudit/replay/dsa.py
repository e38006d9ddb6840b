"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the lightning indexer's key selection.

Each query attends only to the ``index_topk`` causal keys the indexer scores highest:
``I[s, t] = Σ_h w_h(x_s) · ReLU(q_{s,h} · k_t / √D_I)`` with ``w = W_w x / √n_I``, queries
from the MLA query latent (``wq_b``), one LayerNorm'd key per token (``wk``), and rotate-half
RoPE on the first ``qk_rope_head_dim`` dims of both (the main MLA rotates interleaved pairs;
GLM-5's indexer does too: ``interleave``).
It follows transformers' ``DeepseekV32Indexer``, which leaves out the reference kernel's
Hadamard rotation (orthogonal: q·k unchanged) and FP8 scoring. The selection is discrete and
the indexer is trained by its own distillation loss, so no gradient flows through it.

Shape suffixes: B windows, T tokens, R query-latent rank, n indexer heads, D indexer head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.replay.selection import keep_best

INDEXER_NORM_EPS = 1e-6  # transformers builds the indexer's k_norm LayerNorm with eps=1e-6
QUERY_BLOCK = 256  # queries scored at once: bounds the [B, block, heads, T] intermediate


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate-half RoPE, or on adjacent pairs (x0, x1), (x2, x3), … with the output de-interleaved
    as transformers' ``apply_rotary_pos_emb_interleave`` writes it (GLM-5's indexer)."""
    if not interleave:
        return x * cos + _rotate_half(x) * sin
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@torch.no_grad()
def index_scores(
    p: dict[str, torch.Tensor],
    x_BTH: torch.Tensor,
    q_lat_BTR: torch.Tensor,
    cos_TD: torch.Tensor,
    sin_TD: torch.Tensor,
    n_heads: int,
    head_dim: int,
    interleave: bool = False,
    rope_last: bool = False,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """Indexer scores I_BTT[b, s, t] for every query s and key t (causality not yet applied).
    ``rope_last`` (HY-V4): RoPE on the last ``rot`` dims of each head, not the first;
    ``norm_eps``: the key LayerNorm's eps (None: ``INDEXER_NORM_EPS``)."""
    B, T, _ = x_BTH.shape
    rot = cos_TD.shape[-1]
    eps = INDEXER_NORM_EPS if norm_eps is None else norm_eps
    q = F.linear(q_lat_BTR, p["idx_wq_b"]).view(B, T, n_heads, head_dim)
    k = F.layer_norm(F.linear(x_BTH, p["idx_wk"]), (head_dim,), p["idx_k_norm"], p["idx_k_norm_bias"], eps)
    cos, sin = cos_TD[:, None, :], sin_TD[:, None, :]
    if rope_last:
        q_pass, q_rot = q.split([head_dim - rot, rot], dim=-1)
        q = torch.cat([q_pass, _rope(q_rot, cos, sin, interleave)], dim=-1)  # [B, T, n, D]
        k_pass, k_rot = k.split([head_dim - rot, rot], dim=-1)
        k = torch.cat([k_pass, _rope(k_rot, cos_TD, sin_TD, interleave)], dim=-1)  # [B, T, D]
    else:
        q_rot, q_pass = q.split([rot, head_dim - rot], dim=-1)
        q = torch.cat([_rope(q_rot, cos, sin, interleave), q_pass], dim=-1)  # [B, T, n, D]
        k_rot, k_pass = k.split([rot, head_dim - rot], dim=-1)
        k = torch.cat([_rope(k_rot, cos_TD, sin_TD, interleave), k_pass], dim=-1)  # [B, T, D]
    kT_B1DT = k.transpose(-1, -2).float().unsqueeze(1)
    w_BTn = F.linear(x_BTH, p["idx_weights"]).float() * n_heads**-0.5
    out = []
    for s0 in range(0, T, QUERY_BLOCK):  # [B, block, n, T] at a time, not [B, T, n, T]
        scores = F.relu(torch.matmul(q[:, s0 : s0 + QUERY_BLOCK].float(), kT_B1DT) * head_dim**-0.5)
        out.append(torch.matmul(w_BTn[:, s0 : s0 + QUERY_BLOCK].unsqueeze(-2), scores).squeeze(-2))
    return torch.cat(out, dim=1)


@torch.no_grad()
def sparse_causal_mask(
    p: dict[str, torch.Tensor],
    x_BTH: torch.Tensor,
    q_lat_BTR: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    n_heads: int,
    head_dim: int,
    topk: int,
    interleave: bool = False,
    rope_last: bool = False,
    norm_eps: float | None = None,
) -> torch.Tensor | None:
    """keep_B1TT: causal keys among each query's ``topk`` best; None when every causal key is
    kept (T ≤ topk), so the caller's plain causal attention is exactly DSA's.

    Masked keys score float32's lowest value before the selection, as transformers' additive
    causal mask makes them; exact ties at the cut go to the earlier key on every device
    (:func:`moeaudit.replay.selection.keep_best`), where transformers' ``topk`` breaks them as
    the device's kernel does."""
    T = x_BTH.shape[1]
    if T <= topk:
        return None
    scores_BTT = index_scores(p, x_BTH, q_lat_BTR, *rope, n_heads, head_dim, interleave, rope_last, norm_eps)
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=x_BTH.device).tril()
    scores_BTT = scores_BTT.masked_fill(~causal_TT, torch.finfo(scores_BTT.dtype).min)
    return (keep_best(scores_BTT, topk) & causal_TT)[:, None]
