"""Tiny random configs of the Mamba hybrids (Jamba, Granite 4.0), same conventions
as :mod:`hfmodels.core`; a table, which :mod:`hfmodels` merges into ``REGISTRY``. transformers runs
its pure-torch Mamba paths here: mamba_ssm and causal_conv1d are not installed."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 4 layers: layer 1 attention (no RoPE), 0, 2, 3 Mamba-1; layers 0 and 2 routed (top-2 of 4,
    # softmax, not renormalised), 1 and 3 dense; a 4-state scan over 64 channels, dt rank 4
    "jamba": dict(
        num_hidden_layers=4,
        num_experts=4,
        intermediate_size=24,
        attn_layer_period=4,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    ),
    # 3 layers: Mamba-2, attention (no RoPE), Mamba-2; every layer routed (top-2 of 4 plus the
    # shared MLP), Granite's four multipliers; 4 heads of 16 channels in 2 groups, 8 states,
    # chunks of 5 tokens (so a 12-token window spans 3 chunks, the last one padded)
    "granitemoehybrid": dict(
        num_local_experts=4,
        intermediate_size=24,
        shared_intermediate_size=40,
        layer_types=["mamba", "attention", "mamba"],
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        residual_multiplier=0.22,
        logits_scaling=6.0,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_head=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=5,
    ),
}
