"""Llama 4 as released (``llama4``, ``Llama4ForConditionalGeneration``): a vision-language
checkpoint whose text decoder (:mod:`moeaudit.families.llama4_text`) is replayed from
``text_config`` and ``language_model.*``; the vision encoder ``vision_model.*`` and the
``multi_modal_projector.*`` are left out (the canary is text)."""

from __future__ import annotations

from moeaudit.families import llama4_text as text
from moeaudit.families.base import Family, text_config
from moeaudit.spec.layouts import L, Layout, prefixed

LM = "language_model.model.layers.{layer}."


def _both(table: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The VL checkpoint's names, then the text decoder's own (``model.layers.*``: a torchtitan
    DCP directory with the VL config.json beside it, as torchtitan's Llama 4 adapter pairs them)."""
    vl, text_only = prefixed(LM, table), prefixed(L, table)
    return {n: (*vl[n], *text_only[n]) for n in table}


LAYOUT = Layout(
    family="llama4",
    globals={
        "embed": ("language_model.model.embed_tokens.weight", "model.embed_tokens.weight"),
        "final_norm": ("language_model.model.norm.weight", "model.norm.weight"),
        "lm_head": ("language_model.lm_head.weight", "lm_head.weight"),
    },
    layer=_both(text.TEXT_LAYER),
    expert={},
    fused={n: (*_both(text.TEXT_FUSED)[n], L + text.TT_FUSED[n]) for n in text.TEXT_FUSED},
    fused_format="transposed",
    fused_formats={L + text.TT_FUSED["gate_up"]: "stacked"},
    notes="Llama 4 vision-language checkpoint: its text decoder under language_model; " + text.NOTES,
    left_out={
        "vision_model.": "vision encoder vision_model.*",
        "multi_modal_projector.": "multi-modal projector multi_modal_projector.*",
    },
)

FAMILY = Family(
    name="llama4",
    layout=LAYOUT,
    fields=text.fields,
    expert_count_keys=("num_local_experts",),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-5,
    default_rope_theta=500000.0,
    decoder_config=text_config,
    torchtitan=text.TORCHTITAN,
)
