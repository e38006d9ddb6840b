"""JetMoE's mixture of attention heads (MoA; transformers' ``JetMoeAttention`` with ``JetMoeMoA``).

Keys and values come from one shared projection; each token's queries and output projections
come from the k attention experts its own router picks (Zhang et al. 2022, "Mixture of
Attention Heads"; Shen et al. 2024, "JetMoE", §2.2):

    k | v = W_kv x                                  (nkv heads of D each)
    R(t) = top-k of W_r x_t,  c_j = softmax of the k chosen logits (float32)
    q_{t,j} = W_q[e_j] x_t                          (slot j of R(t): nkv heads of D)
    a_{t,j} = causal attention of RoPE(q_{t,j}) over RoPE(k), v   (query head h reads kv head h)
    out_t = Σ_j c_j W_o[e_j] a_{t,j} + b

Every slot j sees the same keys and values (transformers tiles them, ``repeat(1, k, 1, 1)``:
head j·nkv + h reads kv head h), so the k·nkv query heads of a token are one attention call.
The q and o projections are batched per attention expert (the (token, slot) pairs sorted by
expert, stable; one matmul per expert), never a loop over tokens; the gathers and their
backward (index_put with accumulation) are deterministic.

This is the layer's token mixer (``LayerSettings.moa``): its router, expert projections, kv
projection and bias are differentiated by autograd with the attention and counted in the
attention gradient norm (``MOA_NAMES``). The receipts audit the routed MLP block only
(docs/decisions.md, "Mixture of attention heads (jetmoe)").

Shape suffixes: B windows, T tokens, N = B·T, H hidden size, E attention experts, K slots per
token (top-k), S = N·K (token, slot) pairs, n heads, D head dim, X = nkv·D.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head (transformers' ``apply_rotary_pos_emb``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _per_expert(x_SX: torch.Tensor, w_EOX: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows sorted by expert, each block through its expert's matrix: one matmul per expert."""
    blocks = x_SX.split(counts)
    return torch.cat([F.linear(b, w_EOX[e]) for e, b in enumerate(blocks) if counts[e]])


def moa_route(router_EH: torch.Tensor, x_NH: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen experts [N, K] by decreasing logit, their gates [N, K]): ``JetMoeTopKGating``,
    the softmax over the k chosen float32 logits, rounded to the activations' dtype."""
    logits_NE = F.linear(x_NH, router_EH).float()
    top_NK, idx_NK = logits_NE.topk(k, dim=1)
    return idx_NK, torch.softmax(top_NK, dim=1).to(x_NH.dtype)


def moa_attention(
    p: dict[str, torch.Tensor],
    x_BTH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    k: int,
    n_kv: int,
    head_dim: int,
) -> torch.Tensor:
    """The MoA block's output [B, T, H] for its normed input ``x_BTH`` (``moa_*`` and ``kv``
    weights of :data:`moeaudit.spec.config.MOA_NAMES`)."""
    B, T, H = x_BTH.shape
    N, D, E = B * T, head_dim, p["moa_router"].shape[0]
    x_NH = x_BTH.reshape(N, H)
    idx_NK, gate_NK = moa_route(p["moa_router"], x_NH, k)
    flat_S = idx_NK.reshape(-1)
    order_S = torch.argsort(flat_S, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_S, minlength=E).tolist()
    inverse_S = torch.argsort(order_S)  # a pair's row in the sorted order
    q_SX = _per_expert(x_NH[order_S // k], p["moa_q"], counts)[inverse_S]
    key, value = F.linear(x_BTH, p["kv"]).chunk(2, dim=-1)
    cos, sin = rope
    q_BnTD = _rotate(q_SX.view(B, T, k * n_kv, D).transpose(1, 2), cos, sin)
    k_BnTD = _rotate(key.view(B, T, n_kv, D).transpose(1, 2), cos, sin).repeat(1, k, 1, 1)
    v_BnTD = value.view(B, T, n_kv, D).transpose(1, 2).repeat(1, k, 1, 1)
    a = F.scaled_dot_product_attention(q_BnTD, k_BnTD, v_BnTD, is_causal=True, scale=D**-0.5)
    a_SX = a.transpose(1, 2).reshape(N * k, n_kv * D)
    o_SH = _per_expert(a_SX[order_S], p["moa_o"], counts) * gate_NK.reshape(-1)[order_S, None]
    return o_SH[inverse_S].view(N, k, H).sum(1).view(B, T, H) + p["moa_bias"]
