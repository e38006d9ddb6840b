"""GLM-4.5 / GLM-4.6 (``glm4_moe``): grouped-query attention with q/k/v bias (no o_proj bias),
optional per-head q/k RMSNorm (``use_qk_norm``), rotate-half RoPE on the first
``partial_rotary_factor`` (default 0.5) of each head; DeepSeek-V3's router (sigmoid scores,
``e_score_correction_bias`` for selection only, group-limited top-k on top-2 sums,
renormalised and scaled combine weights), shared experts, ``first_k_dense_replace`` dense
layers; MTP layers stored after the decoder are left out."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import (
    TORCHTITAN_SHARED_EXPERTS,
    Ctx,
    Family,
    first_k_dense,
    head_dim,
    mtp_count,
    partial_rotary_dim,
    v3_gate,
)
from moeaudit.spec.layouts import ATTN, DENSE_MLP, V3_MOE, hf_layout


def _partial_rotary_factor(c: Ctx, default: float = 0.5) -> float:
    """From ``rope_parameters`` (v5) or the top level (the hub's v4 configs); ``default`` when
    absent (0.5, as transformers' Glm4MoeConfig sets it; GLM-derived configs pass their own)."""
    params = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None:
        value = c.cfg.get("partial_rotary_factor", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {value!r}", path=c.path)
    return float(value)


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": first_k_dense(c, 1),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "o_bias": False,
        "qk_norm": "head" if c.get("use_qk_norm", bool, False) else "none",
        "rotary_dim": partial_rotary_dim(c, head_dim(c), _partial_rotary_factor(c)),
        "dense_dim": c.get("intermediate_size", int, 0),
        "shared_dim": c.get("n_shared_experts", int, 1) * c.get("moe_intermediate_size", int),
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=1.0),
        "mtp_layers": mtp_count(c, 1),
    }


LAYOUT = hf_layout(
    "glm4_moe",
    {
        **ATTN,
        **V3_MOE,
        **DENSE_MLP,
    },
    notes="q/k/v bias, optional per-head qk norm, partial rotary; sigmoid router with selection "
    "bias and group-limited top-k; shared experts; first_k_dense_replace dense layers",
)

FAMILY = Family(
    name="glm4_moe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    default_rms_eps=1e-5,
    torchtitan=TORCHTITAN_SHARED_EXPERTS,
)
