"""DeepSeek-OCR-2 (``deepseek_ocr2``): an OCR vision-language checkpoint whose text decoder is
DeepSeek-V2's MoE on plain attention: Llama attention (q/k/v/o, biases with ``attention_bias``,
rotate-half RoPE, head size hidden_size / heads whatever ``head_dim`` says — the text config
overwrites it), DeepSeek-V2's router (softmax; greedy or ``group_limited_greedy`` top-k with a
group's score its best probability; never renormalised; × ``routed_scaling_factor``), shared experts
``n_shared_experts × moe_intermediate_size`` wide, ungated, and ``mlp_layer_types`` naming each
layer dense or sparse (required: transformers cannot build the model without it). Replayed from
``text_config`` and ``model.layers.*`` (the released names, which transformers 5.24 also saves) or
``model.language_model.*`` (its module names); the SAM and Qwen2 vision encoders, the projector
and the view separator are left out (the canary is text)."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families._wrap import rebase
from moeaudit.families.base import Ctx, Family, text_config
from moeaudit.families.deepseek_v2 import v2_gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_EXPERTS, MLP_FUSED, MLP_MOE, SHARED_EXPERTS, Layout, prefixed

METHODS = ("greedy", "group_limited_greedy")


def fields(c: Ctx, default_types: list[str] | None = None) -> dict[str, Any]:
    """The decoder's fields; ``default_types``: the dense/sparse layers when ``mlp_layer_types`` is
    absent (DeepSeek-OCR-2 has none: transformers cannot build the model without it)."""
    types = c.cfg.get("mlp_layer_types", default_types)
    if not isinstance(types, list) or len(types) != c.num_layers or any(t not in ("dense", "sparse") for t in types):
        raise CheckpointError(
            f"config.json: deepseek_ocr2's text_config needs mlp_layer_types, 'dense' or "
            f"'sparse' for each of its {c.num_layers} layers",
            path=c.path,
        )
    method = c.get("topk_method", str, "greedy")
    if method not in METHODS:
        raise CheckpointError(
            f"config.json: topk_method {method!r} is not one of {', '.join(METHODS)} "
            "(transformers' DeepSeek-OCR-2 router has no other)",
            path=c.path,
        )
    hidden, heads = c.get("hidden_size", int), c.get("num_attention_heads", int)
    if hidden % heads:
        raise CheckpointError(f"hidden_size {hidden} not divisible by {heads} heads", path=c.path)
    return {
        "routed_layers": tuple(i for i, t in enumerate(types) if t == "sparse"),
        "head_dim": hidden // heads,
        "norm_topk_prob": False,
        "dense_dim": c.get("intermediate_size", int, 11008),
        "shared_dim": c.get("n_shared_experts", int, 2) * c.get("moe_intermediate_size", int),
        "shared_gated": False,
        "gate": v2_gate(c, method),
    }


TEXT = {
    **ATTN,
    **MLP_MOE,
    **SHARED_EXPERTS,
    **DENSE_MLP,
}
L = "model.layers.{layer}."
BASES = ("model.", "model.language_model.")

LAYOUT = Layout(
    family="deepseek_ocr2",
    globals={
        **rebase({"embed": ("model.embed_tokens.weight",), "final_norm": ("model.norm.weight",)}, BASES),
        "lm_head": ("lm_head.weight",),
    },
    layer=rebase(prefixed(L, TEXT), BASES),
    expert=rebase(prefixed(L, MLP_EXPERTS), BASES),
    fused=rebase(prefixed(L, MLP_FUSED), BASES),
    notes="the text decoder (DeepSeek-V2 MoE on Llama attention) of the DeepSeek-OCR-2 vision-language model; "
    "softmax greedy / group-limited top-k, not renormalised, scaled; shared experts; mlp_layer_types",
    left_out={
        "model.sam_model.": "SAM vision encoder",
        "model.qwen2_model.": "Qwen2 vision encoder",
        "model.projector.": "multi-modal projector",
        "model.view_seperator": "view separator",
        "model.vision_tower.": "vision tower",
        "model.multi_modal_projector.": "multi-modal projector",
        "model.view_separator": "view separator",
    },
)

FAMILY = Family(
    name="deepseek_ocr2",
    layout=LAYOUT,
    fields=fields,
    expert_count_keys=("n_routed_experts", "num_experts"),
    decoder_config=text_config,
    audits="the text decoder (DeepSeek-V2 MoE on Llama attention) of the DeepSeek-OCR-2 vision-language model",
)
