"""A tiny AFMoE (Arcee Trinity, ``afmoe``) checkpoint config, same conventions as
:mod:`hfmodels.core`; a table, which :mod:`hfmodels` merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 3 layers: sliding (a 5-token window < T = 12, RoPE), full (no RoPE), sliding; a dense first
    # layer; top-2 of 8 with a selection bias, the combine weights × 1.5, one shared expert
    "afmoe": dict(
        num_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        num_shared_experts=1,
        route_scale=1.5,
        head_dim=8,
        num_dense_layers=1,
        global_attn_every_n_layers=2,
        sliding_window=5,
    ),
}
