"""A tiny HY-V4 (``hy_v4``, Hunyuan V4) checkpoint config, same conventions as
:mod:`hfmodels.core`; a table, which :mod:`hfmodels` merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 3 layers, two residual streams (hc_mult 2); a dense first layer; MLA with a query latent,
    # a per-channel output gate and attention sinks; every layer its own DSA indexer keeping the
    # 5 best of T = 12 keys; sigmoid top-2 of 8 with a selection bias, renormalised × 2.5, one
    # shared expert; the experts' SwiGLU clamped at 0.5 (it bites at these sizes)
    "hy_v4": dict(
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        index_topk=5,
        index_n_heads=4,
        index_head_dim=8,
        indexer_types=["full", "full", "full"],
        hc_mult=2,
        swiglu_limit=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
