"""Further model types against transformers: ``granitemoeshared`` (Granite MoE +
a shared MLP), ``granitemoe_swa`` (+ sliding-window layers, attention sinks, per-layer RoPE bases
with NoPE), ``aria_text`` and the ``aria`` vision-language checkpoint around it (compared with the
wrapper's own forward on text tokens, ``hfmodels.aliases.TextView``), ``mistral4`` (DeepSeek-V3's
MLA decoder with softmax group routing and Llama 4 query scaling), the text decoders of
``qwen3_omni_moe`` (its thinker's), ``deepseek_ocr2`` and ``unlimited_ocr`` (DeepSeek-V2's MoE on
Llama attention) and
``ernie4_5_vl_moe`` (its text expert group), and ``axk1`` (DeepSeek-V3 with a norm on the MoE output).
Each in float32 and from
bfloat16 checkpoints (both sides upcast the same stored values), on two configurations that vary
top-k, the expert count, the shared expert and (where the architecture has them) dense/sparse or
attention-kind placement; same checks and tolerances as ``test_oracle`` (loss, per-window NLL,
hidden states, MoE inputs, router logits, top-k sets off near-ties, combine weights, gradient
norms per expert, router, shared expert and attention), plus the issue's bounds on the worst
differences (NLL ≤ 1e-4 absolute, gradient norms ≤ 2e-3 relative)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import aliases, aliases2, load, random_tokens, save_tiny  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from support.oracle import moeaudit_observed  # noqa: E402
from support.oracle_aliases2 import Modules, agree  # noqa: E402
from support.oracle_deepseek import observed as deepseek_observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import (
    FAMILIES,  # noqa: E402
    spec_from_config,  # noqa: E402
)
from moeaudit.families.ernie4_5_vl_moe import VISION_GROUP  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


GRANITE = Modules(moe="block_sparse_moe", gate="router", shared=("shared_mlp.",))


def rename(src: Path, dst: Path, edit) -> Path:
    """A copy of a saved checkpoint with its tensors renamed (or reshaped) by ``edit``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


# ----- Granite MoE with a shared MLP / sliding windows -----------------------------------------

# every Granite MoE layer is routed (no dense placement to vary); the shared MLP comes and goes
GRANITE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "granitemoeshared-top2-of-4-shared": ("granitemoeshared", {}),
    "granitemoeshared-top3-of-6-no-shared": (
        "granitemoeshared",
        {"num_local_experts": 6, "num_experts_per_tok": 3, "shared_intermediate_size": 0},
    ),
    "granitemoe_swa-default-layer-types-nope-2": ("granitemoe_swa", {}),
    # full attention in the middle, top-1 of 6, no shared MLP, every layer on a RoPE base that
    # differs from the global rope_theta (transformers builds its rotary table from the per-layer one)
    "granitemoe_swa-top1-of-6-full-middle-theta": (
        "granitemoe_swa",
        {
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "num_local_experts": 6,
            "num_experts_per_tok": 1,
            "shared_intermediate_size": 0,
            "layer_rope_theta": [500.0, 500.0, 500.0],
        },
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GRANITE_CASES)
def test_granite_variants_match_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    family, overrides = GRANITE_CASES[case]
    save_tiny(tmp_path, family, dtype=DTYPES[dtype], **overrides)
    ckpt, model = Checkpoint(tmp_path), load(tmp_path)
    assert ckpt.spec.family == family and ckpt.warnings == [] and ckpt.notes == []
    agree(ckpt, model, random_tokens(), GRANITE)
    cfg = model.config
    assert ckpt.spec.shared_dim == cfg.shared_intermediate_size and not ckpt.spec.settings.shared_gated
    if family == "granitemoe_swa":
        assert ckpt.spec.sliding_layers == tuple(i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention")
        assert ckpt.spec.nope_layers == tuple(i for i, t in enumerate(cfg.layer_rope_theta) if not t)
        assert ckpt.spec.settings.attention_sinks and ckpt.spec.sliding_window == 5 < random_tokens().shape[1]


def test_granitemoe_swa_refuses_several_rope_bases() -> None:
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "granitemoe_swa", num_hidden_layers=2, layer_rope_theta=[1e4, 5e5]
    ).to_dict()
    with pytest.raises(CheckpointError, match="several RoPE bases"):
        spec_from_config(cfg)
    spec = spec_from_config({**cfg, "layer_rope_theta": [0, 5e5]})
    assert spec.nope_layers == (0,) and spec.rope.theta == 5e5


# ----- Aria: its text decoder, and the vision-language checkpoint around it ----------------------

ARIA = Modules(gate="router", shared=("mlp.shared_experts.",))
# every Aria layer is routed (no dense placement to vary); the shared experts' count varies
ARIA_CASES: dict[str, dict[str, Any]] = {
    "top2-of-4-two-shared": {},
    "top3-of-6-one-shared-attention-bias": {
        "moe_num_experts": 6,
        "moe_topk": 3,
        "moe_num_shared_experts": 1,
        "attention_bias": True,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ARIA_CASES)
def test_aria_text_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "aria_text", dtype=DTYPES[dtype], **ARIA_CASES[case])
    ckpt, model = Checkpoint(tmp_path), load(tmp_path)
    assert ckpt.spec.family == "aria_text" and ckpt.warnings == [] and ckpt.notes == []
    assert ckpt.fused_format == "transposed"
    agree(ckpt, model, random_tokens(), ARIA)
    assert ckpt.spec.shared_dim == model.config.intermediate_size * model.config.moe_num_shared_experts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ARIA_CASES)
def test_aria_text_decoder_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    aliases2.save_wrapper(tmp_path, "aria", dtype=DTYPES[dtype], **ARIA_CASES[case])
    ckpt, model = Checkpoint(tmp_path), aliases.load_wrapper(tmp_path)
    assert ckpt.spec.family == "aria" and ckpt.warnings == []
    assert ckpt.notes and all("left out" in n for n in ckpt.notes)  # the vision tower and projector
    agree(ckpt, aliases.TextView(model), random_tokens(), ARIA)
    assert "the text decoder" in FAMILIES["aria"].audits


def test_aria_module_names(tmp_path: Path) -> None:
    """transformers 5.24 saves Aria as released (``language_model.model.*``,
    ``language_model.lm_head``, experts ``fc1`` / ``fc2``); the same tensors under its module names
    (``model.language_model.*``, ``lm_head``, ``gate_up_proj`` / ``down_proj``) give the same numbers."""
    aliases2.save_wrapper(tmp_path / "a", "aria")
    a = Checkpoint(tmp_path / "a")
    assert a.layer_keys(0)["router"] == "language_model.model.layers.0.mlp.router.weight"
    assert a.expert_keys(0) == {
        "gate_up": "language_model.model.layers.0.mlp.experts.fc1.weight",
        "down": "language_model.model.layers.0.mlp.experts.fc2.weight",
    }

    names = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("experts.fc1.weight", "experts.gate_up_proj"),
        ("experts.fc2.weight", "experts.down_proj"),
    )

    def module_names(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in t.items():
            for old, new in names:
                k = k.replace(old, new)
            out[k] = v
        return out

    b = Checkpoint(rename(tmp_path / "a", tmp_path / "b", module_names))
    assert b.expert_keys(0) == {
        "gate_up": "model.language_model.layers.0.mlp.experts.gate_up_proj",
        "down": "model.language_model.layers.0.mlp.experts.down_proj",
    }
    tokens = random_tokens()
    ours_a, ours_b = moeaudit_observed(a, tokens), moeaudit_observed(b, tokens)
    assert ours_a.loss == ours_b.loss
    assert all(torch.equal(ours_a.expert_grads[i], ours_b.expert_grads[i]) for i in ours_a.expert_grads)


def test_aria_text_refuses_shared_expert_biases() -> None:
    import transformers

    with pytest.raises(CheckpointError, match="mlp_bias"):
        spec_from_config(transformers.AutoConfig.for_model("aria_text", mlp_bias=True).to_dict())


# ----- Mistral 4: DeepSeek-V3's MLA decoder, softmax group routing, Llama 4 query scaling -----------

MISTRAL4: dict[str, dict[str, Any]] = {
    "grouped-top2-yarn-scaled-queries": {},
    # one group, top-3 of 6, two shared experts, every layer routed, rotate-half RoPE, YaRN without
    # mscale_all_dim, queries scaled from position 8 (β 0.3). (transformers' Mistral 4 runs only
    # with a RoPE type that reads partial_rotary_factor: its default rotary table spans the whole head.)
    "ungrouped-top3-two-shared-all-routed": {
        "n_routed_experts": 6,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 3,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "rope_interleave": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 8,
            "llama_4_scaling_beta": 0.3,
        },
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MISTRAL4)
def test_mistral4_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    aliases2.save_causal(tmp_path, "mistral4", dtype=DTYPES[dtype], **MISTRAL4[case])
    ckpt, model = Checkpoint(tmp_path), aliases2.load_causal(tmp_path, "mistral4")
    assert ckpt.spec.family == "mistral4" and ckpt.warnings == [] and ckpt.notes == []
    agree(ckpt, model, random_tokens(), Modules(shared=("mlp.shared_experts.",)))
    rope = model.config.rope_parameters
    assert ckpt.spec.settings.query_position_scale == (
        rope["llama_4_scaling_beta"],
        rope["original_max_position_embeddings"],
    )


def test_mistral4_query_scaling_changes_the_numbers(tmp_path: Path) -> None:
    """The position scaling is live in the oracle configurations: without it the loss moves."""

    from moeaudit.replay import replay

    aliases2.save_causal(tmp_path, "mistral4")
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    scaled = replay(ckpt, tokens).nll
    ckpt.spec = ckpt.spec.revised(query_position_scale=None)
    assert abs(replay(ckpt, tokens).nll - scaled) > 1e-4


def test_mistral4_without_the_scaling_beta_is_refused() -> None:
    import transformers

    cfg = transformers.AutoConfig.for_model("mistral4").to_dict()
    del cfg["rope_parameters"]["llama_4_scaling_beta"]
    with pytest.raises(CheckpointError, match="llama_4_scaling_beta"):
        spec_from_config(cfg)
    cfg["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1e4,
        "original_max_position_embeddings": 8,
        "llama_4_scaling_beta": 0.1,
    }
    with pytest.raises(CheckpointError, match="rope_type 'default'"):
        spec_from_config(cfg)


# ----- Qwen3-Omni-MoE: the thinker's text decoder ------------------------------------------------

# no shared expert in this architecture; the dense layer and norm_topk_prob move
OMNI: dict[str, dict[str, Any]] = {
    "top2-of-4-renormalised": {},
    "top3-of-6-dense-middle-not-renormalised": {
        "num_experts": 6,
        "num_experts_per_tok": 3,
        "mlp_only_layers": [1],
        "norm_topk_prob": False,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", OMNI)
def test_qwen3_omni_moe_thinker_text_decoder_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    aliases2.save_omni(tmp_path, dtype=DTYPES[dtype], **OMNI[case])
    ckpt, model = Checkpoint(tmp_path), aliases2.load_omni(tmp_path)
    assert ckpt.spec.family == "qwen3_omni_moe" and ckpt.warnings == []
    assert ckpt.notes and all("left out" in n for n in ckpt.notes)  # the audio and vision towers
    assert ckpt.spec.settings.norm_topk_prob == model.config.thinker_config.text_config.norm_topk_prob
    agree(ckpt, aliases2.ThinkerView(model), random_tokens(), Modules())
    assert "thinker's text decoder" in FAMILIES["qwen3_omni_moe"].audits


def test_qwen3_omni_moe_without_thinker_text_config_is_refused() -> None:
    with pytest.raises(CheckpointError, match="thinker_config"):
        spec_from_config({"model_type": "qwen3_omni_moe", "thinker_config": {}})


def test_qwen3_omni_moe_module_names(tmp_path: Path) -> None:
    """transformers 5.24 saves the thinker's decoder as released (``thinker.model.layers.*``); under
    its module names (``thinker.model.language_model.*``) the same tensors give the same numbers."""
    aliases2.save_omni(tmp_path / "a")

    def module_names(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = ("thinker.model.layers.", "thinker.model.embed_tokens.", "thinker.model.norm.")
        return {
            k.replace("thinker.model.", "thinker.model.language_model.", 1) if k.startswith(text) else k: v
            for k, v in t.items()
        }

    a, b = Checkpoint(tmp_path / "a"), Checkpoint(rename(tmp_path / "a", tmp_path / "b", module_names))
    assert b.layer_keys(0)["router"] == "thinker.model.language_model.layers.0.mlp.gate.weight"
    tokens = random_tokens()
    assert moeaudit_observed(a, tokens).loss == moeaudit_observed(b, tokens).loss


# ----- DeepSeek-OCR-2: DeepSeek-V2's MoE on Llama attention ----------------------------------------

OCR2: dict[str, dict[str, Any]] = {
    "group-limited-top2-two-shared-dense-first": {},
    # greedy top-3 of 6, one shared expert, the dense layer in the middle, q/k/v/o biases
    "greedy-top3-of-6-one-shared-dense-middle-bias": {
        "n_routed_experts": 6,
        "num_experts_per_tok": 3,
        "n_shared_experts": 1,
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "mlp_layer_types": ["sparse", "dense", "sparse"],
        "attention_bias": True,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", OCR2)
def test_deepseek_ocr2_text_decoder_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    aliases2.save_ocr2(tmp_path, dtype=DTYPES[dtype], **OCR2[case])
    ckpt, model = Checkpoint(tmp_path), aliases.load_wrapper(tmp_path)
    assert ckpt.spec.family == "deepseek_ocr2" and ckpt.warnings == []
    assert ckpt.notes and all("left out" in n for n in ckpt.notes)  # the vision encoders
    agree(ckpt, aliases.TextView(model), random_tokens(), Modules(shared=("mlp.shared_experts.",)))
    assert "the text decoder" in FAMILIES["deepseek_ocr2"].audits


# Unlimited-OCR: the same decoder; reference-sliding layers (window 5 < the 12-token windows) or full
# attention, mlp_layer_types from first_k_dense_replace. Multi-head attention: transformers' eager
# attention for it does not repeat grouped k/v heads (its module-level eager_attention_forward is the
# vision encoder's), so a GQA config cannot run there
UNLIMITED: dict[str, dict[str, Any]] = {
    "group-limited-reference-sliding-window-5": {
        "sliding_window": 5,
        "mlp_layer_types": None,
        "first_k_dense_replace": 1,
        "num_key_value_heads": 4,
    },
    "greedy-top3-of-6-full-and-reference-layers": {
        **OCR2["greedy-top3-of-6-one-shared-dense-middle-bias"],
        "sliding_window": 3,
        "num_key_value_heads": 4,
        "layer_types": ["full_attention", "reference_sliding_attention", "reference_sliding_attention"],
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", UNLIMITED)
def test_unlimited_ocr_text_decoder_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    aliases2.save_ocr2(tmp_path, dtype=DTYPES[dtype], model_type="unlimited_ocr", **UNLIMITED[case])
    ckpt, model = Checkpoint(tmp_path), aliases.load_wrapper(tmp_path)
    assert ckpt.spec.family == "unlimited_ocr" and ckpt.warnings == []
    assert ckpt.notes and all("left out" in n for n in ckpt.notes)
    assert ckpt.spec.sliding_window is None  # causal over the whole sequence, as transformers computes it
    agree(ckpt, aliases.TextView(model), random_tokens(), Modules(shared=("mlp.shared_experts.",)))


def test_deepseek_ocr2_module_names(tmp_path: Path) -> None:
    """transformers 5.24 saves DeepSeek-OCR-2's decoder as released (``model.layers.*``); under its
    module names (``model.language_model.*``) the same tensors give the same numbers."""
    aliases2.save_ocr2(tmp_path / "a")

    def module_names(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = ("model.layers.", "model.embed_tokens.", "model.norm.")
        return {k.replace("model.", "model.language_model.", 1) if k.startswith(text) else k: v for k, v in t.items()}

    a, b = Checkpoint(tmp_path / "a"), Checkpoint(rename(tmp_path / "a", tmp_path / "b", module_names))
    assert b.layer_keys(1)["router"] == "model.language_model.layers.1.mlp.gate.weight"
    tokens = random_tokens()
    assert deepseek_observed(a, tokens).loss == deepseek_observed(b, tokens).loss


def test_deepseek_ocr2_needs_mlp_layer_types() -> None:
    import transformers

    cfg = transformers.AutoConfig.for_model("deepseek_ocr2", text_config={"num_experts_per_tok": 2}).to_dict()
    with pytest.raises(CheckpointError, match="mlp_layer_types"):
        spec_from_config(cfg)


# ----- A.X-K1: DeepSeek-V3 with an RMSNorm on the MoE output ----------------------------------------

AXK1: dict[str, dict[str, Any]] = {
    "grouped-top2-one-shared-dense-first": {},
    # one group, top-3 of 6, two shared experts, the dense layer in the middle (mlp_layer_types)
    "ungrouped-top3-two-shared-dense-middle": {
        "n_routed_experts": 6,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 3,
        "n_shared_experts": 2,
        "first_k_dense_replace": None,
        "mlp_layer_types": ["sparse", "dense", "sparse"],
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", AXK1)
def test_axk1_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    overrides = {k: v for k, v in AXK1[case].items() if v is not None}
    base = {k: v for k, v in aliases2.TINY["axk1"].items() if k not in AXK1[case] or AXK1[case][k]}
    save_tiny(tmp_path, "axk1", dtype=DTYPES[dtype], **{**base, **overrides})
    ckpt, model = Checkpoint(tmp_path), load(tmp_path)
    assert ckpt.spec.family == "axk1" and ckpt.spec.settings.moe_out_norm and ckpt.warnings == [] and ckpt.notes == []
    agree(ckpt, model, random_tokens(), Modules(shared=("mlp.shared_experts.",)))


def test_axk1_released_layout(tmp_path: Path) -> None:
    """As released: the MoE-output norm at the layer (``post_mlp_layernorm``) and also on the dense
    layer, which does not use it (left out, as transformers ignores it); under transformers'
    module names (``mlp.post_mlp_layernorm``) the same numbers."""
    save_tiny(tmp_path / "a", "axk1")
    a = Checkpoint(tmp_path / "a")
    saved = a.layer_keys(1)["moe_out_norm"]

    def released(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k.replace("mlp.post_mlp_layernorm.", "post_mlp_layernorm."): v for k, v in t.items()}
        out["model.layers.0.post_mlp_layernorm.weight"] = torch.ones_like(t["model.norm.weight"])
        return out

    def modules(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k.replace(".post_mlp_layernorm.", ".mlp.post_mlp_layernorm."): v for k, v in released(t).items()}

    b, c = (Checkpoint(rename(tmp_path / "a", tmp_path / n, f)) for n, f in (("b", released), ("c", modules)))
    assert {b.layer_keys(1)["moe_out_norm"], c.layer_keys(1)["moe_out_norm"]} == {
        "model.layers.1.post_mlp_layernorm.weight",
        "model.layers.1.mlp.post_mlp_layernorm.weight",
    }
    assert saved in (b.layer_keys(1)["moe_out_norm"], c.layer_keys(1)["moe_out_norm"])
    (left,) = b.left_out
    assert left.keys == ("model.layers.0.post_mlp_layernorm.weight",)
    tokens = random_tokens()
    losses = {float(deepseek_observed(x, tokens).loss) for x in (a, b, c)}
    assert len(losses) == 1


# ----- ERNIE 4.5 VL: the text decoder and its text expert group ---------------------------------------

ERNIE_VL: dict[str, dict[str, Any]] = {
    "top2-of-4-one-shared-dense-first": {},
    # top-3 of 6 (vision group 6 × 16), two shared experts, the dense layer in the middle, tied embeddings
    "top3-of-6-two-shared-dense-middle-tied": {
        "moe_num_experts": 6,
        "moe_k": 3,
        "moe_num_shared_experts": 2,
        "mlp_layer_types": ["sparse", "dense", "sparse"],
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ERNIE_VL)
def test_ernie4_5_vl_moe_text_decoder_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    aliases2.save_ernie_vl(tmp_path, dtype=DTYPES[dtype], **ERNIE_VL[case])
    ckpt, model = Checkpoint(tmp_path), aliases.load_wrapper(tmp_path)
    assert ckpt.spec.family == "ernie4_5_vl_moe" and ckpt.warnings == []
    left = {lo.what for lo in ckpt.left_out}
    assert left == {VISION_GROUP, "vision tower", "resampler"}
    agree(ckpt, aliases.TextView(model), random_tokens(), Modules(moe="mlp.text_moe", shared=("mlp.shared_experts.",)))


def test_ernie4_5_vl_moe_module_names(tmp_path: Path) -> None:
    """transformers 5.24 saves ERNIE 4.5 VL as released (transposed routers, one [2, E] bias, one
    expert list); converted to its module names (``model.language_model.*``, ``mlp.text_moe.*`` with
    fused experts, ``mlp.vision_moe.*``) the same model gives the same numbers."""
    aliases2.save_ernie_vl(tmp_path / "a")
    E = int(aliases2.ERNIE_VL_TEXT["moe_num_experts"])  # type: ignore[call-overload]

    def module_names(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, v in t.items():
            if not k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.")):
                out[k] = v
                continue
            k = k.replace("model.", "model.language_model.", 1)
            head, _, rest = k.partition(".mlp.")
            if rest in ("gate.weight", "gate.weight_1"):
                out[f"{head}.mlp.{'vision' if rest.endswith('_1') else 'text'}_moe.gate.weight"] = v.T.contiguous()
            elif rest == "moe_statics.e_score_correction_bias":
                for row, group in enumerate(("text", "vision")):
                    out[f"{head}.mlp.{group}_moe.gate.moe_statics.e_score_correction_bias"] = v[row : row + 1].clone()
            elif rest.startswith("experts.") and rest.endswith("gate_proj.weight"):
                e = int(rest.split(".")[1])
                group, first = ("text", 0) if e < E else ("vision", E)
                if e == first:  # the group's experts fused: gate rows then up rows; down stacked
                    src = head.replace("model.language_model.", "model.", 1) + ".mlp.experts."
                    ids = range(first, first + E)
                    out[f"{head}.mlp.{group}_moe.experts.gate_up_proj"] = torch.stack(
                        [torch.cat([t[f"{src}{i}.gate_proj.weight"], t[f"{src}{i}.up_proj.weight"]]) for i in ids]
                    )
                    out[f"{head}.mlp.{group}_moe.experts.down_proj"] = torch.stack(
                        [t[f"{src}{i}.down_proj.weight"] for i in ids]
                    )
            elif not rest.startswith("experts."):
                out[k] = v
        return out

    a, b = Checkpoint(tmp_path / "a"), Checkpoint(rename(tmp_path / "a", tmp_path / "b", module_names))
    assert (a.fused, b.fused) == (False, True)
    assert b.layer_keys(1)["router"] == "model.language_model.layers.1.mlp.text_moe.gate.weight"
    tokens = random_tokens()
    ours_a, ours_b = moeaudit_observed(a, tokens), moeaudit_observed(b, tokens)
    assert ours_a.loss == ours_b.loss
    assert all(torch.equal(ours_a.expert_grads[i], ours_b.expert_grads[i]) for i in ours_a.expert_grads)
