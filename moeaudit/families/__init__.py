"""The model families moeaudit replays, one module each, discovered at import.

Adding a family is adding ``moeaudit/families/<model_type>.py`` with ``FAMILY = Family(...)``
(see :mod:`moeaudit.families.base` and ``docs/families.md``). ``REFUSED`` names the MoE
architectures we know and cannot replay faithfully, each with its reason; a family file for a
model type listed there takes precedence (the entry is then stale and ignored).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Family

_NOT_FAMILIES = {"base"}
# the families that predate the registry keep their order (hints, hooks' layout search); new
# ones follow alphabetically
_FIRST = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2")


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in _NOT_FAMILIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        fam = getattr(module, "FAMILY", None)
        if not isinstance(fam, Family):
            raise TypeError(f"{module.__name__} defines no FAMILY = Family(...)")
        if fam.name != info.name or fam.layout.family != info.name:
            raise TypeError(f"{module.__name__}: FAMILY name {fam.name!r} differs from its file name")
        found[fam.name] = fam
    order = sorted(found, key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n))
    return {n: found[n] for n in order}


FAMILIES: dict[str, Family] = _discover()

# model_type → why it cannot be replayed (one line). Text-only checkpoints of the vision-language
# models may be accepted later, as their text decoder's family.
_REFUSED_ALL: dict[str, str] = {
    "jamba": "its Mamba (state-space) layers are not replayed",
    "granitemoehybrid": "its Mamba (state-space) layers are not replayed",
    "granitemoeshared": "not supported yet (shared-expert Granite MoE)",
    "nemotron_h": "its Mamba (state-space) layers are not replayed",
    "falcon_h1": "its Mamba (state-space) layers are not replayed",
    "bamba": "its Mamba (state-space) layers are not replayed",
    "qwen3_vl_moe": "a vision-language model: its vision tower is not replayed",
    "glm4v_moe": "a vision-language model: its vision tower is not replayed",
    "qwen3_omni_moe": "a multimodal model: its audio and vision towers are not replayed",
    "qwen2_5_omni": "a multimodal model: its audio and vision towers are not replayed",
    "deepseek_vl_v2": "a vision-language model: its vision tower is not replayed",
    "kimi_vl": "a vision-language model: its vision tower is not replayed",
    "aria": "a vision-language model: its vision tower is not replayed",
    "switch_transformers": "an encoder-decoder model (T5 layout); moeaudit replays decoders",
    "nllb_moe": "an encoder-decoder translation model; moeaudit replays decoders",
    "gptsan-japanese": "a prefix-LM encoder-decoder; moeaudit replays decoders",
    "dbrx": "not supported yet (fused Wqkv, clip_qkv, LayerNorm without bias)",
    "jetmoe": "not supported yet (mixture of attention heads)",
    "flex_olmo": "not supported yet",
    "longcat_flash": "not supported yet (zero-compute experts, shortcut-connected MoE)",
    "bailing_moe": "not supported yet",
    "bailing_moe_v2": "not supported yet",
    "afmoe": "not supported yet",
    "lfm2_moe": "not supported yet (short convolution layers)",
    "ernie4_5_vl_moe": "a vision-language model: its vision tower is not replayed",
    "minimax": "not supported yet (lightning linear attention)",
    "qwen2_moe_vl": "a vision-language model: its vision tower is not replayed",
}
REFUSED: dict[str, str] = {k: v for k, v in _REFUSED_ALL.items() if k not in FAMILIES}


def family_of(model_type: object, path: Path | str = "config.json") -> Family:
    """The registered family of a ``model_type``; a refused one or an unknown one is a
    CheckpointError saying which."""
    if isinstance(model_type, str) and model_type in FAMILIES:
        return FAMILIES[model_type]
    if isinstance(model_type, str) and model_type in REFUSED:
        raise CheckpointError(f"model family {model_type!r} cannot be replayed: {REFUSED[model_type]}",
                              path=path, hint=f"supported: {', '.join(FAMILIES)}")
    raise CheckpointError(f"unknown model family {model_type!r}", path=path,
                          hint=f"supported: {', '.join(FAMILIES)}")


__all__ = ["FAMILIES", "REFUSED", "Family", "family_of"]
