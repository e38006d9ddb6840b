"""Tiny random configs of the routed designs added in issue 27 §2 (K-EXAONE, Command A MoE,
DBRX, …), same conventions as :mod:`hf_models` (whose builders, re-drawn weights and loaders
they reuse)."""

from __future__ import annotations

from typing import Any

import hf_models

FAMD: dict[str, dict[str, Any]] = {
    # EXAONE 4 attention (per-head qk norm; sliding layers 0 and 2 with RoPE and a window of 5 < T,
    # global layer 1 without RoPE), V3's router (8 experts in 4 groups, best 2 compete, selection
    # bias, ×2.5), one shared expert, a dense first layer
    "exaone_moe": dict(
        num_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        num_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        sliding_window=5,
        sliding_window_pattern=2,
    ),
    # Cohere's parallel block on a bias-free LayerNorm; sliding layers 0, 2 (interleaved RoPE,
    # window 5 < T), global layer 1 without RoPE; top-2 of 8 (softmax over the chosen logits),
    # one shared expert averaged with the routed output; logits × 0.25; tied embeddings
    "cohere2_moe": dict(
        head_dim=8,
        num_experts=8,
        intermediate_size=24,
        num_shared_experts=1,
        sliding_window=5,
        sliding_window_pattern=2,
        logit_scale=0.25,
    ),
}

hf_models._FAMILY.update(FAMD)
