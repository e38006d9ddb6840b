"""Tiny random configs of the routed designs K-EXAONE, Command A MoE, DBRX and LFM2-MoE, same
conventions as :mod:`hfmodels.core` (whose ``redraw`` draws DBRX's norm gains near 1 and
LFM2-MoE's selection bias); a table, which :mod:`hfmodels` merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
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
    # fused Wqkv clamped at 0.5 (the O(1) activations cross it), bias-free LayerNorms, softmax
    # top-2 of 4 renormalised, flat experts; GQA (2 kv heads), all layers routed
    "dbrx": dict(
        d_model=32,  # DbrxConfig copies it into ffn_config before the hidden_size alias is applied
        n_heads=4,
        n_layers=3,
        max_seq_len=64,
        attn_config={"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    # conv layers 0 and 2 (kernel 3), attention layer 1 (per-head qk norm), a dense first layer,
    # sigmoid top-2 of 8 chosen with a real expert_bias, renormalised, ×2
    "lfm2_moe": dict(
        layer_types=["conv", "full_attention", "conv"],
        num_dense_layers=1,
        num_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        routed_scaling_factor=2.0,
    ),
}
