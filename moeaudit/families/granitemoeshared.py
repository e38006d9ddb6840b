"""Granite MoE with a shared MLP (``granitemoeshared``): :mod:`moeaudit.families.granitemoe`'s
routing (top-k of the router logits, softmax over those k) and µP multipliers, plus an always-on
SwiGLU ``shared_mlp`` added to the routed output before the residual multiplier (Granite 4.0's
shared MLP without the Mamba layers). Its gate and up rows are stored fused in
``shared_mlp.input_linear`` [2·S, H] (gate first), split on read; ``shared_intermediate_size`` 0
(the configuration's default) builds no shared MLP. Every layer is routed."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import granitemoe
from moeaudit.families.base import Ctx, Family
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed


def shared_mlp(c: Ctx) -> dict[str, Any]:
    """``shared_intermediate_size`` (default 0: no shared MLP), ungated."""
    size = c.get("shared_intermediate_size", int, 0)
    if size < 0:
        raise CheckpointError(f"config.json: shared_intermediate_size must be ≥ 0, got {size}", path=c.path)
    return {"shared_dim": size, "shared_gated": False}


def _fields(c: Ctx) -> dict[str, Any]:
    return {**granitemoe._fields(c), **shared_mlp(c)}


ROUTER = {"router": ("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight")}
SHARED = {"shared_gate_up": "shared_mlp.input_linear.weight", "shared_w2": "shared_mlp.output_linear.weight"}

LAYOUT = Layout(
    family="granitemoeshared",
    globals=GLOBALS,
    layer=prefixed(L, {**ATTN, **ROUTER, **SHARED}),
    expert={},
    fused=granitemoe.LAYOUT.fused,
    notes="Mixtral routing plus an ungated shared MLP (fused gate/up rows); Granite's multipliers; fused experts",
)

FAMILY = Family(
    name="granitemoeshared",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts", "num_experts"),
    expert_dim_key="intermediate_size",
)
