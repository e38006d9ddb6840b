"""ERNIE 4.5 VL MoE (``ernie4_5_vl_moe``): a vision-language checkpoint whose MoE layers hold two
expert groups, text and vision, each with its own router and selection bias; a token is routed in
its modality's group only, so on text tokens (the canary) only the text group runs, and that is
ERNIE 4.5 MoE's block (:mod:`moeaudit.families.ernie4_5_moe`: softmax top-``moe_k`` chosen on the
probabilities plus the selection bias, renormalised with the denominator clamped at
``moe_norm_min``, ungated shared experts ``moe_num_shared_experts × moe_intermediate_size[0]``).
The vision group (its router, experts ``moe_intermediate_size[1]`` wide and bias row) is left out,
as are the vision tower and the resampler. Layers are dense or sparse by ``mlp_layer_types``
(default: the first dense). The multimodal RoPE pre-rotates the frequencies of its h and w
sections and interleaves them back, so on text, where the three position streams are equal, it is
ERNIE 4.5's RoPE on adjacent pairs (h and w sections of equal size, as transformers requires).

Stored as released (what transformers 5.24 also saves): the text router ``mlp.gate.weight``
transposed, [hidden, experts], beside the vision one ``mlp.gate.weight_1``; one [2, experts]
``mlp.moe_statics.e_score_correction_bias`` (text row first); the experts as one
``mlp.experts.*`` list, text experts first. transformers' module names (``model.language_model.*``,
``mlp.text_moe.*``, fused experts) are read too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families._wrap import rebase
from moeaudit.families.base import Ctx, Family, Refuse, mlp_layer_types
from moeaudit.families.ernie4_5_moe import _norm_min
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_EXPERTS, SHARED_EXPERTS, Layout, prefixed


def _text(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The text config, its ``moe_intermediate_size`` [text, vision] read as the text group's."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("config.json: model_type 'ernie4_5_vl_moe' needs a text_config object", path=path)
    sizes = text.get("moe_intermediate_size", [1536, 512])
    if (
        not isinstance(sizes, list)
        or len(sizes) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes)
    ):
        raise CheckpointError(
            f"config.json: text_config.moe_intermediate_size must be [text, vision] sizes, got {sizes!r}", path=path
        )
    rope = text.get("rope_parameters") or {}
    section = rope.get("mrope_section", [22, 22, 20]) if isinstance(rope, dict) else None
    if not isinstance(section, list) or len(section) != 3 or section[0] != section[1]:
        raise CheckpointError(f"config.json: mrope_section must be [h, w, t] with h = w, got {section!r}", path=path)
    return {
        **text,
        "moe_intermediate_size": sizes[0],
        "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True)),
    }


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": mlp_layer_types(c, 1),
        "norm_topk_prob": True,
        "attention_bias": False,
        "tie_embeddings": bool(c.get("tie_word_embeddings", bool, True)),
        "dense_dim": c.get("intermediate_size", int, 12288),
        "shared_dim": c.get("moe_num_shared_experts", int, 2) * c.get("moe_intermediate_size", int),
        "shared_gated": False,
        "gate": Gate(scoring="softmax", selection_bias=True),
        "rope_interleaved": True,
        "renorm_min": _norm_min(c),
    }


L = "model.layers.{layer}."
BASES = ("model.", "model.language_model.")
TEXT: dict[str, str | tuple[str, ...]] = {
    **ATTN,
    # as released / saved, then transformers' module names
    "router": ("mlp.gate.weight", "mlp.text_moe.gate.weight"),
    "router_bias": ("mlp.moe_statics.e_score_correction_bias", "mlp.text_moe.gate.moe_statics.e_score_correction_bias"),
    **SHARED_EXPERTS,
    **DENSE_MLP,
}
VISION_GROUP = "the vision expert group (router, bias row, experts): text tokens never reach it"

LAYOUT = Layout(
    family="ernie4_5_vl_moe",
    globals={
        **rebase({"embed": ("model.embed_tokens.weight",), "final_norm": ("model.norm.weight",)}, BASES),
        "lm_head": ("lm_head.weight",),
    },
    layer=rebase(prefixed(L, TEXT), BASES),
    expert=rebase(prefixed(L, MLP_EXPERTS), BASES),
    fused=rebase(
        prefixed(L, {"gate_up": "mlp.text_moe.experts.gate_up_proj", "down": "mlp.text_moe.experts.down_proj"}), BASES
    ),
    stored={
        "model.layers.{layer}.mlp.gate.weight": "transposed",
        "model.layers.{layer}.mlp.moe_statics.e_score_correction_bias": "first_row",
        "model.language_model.layers.{layer}.mlp.moe_statics.e_score_correction_bias": "first_row",
    },
    notes="the text decoder and text expert group of the ERNIE 4.5 VL vision-language model: softmax router "
    "with a selection bias; shared experts; mlp_layer_types; interleaved RoPE",
    left_out={
        # the text experts are read first, so what is left under experts.* is the vision group
        L + "mlp.experts.": VISION_GROUP,
        L + "mlp.gate.weight_1": VISION_GROUP,
        "model.language_model.layers.{layer}.mlp.vision_moe.": VISION_GROUP,
        "model.vision_model.": "vision tower",
        "model.vision_tower.": "vision tower",
        "vision_model.": "vision tower",
        "model.resampler_model.": "resampler",
        "resampler_model.": "resampler",
    },
)

FAMILY = Family(
    name="ernie4_5_vl_moe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("moe_num_experts", "num_experts"),
    top_k_key="moe_k",
    default_rms_eps=1e-5,
    decoder_config=_text,
    refuse=(Refuse("use_bias", (False,), "biases on the attention, MLPs, experts and LM head"),),
    audits="the text decoder and text expert group of the ERNIE 4.5 VL vision-language model",
)
