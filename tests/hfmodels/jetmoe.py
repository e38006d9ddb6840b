"""A tiny JetMoE (``jetmoe``) checkpoint config, same conventions as
:mod:`hfmodels.core`; a table, which :mod:`hfmodels` merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 3 layers, every one routed twice: top-2 of 4 attention experts (2 kv heads of 8 dims each, so
    # 4 query heads) and top-2 of 4 SwiGLU experts; the final norm at another eps than the layers'
    # (1e-6, fixed by transformers), so a replay that used one eps for all would show it
    "jetmoe": dict(
        num_local_experts=4,
        intermediate_size=24,
        kv_channels=8,
        rms_norm_eps=1e-2,
    ),
}
