"""ERNIE 4.5 MoE (``ernie4_5_moe``) replay against transformers' ``Ernie4_5_MoeForCausalLM``.

The tiny models have RoPE on adjacent pairs (interleaved), a softmax router whose top-k is
chosen on the probabilities plus a real selection bias (stored [1, E]), two ungated shared
experts and a dense first layer. Same checks and tolerances as the other families.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_config  # noqa: E402
from support.oracle import transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.receipts.gate import gate_note  # noqa: E402
from moeaudit.replay import replay  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "two-shared-dense-first": {},
    "no-shared-interval-2-top3": {
        "moe_num_shared_experts": 0,
        "moe_layer_start_index": 0,
        "moe_layer_interval": 2,
        "moe_k": 3,
    },
    "tied-embeddings-end-index": {"tie_word_embeddings": True, "moe_layer_end_index": 1},
}


@pytest.mark.parametrize("case", CASES)
def test_ernie_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    model = save_tiny(tmp_path, "ernie4_5_moe", **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert_agree_deepseek(transformers_observed(load(tmp_path), tokens), observed(ckpt, tokens), ckpt)
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed and routed
    assert ckpt.warnings == [] and ckpt.notes == []
    bias = model.model.layers[routed[0]].mlp.gate.moe_statics.e_score_correction_bias
    assert bias.shape == (1, 8) and bias.abs().min() > 0  # the oracle ran with a real selection bias


def test_the_selection_bias_and_the_pairing_are_what_the_oracle_checks(tmp_path: Path) -> None:
    """Dropping the selection bias, or rotating halves instead of adjacent pairs, changes the
    loss on the same weights: the agreement above pins both."""
    save_tiny(tmp_path, "ernie4_5_moe")
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    nll = replay(ckpt, tokens).nll
    ckpt.spec = ckpt.spec.revised(rope_interleaved=False)
    assert abs(replay(ckpt, tokens).nll - nll) > 1e-4
    ckpt.spec = ckpt.spec.revised(rope_interleaved=True)
    assert replay(ckpt, tokens).nll == nll
    lw = ckpt.layer_weights(1)
    assert lw.params["router_bias"].shape == (8,)


def test_hub_style_config_reads_as_transformers_does() -> None:
    """ERNIE-4.5-21B-A3B's config (no moe_layer_end_index: all layers from the start index)."""
    cfg = {
        "model_type": "ernie4_5_moe",
        "hidden_size": 2560,
        "num_attention_heads": 20,
        "num_key_value_heads": 4,
        "num_hidden_layers": 28,
        "vocab_size": 103424,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "moe_num_experts": 64,
        "moe_num_shared_experts": 2,
        "moe_k": 6,
        "moe_layer_start_index": 1,
        "moe_layer_interval": 1,
        "rope_theta": 500000,
        "rms_norm_eps": 1e-05,
        "use_bias": False,
    }
    s = spec_from_config(cfg)
    assert (s.num_experts, s.top_k, s.expert_dim, s.shared_dim, s.dense_dim) == (64, 6, 1536, 3072, 12288)
    assert s.routed_layers == tuple(range(1, 28)) and s.tie_embeddings and s.rope.interleaved
    assert s.routing == "softmax top-6 of 64, selection bias, renormalised"
    note = gate_note(s)
    assert note is not None and "softmax(W_r y) + b" in note["why"]
    assert "in probability units" in note["changed"][0] and "ρ = softmax(W_r y)" in note["changed"][1]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"use_bias": True}, "moeaudit does not replay use_bias=true for ernie4_5_moe yet"),
        ({"moe_layer_interval": 0}, "moe_layer_interval must be ≥ 1"),
        ({"moe_layer_end_index": "last"}, "'moe_layer_end_index' must be an int"),
        ({"moe_k": 9}, "moe_k=9 not in 1..8"),
    ],
)
def test_bad_ernie_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("ernie4_5_moe").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})
