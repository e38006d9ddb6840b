"""A tiny FlexOlmo (``flex_olmo``) checkpoint config, same conventions as :mod:`hf_models` (whose
builders, re-drawn weights and loaders it reuses); importing this module registers it in
``hf_models._FAMILY``. Importing this module needs transformers."""

from __future__ import annotations

from typing import Any

import hf_models

TINY: dict[str, dict[str, Any]] = {
    # 3 layers, every one routed: top-2 of 6 experts (softmax, not renormalised: the config's
    # default), GQA (4 heads, 2 kv heads), q/k norms over all heads, post-norms on the attention
    # and MoE outputs
    "flex_olmo": dict(num_experts=6, intermediate_size=40),
}
hf_models._FAMILY.update(TINY)
