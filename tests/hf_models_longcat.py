"""A tiny LongCat-Flash (``longcat_flash``) checkpoint config, same conventions as :mod:`hf_models`
(whose builders, re-drawn weights and loaders it reuses); importing this module registers it in
``hf_models._FAMILY``. Importing this module needs transformers."""

from __future__ import annotations

from typing import Any

import hf_models

TINY: dict[str, dict[str, Any]] = {
    # 2 decoder layers (num_hidden_layers counts the 4 attention sub-blocks), each two MLA
    # sub-blocks and two dense MLPs around the shortcut MoE: top-2 of 6 parametric + 2
    # zero-computation experts, a selection bias, combine weights × 2.5
    "longcat_flash": dict(
        num_hidden_layers=4,
        num_key_value_heads=4,  # MLA expands every head from the latent
        n_routed_experts=6,
        zero_expert_num=2,
        moe_topk=2,
        expert_ffn_hidden_size=24,
        ffn_hidden_size=40,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        head_dim=4,
        v_head_dim=6,
        routed_scaling_factor=2.5,
    ),
}
hf_models._FAMILY.update(TINY)
