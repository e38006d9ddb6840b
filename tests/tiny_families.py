"""A tiny saved checkpoint of every registered family, the vision-language wrappers included
(``llama4``, ``qwen3_5_moe``: their text decoder as in ``hf_models`` plus a one-block vision
tower), for tests that must cover every family (issue 31: device branch, determinism guard).
Importing this module needs transformers."""

from __future__ import annotations

from pathlib import Path

import hf_models_afmoe  # noqa: F401  (issue 27: AFMoE)
import hf_models_aliases2  # issue 27: wrappers, relabelled types, later aliases
import hf_models_famC
import hf_models_famD  # noqa: F401  (issue 27 §2 routed designs)
import hf_models_famE  # noqa: F401  (issue 27 §2 newer routed designs)
import hf_models_flex_olmo  # noqa: F401  (issue 27: FlexOlmo, post-norms)
import hf_models_hy_v4  # noqa: F401  (issue 27: HY-V4)
import hf_models_jetmoe  # noqa: F401  (issue 27: JetMoE)
import hf_models_kda  # noqa: F401  (issue 27: Kimi Linear)
import hf_models_longcat  # noqa: F401  (issue 27: LongCat-Flash)
import hf_models_mamba  # noqa: F401  (issue 27 §3 Mamba hybrids)
import hf_models_mimo  # noqa: F401  (issue 27: MiMo-V2-Flash)
import hf_models_more  # noqa: F401  (issue 27: Flint, Mellum, Lara-Mini)
import hf_models_nemotron  # noqa: F401  (issue 27 §3 Nemotron-H)
import hf_models_step  # noqa: F401  (issue 27: Step 3.5 and Step-3.7, saved through hf_models_wrap)
import hf_models_wrap  # issue 27: wrappers around Nemotron-H and HY-V4
import torch
import transformers
from hf_models import _redraw, save_tiny, tiny_config

from moeaudit.families import FAMILIES

ALL = tuple(FAMILIES)
VOCAB = 96  # hf_models.VOCAB


def save_any(path: Path, family: str) -> Path:
    """Save a tiny seeded checkpoint of ``family`` at ``path``; return ``path``."""
    if family == "qwen3_5_moe":
        hf_models_famC.save_tiny_qwen3_5_moe(path)
    elif family == "llama4":
        _save_llama4(path)
    elif family == "longcat_flash":  # its sub-block norm gains drawn near 1, not as biases
        hf_models_longcat.save_longcat(path)
    elif hf_models_aliases2.save_any(path, family):
        pass
    elif hf_models_wrap.save_any(path, family):
        pass
    else:
        save_tiny(path, family)
    return path


def _save_llama4(path: Path) -> None:
    """Llama4ForConditionalGeneration as Scout and Maverick are released (tests/test_oracle_llama4)."""
    text = tiny_config("llama4_text").to_dict()
    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        image_size=28,
        patch_size=14,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).float()
    _redraw(model, 0)
    model.save_pretrained(path)
