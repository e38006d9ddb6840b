"""A tiny Kimi Linear (``kimi_linear``) checkpoint config, and a tiny Ling 3
(``bailing_hybrid``) one, same conventions as :mod:`hfmodels.core`; a table, which :mod:`hfmodels`
merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 3 layers: KDA, MLA (no RoPE), KDA; a dense first layer; top-2 of 8 with a selection bias in
    # one group, the combine weights × 2.446, one shared expert; KDA with 2 heads of 8 channels
    "kimi_linear": dict(
        num_local_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        num_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_key_value_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        linear_num_heads=2,
        linear_head_dim=8,
        linear_conv_kernel_dim=4,
    ),
    # Ling 3: 3 layers, KDA, MLA (interleaved RoPE, per-head sigmoid output gate), KDA; a dense first
    # layer; top-2 of 8 in 2 groups of which 1 is kept; one shared expert; KDA with 4 heads (the
    # attention heads) of 8 channels, the bounded forget gate
    "bailing_hybrid": dict(
        num_experts=8,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=24,
        intermediate_size=56,
        num_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_key_value_heads=4,
        head_dim=8,
        layer_group_size=2,
        first_k_dense_replace=1,
        rope_theta=10000.0,
        kda_lower_bound=-2.0,
    ),
}
