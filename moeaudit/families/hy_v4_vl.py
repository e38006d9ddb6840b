"""HY-V4-VL (``hy_v4_vl``, ``HYV4VLForConditionalGeneration``): a vision-language checkpoint
whose text decoder is HY-V4's (:mod:`moeaudit.families.hy_v4`: hyper-connections, MLA with
gate and sinks, DSA, clamped experts), replayed from ``text_config`` (model_type
``hy_v4_vl_text``) and ``model.*`` (what transformers 5.24's ``save_pretrained`` writes: the
released names, which transformers moves under ``model.language_model.`` on load) or
``model.language_model.*`` (its module names); the LM head is ``lm_head``.

The VL text decoder is not HY-V4's line for line; three differences are replayed:

* RoPE on adjacent pairs (ERNIE 4.5's ``apply_rotary_pos_emb``: cos/sin of the first half of the
  frequencies repeated pairwise, output left interleaved) in the attention and in the DSA
  indexer; the replay rotates the same pairs by the same angles and de-interleaves its output,
  the same permutation on queries and keys, so every score q·k is the same
  (``MLA.rope_interleave``, ``index_rope_interleave``);
* the query- and kv-latent RMSNorms at ``rms_norm_eps`` (HY-V4's at a fixed 1e-6):
  ``mla_norm_eps``;
* its multimodal RoPE (``mrope_section``, interleaved as Qwen3-VL's) gives every frequency the same
  position on text tokens: plain RoPE there.

The vision tower (``vit.*``, ``model.vision_tower.*``) is left out (the canary is text)."""

from __future__ import annotations

import dataclasses
from typing import Any

from moeaudit.families import hy_v4
from moeaudit.families._wrap import wrapped
from moeaudit.families.base import Ctx, text_config
from moeaudit.spec.config import MLA


def _mla(c: Ctx) -> MLA:
    read = hy_v4.FAMILY.mla
    assert read is not None
    return dataclasses.replace(read(c), rope_interleave=True)


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        **hy_v4.FAMILY.fields(c),
        "index_rope_interleave": True,
        "mla_norm_eps": c.get("rms_norm_eps", float, 1e-5),
    }


_WRAPPED = wrapped(
    hy_v4.FAMILY,
    "hy_v4_vl",
    bases=("model.", "model.language_model."),
    heads=("lm_head.weight",),
    audits="the text decoder (hy_v4 with adjacent-pair RoPE and latent norms at rms_norm_eps) of the HY-V4-VL "
    "vision-language model",
    left_out={
        "model.language_model.mtp_layers.": "multi-token-prediction layers",
        "vit.": "vision tower",
        "model.vision_tower.": "vision tower",
    },
    decoder_config=text_config,
    mla=_mla,
    fields=_fields,
)
_LAY = _WRAPPED.layout
# transformers' save_pretrained reverts the hyper head's renaming in the other order than HY-V4's
# (``model.hc_head.hc_pre.hc_head_fn``); both spellings load to ``model.hc_head.hc_fn``
_HEAD = {
    f"hc_head_{n}": (*_LAY.globals[f"hc_head_{n}"], f"model.hc_head.hc_pre.hc_head_{n}")
    for n in ("fn", "base", "scale")
}

FAMILY = dataclasses.replace(_WRAPPED, layout=dataclasses.replace(_LAY, globals={**_LAY.globals, **_HEAD}))
