"""The decoder of every supported family as plain functions of canonical weights.

One implementation serves the streaming replay (weights read one layer at a time), the
sample-run trainer (weights are leaf parameters) and the oracle tests. It follows
transformers' modeling code for each family (RMSNorm in float32, rotate-half RoPE, GQA,
softmax over all experts then top-k, optional renormalisation, SwiGLU experts).

A decoder layer is typed blocks (``spec.blocks``); each block kind's forward lives in
:mod:`moeaudit.replay.blocks` (``attention``, ``mla``, ``moe`` with ``router`` and ``experts``,
``mlp``, ``hc``, ``norms``, ``rope``; the other token mixers in ``replay.deltanet``, ``kda``,
``mamba``, ``lightning``, ``shortconv``, ``moa``), chosen by one registry
(``blocks.layer.MIXERS``). This module holds the embedding and the LM head's loss, and names
the blocks' functions for the modules that import them from here.

Shape suffixes: B windows, T tokens per window, N = B·T tokens, H hidden size, E experts,
K top-k, V vocabulary, nh/nkv heads, D head dim, I expert dim, S residual streams (HY-V4's hc_mult).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.replay.blocks.attention import apply_rope, attention
from moeaudit.replay.blocks.experts import (
    ExpertsBackward,
    _expert_slots,
    _relu2_grads,
    _swiglu_grads,
    expert_slots,
    experts_backward,
    experts_forward,
    experts_forward_sets,
    input_scales,
)
from moeaudit.replay.blocks.hc import HCWrite, hc_add, hc_mix, sinkhorn
from moeaudit.replay.blocks.layer import (
    MIXERS,
    attention_block,
    decoder_layer,
    hc_attention_block,
    hc_decoder_layer,
    mixer_forward,
    shortcut_rest,
)
from moeaudit.replay.blocks.mla import mla_attention
from moeaudit.replay.blocks.mlp import clamped_glu, expert_mlp, mlp, relu2_mlp, swiglu
from moeaudit.replay.blocks.moe import (
    ExtraExperts,
    MoETap,
    mlp_norm,
    moe_block,
    moe_router,
    route_layer,
    shared_expert,
)
from moeaudit.replay.blocks.norms import block_norm, rms_norm
from moeaudit.replay.blocks.rope import kind_rope, rope_tables, yarn_inv_freq
from moeaudit.replay.blocks.router import POSITIVE_SCORES, Routing, _group_limit, hash_route, positive_scores, route
from moeaudit.spec.config import ModelSpec

__all__ = [
    "MIXERS",
    "POSITIVE_SCORES",
    "ExpertsBackward",
    "ExtraExperts",
    "HCWrite",
    "MoETap",
    "Routing",
    "_expert_slots",
    "_group_limit",
    "_relu2_grads",
    "_swiglu_grads",
    "apply_rope",
    "attention",
    "attention_block",
    "block_norm",
    "clamped_glu",
    "decoder_layer",
    "embed",
    "expert_mlp",
    "expert_slots",
    "experts_backward",
    "experts_forward",
    "experts_forward_sets",
    "hash_route",
    "hc_add",
    "hc_attention_block",
    "hc_decoder_layer",
    "hc_mix",
    "input_scales",
    "kind_rope",
    "mixer_forward",
    "mla_attention",
    "mlp",
    "mlp_norm",
    "moe_block",
    "moe_router",
    "positive_scores",
    "relu2_mlp",
    "rms_norm",
    "rope_tables",
    "route",
    "route_layer",
    "shared_expert",
    "shortcut_rest",
    "sinkhorn",
    "swiglu",
    "token_nll",
    "yarn_inv_freq",
]


def embed(
    spec: ModelSpec, table_VH: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The decoder's input: the tokens' embedding rows (× Granite's ``embedding_multiplier``).
    The rows are cast to the compute ``dtype`` before any scaling: a multiplier applied in the
    stored bf16/fp16 would round there, so the file's dtype would change the math."""
    x = F.embedding(tokens.long(), table_VH)
    x = x if dtype is None else x.to(dtype)
    x = x if spec.embedding_multiplier == 1.0 else x * spec.embedding_multiplier
    if spec.hc is not None:  # HY-V4: the same row on each of the residual streams, [B, T, hc, H]
        return x.unsqueeze(-2).expand(*x.shape[:-1], spec.hc.streams, x.shape[-1]).contiguous()
    return x


def token_nll(
    spec: ModelSpec,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
    x_BTH: torch.Tensor,
    tokens_BT: torch.Tensor,
    *,
    final_norm_bias: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(nll_B(T-1) next-token cross-entropy in nats, logits_BTV)."""
    logits = F.linear(
        block_norm(spec, x_BTH, final_norm, final_norm_bias, spec.final_eps), lm_head, lm_head_bias
    ).float()
    if spec.logits_scaling != 1.0:
        logits = logits / spec.logits_scaling
    B, T, V = logits.shape
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens_BT[:, 1:].reshape(-1).long(), reduction="none")
    return nll.view(B, T - 1), logits
