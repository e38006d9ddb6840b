"""A tiny Kimi Linear (``kimi_linear``) checkpoint config, same conventions as :mod:`hf_models`
(whose builders, re-drawn weights and loaders it reuses); importing this module registers it in
``hf_models._FAMILY``. Importing this module needs transformers."""

from __future__ import annotations

from typing import Any

import hf_models

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
}
hf_models._FAMILY.update(TINY)
