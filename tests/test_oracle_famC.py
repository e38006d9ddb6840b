"""DeepSeek-V3.2, Qwen3-Next and Qwen3.5-MoE replay against transformers, same
checks and tolerances as ``test_oracle`` / ``test_oracle_deepseek``.

DeepSeek-V3.2's tiny model keeps index_topk=5 below the window length T=12, so the DSA
indexer's key selection changes the attention of every query past the fifth. With one indexer
head, half the scores are ReLU's exact zeros and the probe's cuts tie: there transformers'
top-k breaks the ties by position as the replay does (``support.indexer_ties``); the other
cases meet no tie (asserted) and are compared with transformers as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import famc, load, random_tokens, save_tiny  # noqa: E402
from support.indexer_ties import watch_indexers  # noqa: E402
from support.oracle import (  # noqa: E402
    FORWARD,
    GRADIENT,
    assert_agree,
    moeaudit_observed,
    transformers_observed,
)
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_famC import _attention_grads_with_linear_layers  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402

V32: dict[str, dict[str, Any]] = {
    "v32-sparse": {},
    "v32-dense-when-the-window-fits": {"index_topk": 16},
    "v32-top1-indexer-one-head": {"index_topk": 1, "index_n_heads": 1},
    "v32-yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16,
        }
    },
}
TIED_V32 = ("v32-top1-indexer-one-head",)  # the cases whose indexer cuts tie


@pytest.mark.parametrize("case", V32)
def test_deepseek_v32_replay_matches_transformers(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ties = watch_indexers(monkeypatch, by_position=case in TIED_V32)
    save_tiny(tmp_path, "deepseek_v32", **V32[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert ckpt.spec.family == "deepseek_v32" and ckpt.spec.routed_layers == (1, 2)
    assert_agree_deepseek(transformers_observed(load(tmp_path), tokens), observed(ckpt, tokens), ckpt)
    assert ties.calls > 0 and (ties.tied_cuts > 0) == (case in TIED_V32)
    assert ckpt.warnings == [] and ckpt.notes == []


def test_the_indexer_changes_the_loss_when_it_selects(tmp_path: Path) -> None:
    """Same weights, index_topk 5 vs 16 (≥ T): a different loss, so the oracle above could
    not pass with the indexer ignored."""
    from moeaudit.replay import replay

    save_tiny(tmp_path / "a", "deepseek_v32")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "b").mkdir()
    for f in (tmp_path / "a").iterdir():
        (tmp_path / "b" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "b" / "config.json").write_text(json.dumps({**cfg, "index_topk": 16}))
    tokens = random_tokens()
    sparse, dense = replay(Checkpoint(tmp_path / "a"), tokens), replay(Checkpoint(tmp_path / "b"), tokens)
    assert abs(sparse.nll - dense.nll) > 1e-3


def test_deepseek_v32_config_defaults_match_transformers() -> None:
    import transformers

    spec = spec_from_config(transformers.AutoConfig.for_model("deepseek_v32").to_dict())
    assert spec.mla is not None and spec.mla.rope_interleave and spec.mla.q_lora_rank == 1536
    assert (spec.num_experts, spec.top_k, spec.gate.n_group, spec.gate.topk_group) == (256, 8, 8, 4)
    assert spec.routed_layers[0] == 3 and spec.gate.selection_bias
    assert spec.sparse_index is not None
    assert (spec.sparse_index.topk, spec.sparse_index.n_heads, spec.sparse_index.head_dim) == (2048, 64, 128)


def test_deepseek_v32_without_a_query_latent_is_refused() -> None:
    import transformers

    cfg = transformers.AutoConfig.for_model("deepseek_v32").to_dict()
    with pytest.raises(CheckpointError, match="q_lora_rank"):
        spec_from_config({**cfg, "q_lora_rank": None})


# ----- Qwen3-Next: gated DeltaNet + gated full attention, zero-centred norms ------------------

NEXT: dict[str, dict[str, Any]] = {
    "next": {},  # layers: linear, full, linear; all routed
    "next-dense-layer-no-renorm": {"mlp_only_layers": [0], "norm_topk_prob": False},
    "next-attention-bias": {"attention_bias": True},
    "next-equal-heads-full-rotary": {
        "linear_num_value_heads": 2,
        "partial_rotary_factor": 1.0,
        "layer_types": ["full_attention", "linear_attention", "linear_attention"],
    },
}


@pytest.mark.parametrize("case", NEXT)
def test_qwen3_next_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "qwen3_next", **NEXT[case])
    ckpt = Checkpoint(tmp_path)
    model = load(tmp_path)
    tokens = random_tokens()
    ref = transformers_observed(model, tokens)
    attention = _attention_grads_with_linear_layers(model)
    ref.attention_grads = {i: attention[i] for i in ref.attention_grads}
    assert_agree(ref, moeaudit_observed(ckpt, tokens), ckpt.spec.top_k, FORWARD, GRADIENT)
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed and ckpt.warnings == []
    types = model.config.layer_types
    assert ckpt.spec.linear_layers == tuple(i for i, t in enumerate(types) if t == "linear_attention")


def test_qwen3_next_config_defaults_match_transformers() -> None:
    import transformers

    spec = spec_from_config(transformers.AutoConfig.for_model("qwen3_next").to_dict())
    assert (spec.num_experts, spec.top_k, spec.settings.norm_topk_prob, spec.head_dim) == (512, 10, True, 256)
    assert spec.rope.rotary_dim == 64 and spec.norm_offset == 1.0 and spec.settings.gated_attention
    assert spec.linear_layers == tuple(i for i in range(48) if (i + 1) % 4)
    la = spec.settings.linear_attention
    assert la is not None and (la.num_k_heads, la.num_v_heads, la.k_dim, la.v_dim, la.conv_kernel) == (
        16,
        32,
        128,
        128,
        4,
    )


def test_qwen3_next_mtp_module_is_noted_and_changes_nothing(tmp_path: Path) -> None:
    """Released Qwen3-Next checkpoints carry the MTP module as top-level ``mtp.*`` tensors."""
    from safetensors.torch import load_file, save_file

    from moeaudit.replay import replay

    save_tiny(tmp_path / "a", "qwen3_next")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(32, 64)
    tensors["mtp.norm.weight"] = torch.zeros(32)
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    base, ckpt = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    assert ckpt.warnings == [] and len(ckpt.notes) == 1 and "mtp.* (2 tensors) left out" in ckpt.notes[0]
    tokens = random_tokens()
    assert replay(base, tokens).nll == replay(ckpt, tokens).nll


@pytest.mark.parametrize("overrides", [{}, {"linear_num_value_heads": 2}], ids=["grouped-v", "equal"])
def test_qwen3_5_moe_text_replay_matches_transformers(overrides: dict, tmp_path: Path) -> None:
    save_tiny(tmp_path, "qwen3_5_moe_text", **overrides)
    ckpt = Checkpoint(tmp_path)
    model = load(tmp_path)
    tokens = random_tokens()
    ref = transformers_observed(model, tokens)
    attention = _attention_grads_with_linear_layers(model)
    ref.attention_grads = {i: attention[i] for i in ref.attention_grads}
    assert_agree(ref, moeaudit_observed(ckpt, tokens), ckpt.spec.top_k, FORWARD, GRADIENT)
    assert ckpt.spec.routed_layers == (0, 1, 2) and ckpt.spec.settings.norm_topk_prob
    assert ckpt.spec.linear_layers == (0, 2) and ckpt.warnings == []


def test_qwen3_5_moe_vision_language_checkpoint_replays_its_text_decoder(tmp_path: Path) -> None:
    """The released Qwen3.5-MoE checkpoints are vision-language: the text decoder lives under
    ``model.language_model`` with its config in ``text_config``; the vision tower is noted."""
    import torch.nn.functional as F

    from moeaudit.replay import replay

    model = famc.save_tiny_qwen3_5_moe(tmp_path)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.family == "qwen3_5_moe" and ckpt.spec.linear_layers == (0, 2)
    assert ckpt.warnings == [] and len(ckpt.notes) == 1 and "model.visual.*" in ckpt.notes[0]
    tokens = random_tokens()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none").view(
        tokens.shape[0], -1
    )
    result = replay(ckpt, tokens)
    torch.testing.assert_close(result.nll_windows_W, nll.mean(1), **FORWARD)
    assert result.nll == pytest.approx(float(nll.mean()), rel=1e-4)


def test_qwen3_5_moe_without_a_text_config_is_refused() -> None:
    with pytest.raises(CheckpointError, match="text_config"):
        spec_from_config({"model_type": "qwen3_5_moe", "vision_config": {}})


@pytest.mark.parametrize("family", ["deepseek_v32", "qwen3_next"])
def test_a_non_silu_activation_is_refused_naming_the_family(family: str) -> None:
    import transformers

    cfg = transformers.AutoConfig.for_model(family).to_dict()
    with pytest.raises(CheckpointError, match=f"model family '{family}' with hidden_act 'gelu'"):
        spec_from_config({**cfg, "hidden_act": "gelu"})
