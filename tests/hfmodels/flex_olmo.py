"""A tiny FlexOlmo (``flex_olmo``) checkpoint config, same conventions as
:mod:`hfmodels.core`; a table, which :mod:`hfmodels` merges into ``REGISTRY``."""

from __future__ import annotations

from typing import Any

TINY: dict[str, dict[str, Any]] = {
    # 3 layers, every one routed: top-2 of 6 experts (softmax, not renormalised: the config's
    # default), GQA (4 heads, 2 kv heads), q/k norms over all heads, post-norms on the attention
    # and MoE outputs
    "flex_olmo": dict(num_experts=6, intermediate_size=40),
}
