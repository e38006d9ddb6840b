"""Qwen3.5-MoE as released: a vision-language checkpoint whose text decoder
(:mod:`moeaudit.families.qwen3_5_moe_text`) is replayed from ``text_config`` and
``model.language_model.*``; the vision encoder ``model.visual.*`` is left out (the canary is
text)."""

from __future__ import annotations

from moeaudit.families import qwen3_5_moe_text as text
from moeaudit.families.base import Family, text_config
from moeaudit.spec.layouts import Layout, Templates

LM = "model.language_model."


def _under_lm(table: dict[str, Templates]) -> dict[str, Templates]:
    return {n: tuple(t.replace("model.", LM, 1) for t in ts) for n, ts in table.items()}


LAYOUT = Layout(
    family="qwen3_5_moe",
    globals={
        "embed": (LM + "embed_tokens.weight",),
        "final_norm": (LM + "norm.weight",),
        "lm_head": ("lm_head.weight",),
    },
    layer=_under_lm(dict(text.LAYOUT.layer)),
    expert=_under_lm(dict(text.LAYOUT.expert)),
    fused=_under_lm(dict(text.LAYOUT.fused)),
    notes="Qwen3.5-MoE vision-language checkpoint: its text decoder under model.language_model; "
    "the vision encoder model.visual.* and mtp.* left out",
    left_out={**text.MTP, "model.visual.": "vision encoder model.visual.*"},
)

FAMILY = Family(
    name="qwen3_5_moe",
    layout=LAYOUT,
    fields=text.fields,
    layers=text.hybrid_layers,
    expert_count_keys=("num_experts",),
    decoder_config=text_config,
)
