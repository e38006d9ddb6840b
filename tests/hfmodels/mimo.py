"""Tiny MiMo-V2-Flash (``mimo_v2_flash``) checkpoint config, same conventions as
:mod:`hfmodels.core`; a table, which :mod:`hfmodels` merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 6 layers, MiMoV2FlashConfig's pattern: full, sliding ×4 (a 5-token window < T = 12), full;
    # the first dense; q/k heads 12 wide (RoPE on int(12 × 0.334) = 4 dims), values 8 wide;
    # 1 kv head in full layers, 2 in sliding ones (with sinks); top-2 of 8 sigmoid, no shared expert
    "mimo_v2_flash": dict(
        num_hidden_layers=6,
        num_key_value_heads=1,
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        head_dim=12,
        v_head_dim=8,
        sliding_window=5,
    ),
}
