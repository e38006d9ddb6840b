"""Solar Open (``solar_open``, Upstage Solar-Open-100B): GLM-4.5's MoE block under Llama
attention. Grouped-query attention with optional q/k/v bias (none on o_proj), no q/k norm,
RoPE on the whole head (θ default 1e6); every layer routed: a sigmoid router whose top-k is
chosen on σ(W_r y) + ``e_score_correction_bias`` within the best ``topk_group`` of ``n_group``
groups (top-2 sums; 1 of 1 by default), the chosen σ renormalised and scaled by
``routed_scaling_factor``, plus ``n_shared_experts`` ungated shared experts."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import TORCHTITAN_SHARED_EXPERTS, Ctx, Family, all_layers, v3_gate
from moeaudit.spec.layouts import ATTN, V3_MOE, hf_layout


def _full_rotary(c: Ctx) -> None:
    """transformers' Solar Open rotates the whole head (Llama's ``apply_rotary_pos_emb``): a
    ``partial_rotary_factor`` below 1 builds tables its attention cannot apply, so it is refused."""
    params = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    value = c.cfg.get("partial_rotary_factor") if value is None else value
    if value is not None and value != 1:
        raise CheckpointError(
            f"moeaudit does not replay partial_rotary_factor={value!r} for solar_open "
            "(transformers' Solar Open rotates the whole head)",
            path=c.path,
            hint="a limit of moeaudit, not a fault of the checkpoint: it replays 1.0",
        )


def _fields(c: Ctx) -> dict[str, Any]:
    _full_rotary(c)
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "o_bias": False,
        "shared_dim": c.get("n_shared_experts", int, 1) * c.get("moe_intermediate_size", int),
        "shared_gated": False,
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=1.0),
    }


LAYOUT = hf_layout(
    "solar_open",
    {
        **ATTN,
        **V3_MOE,
    },
    notes="Llama attention (q/k/v bias, no o bias, full rotary); GLM-4.5's sigmoid router with "
    "selection bias and group-limited top-k; shared experts; every layer routed",
)

FAMILY = Family(
    name="solar_open",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    default_rms_eps=1e-5,
    default_rope_theta=1e6,
    torchtitan=TORCHTITAN_SHARED_EXPERTS,
)
