"""Aria's text decoder (``aria_text``): Llama attention (q/k/v/o biases with ``attention_bias``),
Mixtral's routing (top-``moe_topk`` of the router logits, softmax over those k, on every layer),
and always-on shared experts: one ungated SwiGLU MLP ``intermediate_size × moe_num_shared_experts``
wide, added to the routed output. The routed experts are stored fused and transposed, as Aria's
grouped GEMM reads them: ``gate_up_proj`` [E, H, 2I] (gate columns first) and ``down_proj``
[E, I, H], released as ``experts.fc1.weight`` / ``experts.fc2.weight``. ``mlp_bias`` (biases on
the shared MLP) is not replayed and refused."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, all_layers
from moeaudit.spec.layouts import ATTN, GLOBALS, SHARED_EXPERTS, L, Layout, prefixed


def _fields(c: Ctx) -> dict[str, Any]:
    if c.cfg.get("mlp_bias"):
        raise CheckpointError(
            "model family 'aria_text' with mlp_bias true cannot be replayed: the shared "
            "experts' biases are not replayed",
            path=c.path,
        )
    shared = c.get("moe_num_shared_experts", int, 2)
    if shared < 0:
        raise CheckpointError(f"config.json: moe_num_shared_experts must be ≥ 0, got {shared}", path=c.path)
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": True,
        "shared_dim": c.get("intermediate_size", int, 4096) * shared,
        "shared_gated": False,
    }


TEXT_LAYER = {
    **ATTN,
    "router": "mlp.router.weight",
    **SHARED_EXPERTS,
}
TEXT_FUSED = {
    "gate_up": ("mlp.experts.gate_up_proj", "mlp.experts.fc1.weight"),
    "down": ("mlp.experts.down_proj", "mlp.experts.fc2.weight"),
}
NOTES = "Mixtral routing plus ungated shared experts; fused experts stored transposed ([E, H, 2I])"

LAYOUT = Layout(
    family="aria_text",
    globals=GLOBALS,
    layer=prefixed(L, TEXT_LAYER),
    expert={},
    fused=prefixed(L, TEXT_FUSED),
    fused_format="transposed",
    notes=NOTES,
)

FAMILY = Family(
    name="aria_text",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("moe_num_experts",),
    expert_dim_key="intermediate_size",
    top_k_key="moe_topk",
)
