"""The tiny configurations of the first families (mixtral, olmoe, qwen2_moe, qwen3_moe, the two
DeepSeeks) and of the registry-era families that each have their own oracle test file. A
table only: :mod:`hfmodels` builds ``REGISTRY`` from it and the other family groups' tables."""

from __future__ import annotations

from typing import Any

FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
DEEPSEEK = ("deepseek_v3", "deepseek_v2")
# registry-era families, each with its own oracle test file
NEW_FAMILIES = (
    "glm4_moe",
    "dots1",
    "hunyuan_v1_moe",
    "ernie4_5_moe",
    "minimax_m2",
    "granitemoe",
    "gpt_oss",
    "llama4_text",
    "phimoe",
)

TINY: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, intermediate_size=40),
    "olmoe": dict(num_experts=4, intermediate_size=40),
    "qwen2_moe": dict(
        num_experts=4,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        intermediate_size=56,
    ),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=24, intermediate_size=56),
    # MLA (low-rank q, kv latent, rope/nope split), a dense first layer, one shared expert,
    # 8 experts in 4 groups of which the best 2 compete, scaled combine weights.
    "deepseek_v3": dict(
        num_key_value_heads=4,  # MLA expands every head from the latent
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
    ),
    "deepseek_v2": dict(
        num_key_value_heads=4,
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        n_shared_experts=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        routed_scaling_factor=1.5,
    ),
    # q/k/v bias, per-head qk norm, RoPE on half of each head, V3's router (8 experts in 4
    # groups, best 2 compete, selection bias), one shared expert, a dense first layer.
    "glm4_moe": dict(
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.0,
        attention_bias=True,
        use_qk_norm=True,
        head_dim=8,
        partial_rotary_factor=0.5,
        num_nextn_predict_layers=0,
    ),
    # Qwen3 attention (per-head qk norm) with bias, V3's router (8 experts in 4 groups, best 2
    # compete, selection bias), one shared expert, a dense first layer, a sliding last layer.
    "dots1": dict(
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
        attention_bias=True,
        head_dim=8,
        sliding_window=5,
        max_window_layers=2,
    ),
    # per-head qk norm after RoPE, softmax top-k renormalised, shared MLP (as wide as an expert)
    "hunyuan_v1_moe": dict(
        num_experts=4,
        moe_topk=2,
        intermediate_size=40,
        attention_bias=True,
        head_dim=8,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        eod_token_id=None,
        sep_token_id=None,
    ),
    # softmax + selection bias router, two shared experts, a dense first layer, GLM-style RoPE
    "ernie4_5_moe": dict(
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=24,
        intermediate_size=56,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        tie_word_embeddings=False,
        head_dim=8,
    ),
    # q/k norm over all heads, RoPE on half of each head, sigmoid router with selection bias
    "minimax_m2": dict(
        num_local_experts=8,
        intermediate_size=24,
        head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # Mixtral routing with all four µP multipliers away from 1 (Granite-3.0-1B-A400M's values)
    "granitemoe": dict(
        num_local_experts=4,
        intermediate_size=24,
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        residual_multiplier=0.22,
        logits_scaling=6.0,
    ),
    # sinks, alternating sliding (window 5 < the 12-token windows) and full attention, biased
    # router and experts; a clamp limit the O(1) activations cross, so both clamps act
    "gpt_oss": dict(
        num_local_experts=4,
        intermediate_size=24,
        head_dim=8,
        sliding_window=5,
        swiglu_limit=1.0,
    ),
    # 4 layers: dense 0 and 2, routed 1 and 3 (top-1 of 4 plus the shared expert, inputs scaled by
    # σ); NoPE on layer 3 with a temperature that changes within 12 tokens (floor_scale 4);
    # chunked attention (chunks of 5 tokens) on the RoPE layers 0-2
    "llama4_text": dict(
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size=24,
        intermediate_size_mlp=40,
        interleave_moe_layer_step=2,
        head_dim=8,
        attention_chunk_size=5,
        floor_scale=4,
        attn_scale=0.5,
    ),
    # LayerNorms with bias, q/k/v/o and LM-head biases, sparsemixer top-2 with a jitter band wide
    # enough (0.3) that the combine softmaxes include rivals
    "phimoe": dict(
        num_local_experts=4,
        intermediate_size=24,
        attention_bias=True,
        lm_head_bias=True,
        router_jitter_noise=0.3,
    ),
}
