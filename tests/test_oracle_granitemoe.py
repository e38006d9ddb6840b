"""Granite MoE (``granitemoe``) replay against transformers' ``GraniteMoeForCausalLM``.

The tiny models carry Granite-3.0-1B-A400M's four multipliers (embeddings × 12, attention scale
1/64, residual branches × 0.22, logits ÷ 6), so each one changes the numbers; the experts are
stored fused (``input_linear``/``output_linear``) and the router is ``router.layer``. Same
checks and tolerances as the other families.
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
from moeaudit.replay import replay  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "granite-3.0-multipliers": {},
    "top1-gqa1-tied": {"num_experts_per_tok": 1, "num_key_value_heads": 1, "tie_word_embeddings": True},
    "unit-multipliers": {
        "embedding_multiplier": 1.0,
        "attention_multiplier": 8**-0.5,  # 1/√head_dim
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
    },
}


@pytest.mark.parametrize("case", CASES)
def test_granitemoe_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "granitemoe", **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    want = transformers_observed(load(tmp_path), tokens, moe="block_sparse_moe", gate="router")
    assert_agree_deepseek(want, observed(ckpt, tokens), ckpt)
    assert ckpt.fused and ckpt.spec.routed_layers == (0, 1, 2) and ckpt.warnings == [] and ckpt.notes == []


@pytest.mark.parametrize("name", ["embedding_multiplier", "attention_scale", "residual_multiplier", "logits_scaling"])
def test_each_multiplier_is_what_the_oracle_checks(name: str, tmp_path: Path) -> None:
    """Setting any one multiplier back to its default changes the NLL on the same
    weights, so the agreement above pins each of them."""
    save_tiny(tmp_path, "granitemoe")
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    ref = replay(ckpt, tokens)
    ckpt.spec = ckpt.spec.revised(**{name: None if name == "attention_scale" else 1.0})
    other = replay(ckpt, tokens)
    assert abs(other.nll - ref.nll) > 1e-4


def test_hub_style_config_reads_as_transformers_does() -> None:
    """granite-3.0-1b-a400m-base's config."""
    cfg = {
        "model_type": "granitemoe",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_hidden_layers": 24,
        "vocab_size": 49155,
        "intermediate_size": 512,
        "num_local_experts": 32,
        "num_experts_per_tok": 8,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.015625,
        "residual_multiplier": 0.22,
        "logits_scaling": 6.0,
        "rope_theta": 10000,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
    }
    s = spec_from_config(cfg)
    assert (s.embedding_multiplier, s.attention_scale, s.settings.residual_multiplier, s.logits_scaling) == (
        12,
        1 / 64,
        0.22,
        6,
    )
    assert s.routing == "softmax top-8 of 32, renormalised" and s.expert_dim == 512 and s.tie_embeddings


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"logits_scaling": 0.0}, "logits_scaling must be positive"),
        ({"residual_multiplier": -1.0}, "residual_multiplier must be positive"),
        ({"attention_multiplier": "auto"}, "'attention_multiplier' must be a finite number"),
    ],
)
def test_bad_granitemoe_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("granitemoe").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})
