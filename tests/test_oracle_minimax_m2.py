"""MiniMax-M2 (``minimax_m2``) replay against transformers' ``MiniMaxM2ForCausalLM``.

The tiny models have q/k RMSNorm over all heads, RoPE on part of each head, and a sigmoid
router with a real selection bias (a buffer of the MoE block, saved under Mixtral's
``block_sparse_moe`` names). Same checks and tolerances as the other families; no new math.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_config  # noqa: E402
from support.oracle import assert_identical, fuse_experts, rewrite, transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
CASES: dict[str, dict[str, Any]] = {
    "half-rotary-top2": {},
    "full-rotary-top3-gqa1": {
        "rope_parameters": {**ROPE, "partial_rotary_factor": 1.0},
        "num_experts_per_tok": 3,
        "num_key_value_heads": 1,
    },
    "quarter-rotary-top1": {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.25}, "num_experts_per_tok": 1},
}


@pytest.mark.parametrize("case", CASES)
def test_minimax_m2_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    model = save_tiny(tmp_path, "minimax_m2", **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert_agree_deepseek(transformers_observed(load(tmp_path), tokens), observed(ckpt, tokens), ckpt)
    assert ckpt.spec.routed_layers == (0, 1, 2) and ckpt.warnings == [] and ckpt.notes == []
    assert model.model.layers[0].mlp.e_score_correction_bias.abs().min() > 0  # a real selection bias
    factor = model.config.rope_parameters["partial_rotary_factor"]
    assert ckpt.spec.rope_dim == int(8 * factor)


def test_fused_minimax_m2_experts_replay_bit_identically(tmp_path: Path) -> None:
    save_tiny(tmp_path / "src", "minimax_m2")
    fused = rewrite(tmp_path / "src", tmp_path / "fused", fuse_experts)
    tokens = random_tokens()
    assert Checkpoint(fused).fused and not Checkpoint(tmp_path / "src").fused
    assert_identical(replay(Checkpoint(tmp_path / "src"), tokens), replay(Checkpoint(fused), tokens))


def test_hub_style_config_reads_as_transformers_does() -> None:
    """MiniMax-M2's hub config gives partial RoPE as a legacy top-level ``rotary_dim``."""
    cfg = {
        "model_type": "minimax_m2",
        "hidden_size": 3072,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 62,
        "vocab_size": 200064,
        "intermediate_size": 1536,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "rotary_dim": 64,
        "rope_theta": 5000000,
        "rms_norm_eps": 1e-06,
    }
    s = spec_from_config(cfg)
    assert (s.rope_dim, s.rope.theta, s.settings.qk_norm, s.expert_dim, s.shared_dim) == (64, 5e6, "full", 1536, 0)
    assert s.routing == "sigmoid top-8 of 256, selection bias, renormalised" and s.routed_layers == tuple(range(62))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"rope_parameters": {**ROPE, "partial_rotary_factor": 1.5}}, "partial_rotary_factor must be in"),
        ({"rope_parameters": ROPE, "rotary_dim": 3}, "the rotary part of a head must be even"),
    ],
)
def test_bad_minimax_m2_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("minimax_m2").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})
