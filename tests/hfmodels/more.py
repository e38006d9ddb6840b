"""Tiny Flint (``flint``), Mellum (``mellum``) and Lara-Mini (``lara_mini``) checkpoint configs,
same conventions as :mod:`hfmodels.core`; a table, which :mod:`hfmodels` merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 4 layers: full (no RoPE), full, sliding (a 5-token window < T = 12, RoPE), full (the last);
    # the first two dense (mlp_only_layers' default), top-2 of 8 sigmoid, one ungated shared expert
    "flint": dict(
        num_hidden_layers=4,
        num_experts=8,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        intermediate_size=56,
        head_dim=8,
        sliding_window=5,
    ),
    # 3 layers, all full attention (MellumConfig's default: one RoPE, θ 500000); a dense first
    # layer (mlp_layer_types), top-2 of 8 softmax, no shared expert
    "mellum": dict(
        num_local_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        head_dim=8,
        mlp_layer_types=["dense", "sparse", "sparse"],
    ),
    # 5 layers, LaraMiniConfig's released pattern: DeltaNet, sliding (a 5-token window, RoPE),
    # DeltaNet, full (no RoPE), sliding; every layer routed, top-2 of 8 softmax plus one ungated
    # shared expert; 2 key heads serving 4 value heads; tied embeddings (the default)
    "lara_mini": dict(
        num_hidden_layers=5,
        num_experts=8,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        head_dim=8,
        sliding_window=5,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
}
