"""Model types replayed as another family's decoder (docs/decisions.md, "The registry, and which model types
count as MoE") against transformers: the
vision-language wrappers ``kimi_k25`` (DeepSeek-V3 text decoder), ``qwen3_vl_moe`` (Qwen3-MoE),
``glm4v_moe`` (GLM-4.5 MoE, multimodal RoPE), compared with the wrapper's own forward on text
tokens (``hfmodels.aliases.TextView``); ``glm4_moe_lite`` (MLA + GLM's router) against
``Glm4MoeLiteForCausalLM``; ``kimi_k2`` (a relabelled DeepSeek-V3 config) against
``DeepseekV3ForCausalLM``. Each in float32 and bfloat16, two configurations that vary top-k, the
expert count, shared experts and dense/sparse placement; same checks and tolerances as the other
families (``test_oracle_deepseek.assert_agree_deepseek``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import aliases, load, random_tokens, save_tiny  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from support.oracle import transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

# wrapper → configuration name → text_config overrides
WRAPPERS: dict[str, dict[str, dict[str, Any]]] = {
    # 8 experts in 4 groups (best 2), top-2, one shared expert, a dense first layer
    "kimi_k25": {
        "grouped": {},
        "top3-two-shared-all-routed": {
            "n_routed_experts": 6,
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 3,
            "n_shared_experts": 2,
            "first_k_dense_replace": 0,
        },
    },
    # no shared expert in this architecture; the dense layer moves
    "qwen3_vl_moe": {
        "top2-of-4": {},
        "top3-of-6-dense-middle": {"num_experts": 6, "num_experts_per_tok": 3, "mlp_only_layers": [1]},
    },
    "glm4v_moe": {
        "grouped": {},
        "top3-two-shared-all-routed": {
            "n_routed_experts": 6,
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 3,
            "n_shared_experts": 2,
            "first_k_dense_replace": 0,
        },
    },
}
CASES = [(w, c) for w, cs in WRAPPERS.items() for c in cs]
TEXT_ONLY: dict[str, tuple[str, str, dict[str, Any]]] = {  # name → (family saved, model_type read, overrides)
    "glm4_moe_lite-one-group": ("glm4_moe_lite", "glm4_moe_lite", {}),
    "glm4_moe_lite-layer-types-top3-grouped": (
        "glm4_moe_lite",
        "glm4_moe_lite",
        {
            "mlp_layer_types": ["sparse", "dense", "sparse"],
            "num_experts_per_tok": 3,
            "n_shared_experts": 2,
            "n_group": 4,
            "topk_group": 2,
        },
    ),
    "kimi_k2": ("deepseek_v3", "kimi_k2", {}),
    "kimi_k2-top1-ungrouped": (
        "deepseek_v3",
        "kimi_k2",
        {"n_routed_experts": 6, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 1, "first_k_dense_replace": 2},
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wrapper, case", CASES, ids=[f"{w}-{c}" for w, c in CASES])
def test_wrapper_text_decoder_matches_transformers(wrapper: str, case: str, dtype: str, tmp_path: Path) -> None:
    aliases.save_wrapper(tmp_path, wrapper, dtype=DTYPES[dtype], **WRAPPERS[wrapper][case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = aliases.load_wrapper(tmp_path)
    assert ckpt.spec.family == wrapper and ckpt.warnings == []
    assert ckpt.notes and all("left out" in n for n in ckpt.notes)  # the towers, named
    assert_agree_deepseek(transformers_observed(aliases.TextView(model), tokens), observed(ckpt, tokens), ckpt)
    routed = tuple(i for i, layer in enumerate(model.model.language_model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TEXT_ONLY)
def test_relabelled_text_model_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    family, model_type, overrides = TEXT_ONLY[case]
    save_tiny(tmp_path, family, dtype=DTYPES[dtype], **overrides)
    model = load(tmp_path)  # transformers reads it as saved (kimi_k2: as deepseek_v3)
    if model_type != family:
        aliases.relabel(tmp_path, model_type)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert ckpt.spec.family == model_type and ckpt.warnings == [] and ckpt.notes == []
    assert_agree_deepseek(transformers_observed(model, tokens), observed(ckpt, tokens), ckpt)
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed


def _rename(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_qwen3_vl_moe_released_layout_transposed_experts(tmp_path: Path, one_thread: None) -> None:
    """The released Qwen3-VL-MoE files store the experts [E, H, 2I] / [E, I, H]: the same numbers."""
    aliases.save_wrapper(tmp_path / "a", "qwen3_vl_moe")

    def transpose(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            k: v.transpose(1, 2).contiguous() if k.endswith(("gate_up_proj", "down_proj")) and ".experts." in k else v
            for k, v in t.items()
        }

    hub = _rename(tmp_path / "a", tmp_path / "b", transpose)
    a, b = Checkpoint(tmp_path / "a"), Checkpoint(hub)
    assert (a.fused_format, b.fused_format) == ("stacked", "transposed")
    tokens = random_tokens()
    ours_a, ours_b = observed(a, tokens), observed(b, tokens)
    assert ours_a.loss == ours_b.loss
    for i in ours_a.expert_grads:
        assert torch.equal(ours_a.expert_grads[i], ours_b.expert_grads[i])


def test_kimi_k25_released_names(tmp_path: Path) -> None:
    """Kimi-K2.5 as released: ``language_model.model.layers.*`` and ``language_model.lm_head``
    (transformers 5.24 saves ``blocks``): the same numbers."""
    aliases.save_wrapper(tmp_path / "a", "kimi_k25")

    def released(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in t.items()}

    b = Checkpoint(_rename(tmp_path / "a", tmp_path / "b", released))
    assert b.layer_keys(1)["router"] == "language_model.model.layers.1.mlp.gate.weight"
    tokens = random_tokens()
    assert observed(Checkpoint(tmp_path / "a"), tokens).loss == observed(b, tokens).loss


def test_wrapper_receipts_say_the_text_decoder_is_audited(tmp_path: Path) -> None:
    """The receipts name the wrapper as the family and list the towers left out, saying that the
    text decoder's next-token prediction is what was replayed."""
    from moeaudit.canary import Canary
    from moeaudit.families import FAMILIES
    from moeaudit.receipts.state import state_receipts

    for name in ("kimi_k25", "qwen3_vl_moe", "glm4v_moe"):
        fam = FAMILIES[name]
        assert "the text decoder" in fam.audits and fam.layout.notes.startswith("the text decoder")
    aliases.save_wrapper(tmp_path, "qwen3_vl_moe")
    tokens = random_tokens(windows=2, length=12).int()
    doc = state_receipts(Checkpoint(tmp_path), Canary(tokens, torch.zeros(2, dtype=torch.int32), ("d",)))
    section = doc["checkpoint"]
    assert section["family"] == "qwen3_vl_moe"
    (tower,) = section["left_out"]
    assert "model.visual" in json.dumps(tower) and "text decoder" in json.dumps(tower)


def test_glm4_moe_lite_released_config_reads_as_transformers_does() -> None:
    import transformers

    spec = spec_from_config(transformers.AutoConfig.for_model("glm4_moe_lite").to_dict())
    assert spec.mla is not None and spec.mla.rope_interleave and spec.mla.q_lora_rank == 768
    assert (spec.num_experts, spec.top_k, spec.gate.n_group, spec.gate.scaling) == (64, 4, 1, 1.8)
    assert spec.routed_layers == tuple(range(1, 47)) and spec.rms_eps == 1e-5
    with pytest.raises(CheckpointError, match="mlp_layer_types"):
        spec_from_config({**transformers.AutoConfig.for_model("glm4_moe_lite").to_dict(), "mlp_layer_types": ["moe"]})


def test_wrapper_without_text_config_is_refused() -> None:
    for name in ("kimi_k25", "qwen3_vl_moe", "glm4v_moe"):
        with pytest.raises(CheckpointError, match="text_config"):
            spec_from_config({"model_type": name, "vision_config": {}})
