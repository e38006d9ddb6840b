"""Tiny random configs of Nemotron-H, same conventions as :mod:`hfmodels.core`; a
table, which :mod:`hfmodels` merges into ``REGISTRY``. transformers runs its pure-torch Mamba-2
path here: mamba_ssm and causal_conv1d are not installed."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 5 single-block layers: Mamba-2, MoE, attention (no RoPE), dense ReLU² MLP, MoE; top-2 of 4
    # (sigmoid scores, selection bias, renormalised, × 1.5) plus a ReLU² shared expert of 40;
    # 4 Mamba heads of 16 channels in 2 groups, 8 states, chunks of 5 tokens
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe"],
        num_hidden_layers=5,
        head_dim=8,
        n_routed_experts=4,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40,
        intermediate_size=48,
        routed_scaling_factor=1.5,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=5,
        layer_norm_epsilon=1e-5,
    ),
}
