"""Tiny random configs of the newer routed designs (Solar Open, Sarvam, Hy3, …), same
conventions as :mod:`hfmodels.core`; a table, which :mod:`hfmodels` merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

_V3_ROUTER = dict(n_routed_experts=8, moe_intermediate_size=24, n_shared_experts=1, routed_scaling_factor=2.0)

TINY: dict[str, dict[str, Any]] = {
    # Llama attention with q/k/v bias (no o bias), GLM's router: 8 experts in 4 groups of which the
    # best 2 compete, a real selection bias, one shared expert, every layer routed
    "solar_open": dict(_V3_ROUTER, n_group=4, topk_group=2, attention_bias=True, head_dim=8),
    # GLM-4.5 built from Sarvam's config: full rotary, q/k norms, a dense first layer, 8 experts in
    # 4 groups (best 2), one shared expert, scaled combine weights
    "sarvam_moe": dict(_V3_ROUTER, n_group=4, topk_group=2, intermediate_size=56, head_dim=8, first_k_dense_replace=1),
    # DeepSeek-V3 built from Sarvam's config: MLA with a plain query projection, a dense first layer,
    # 8 experts (one group by Sarvam's default), one shared expert, scaled combine weights
    "sarvam_mla": dict(
        _V3_ROUTER,
        num_key_value_heads=4,
        intermediate_size=56,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
    ),
    # GLM-5: DeepSeek-V3.2's MLA + DSA (index_topk 5 < T = 12, the indexer's RoPE on adjacent pairs),
    # a dense first layer, 8 experts in 4 groups (best 2), one shared expert
    "glm_moe_dsa": dict(
        _V3_ROUTER,
        n_group=4,
        topk_group=2,
        num_key_value_heads=4,
        intermediate_size=56,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        index_topk=5,
        index_n_heads=8,
        index_head_dim=8,
    ),
    # MiniMax-01: layers full, lightning, full, lightning (blocks of 5 < T = 12 tokens), DeepNorm
    # residual factors away from 1, Mixtral's MoE (top-2 of 4)
    "minimax": dict(
        num_local_experts=4,
        intermediate_size=24,
        head_dim=8,
        num_hidden_layers=4,
        block_size=5,
        full_attn_alpha_factor=1.5,
        linear_attn_alpha_factor=2.0,
        linear_attn_beta_factor=0.5,
        mlp_alpha_factor=1.25,
        mlp_beta_factor=0.75,
    ),
    # Laguna: q/k norms, RoPE on half of each head, a softplus gate per head, a dense first layer,
    # 8 experts with soft-capped (c = 2) sigmoid logits and a selection bias, the routed sum × 1.5,
    # an ungated shared expert
    "laguna": dict(
        num_experts=8,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        intermediate_size=56,
        head_dim=8,
        moe_routed_scaling_factor=1.5,
        moe_router_logit_softcapping=2.0,
    ),
    # Qwen3 attention with q/k norms, a dense first layer, 8 experts, sigmoid router with a real
    # selection bias (a buffer of the block), renormalised and scaled, one shared expert
    "hy_v3": dict(
        num_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        num_shared_experts=1,
        router_scaling_factor=2.0,
        head_dim=8,
    ),
}
