"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's multi-head latent attention (RoPE
interleaved by default) with GLM-4.5's router (sigmoid scores, selection bias, top-2-sum groups,
by default one group; × ``routed_scaling_factor``, default 1.8), ``n_shared_experts`` shared
experts, and ``mlp_layer_types`` ("dense" / "sparse" per layer; default: the first layer dense).
The released checkpoint's MTP layer (layer 47, ``num_nextn_predict_layers``) is left out, as
transformers' class ignores it. Same key names as DeepSeek-V3."""

from __future__ import annotations

import dataclasses
from typing import Any

from moeaudit.families import deepseek_v3
from moeaudit.families.base import Ctx, mlp_layer_types, mtp_count, v3_gate


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        **deepseek_v3.FAMILY.fields(c),
        "routed_layers": mlp_layer_types(c, 1),
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=1.8),
        "mtp_layers": mtp_count(c, 0),
    }


FAMILY = dataclasses.replace(
    deepseek_v3.FAMILY,
    name="glm4_moe_lite",
    fields=_fields,
    default_rms_eps=1e-5,
    layout=dataclasses.replace(
        deepseek_v3.LAYOUT,
        family="glm4_moe_lite",
        notes="MLA attention; GLM-4.5's sigmoid router with selection bias; shared "
        "experts; mlp_layer_types dense/sparse layers; MTP layers left out",
    ),
)
