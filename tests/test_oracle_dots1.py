"""dots.llm1 (``dots1``) replay against transformers' ``Dots1ForCausalLM``.

The tiny models have Qwen3-style attention (per-head q/k RMSNorm) with bias on all four
projections, DeepSeek-V3's sigmoid router with a real selection bias and group-limited top-k,
a shared expert, a dense first layer and a sliding window on the ``layer_types`` layers. Same
checks and tolerances as the other families (``test_oracle``, ``test_oracle_deepseek``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_config  # noqa: E402
from support.oracle import assert_identical, fuse_experts, rewrite, transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "grouped-bias-sliding-last": {},
    # dots.llm1's own settings: one group, no bias, no renormalisation, no sliding layer
    "one-group-no-bias-no-renorm": {
        "n_group": 1,
        "topk_group": 1,
        "attention_bias": False,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "max_window_layers": 3,
    },
    "top3-two-shared-all-routed-all-sliding": {
        "num_experts_per_tok": 3,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "max_window_layers": 0,
    },
}


@pytest.mark.parametrize("case", CASES)
def test_dots1_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    model = save_tiny(tmp_path, "dots1", **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert_agree_deepseek(transformers_observed(load(tmp_path), tokens), observed(ckpt, tokens), ckpt)
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed
    sliding = tuple(i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention")
    assert ckpt.spec.sliding_layers == sliding
    assert ckpt.warnings == [] and ckpt.notes == []
    bias = model.model.layers[routed[0]].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0  # the oracle ran with a real selection bias


def test_the_sliding_window_changes_the_loss(tmp_path: Path) -> None:
    """The window (5 tokens, T = 12) is in force on the sliding layers: without it the
    transformers model's loss differs, so the agreement above tests the window too."""
    tokens = random_tokens()
    windowed = save_tiny(tmp_path / "sliding", "dots1")
    unwindowed = save_tiny(tmp_path / "full", "dots1", max_window_layers=3)  # same weights
    assert Checkpoint(tmp_path / "sliding").spec.sliding_layers == (2,)
    assert Checkpoint(tmp_path / "full").spec.sliding_layers == ()
    with torch.no_grad():
        loss_w = windowed(input_ids=tokens, labels=tokens).loss
        loss_f = unwindowed(input_ids=tokens, labels=tokens).loss
    assert abs(float(loss_w) - float(loss_f)) > 1e-4


def test_fused_dots1_experts_replay_bit_identically(tmp_path: Path) -> None:
    save_tiny(tmp_path / "src", "dots1")
    fused = rewrite(tmp_path / "src", tmp_path / "fused", fuse_experts)
    tokens = random_tokens()
    assert Checkpoint(fused).fused and not Checkpoint(tmp_path / "src").fused
    assert_identical(replay(Checkpoint(tmp_path / "src"), tokens), replay(Checkpoint(fused), tokens))


def test_hub_style_config_reads_as_transformers_does() -> None:
    """dots.llm1's hub config: no layer_types, max_window_layers = the layer count (no window)."""
    cfg = {
        "model_type": "dots1",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 62,
        "vocab_size": 152064,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "sliding_window": None,
        "max_window_layers": 62,
        "rope_theta": 10000000,
        "attention_bias": False,
        "rms_norm_eps": 1e-05,
    }
    s = spec_from_config(cfg)
    assert (s.head_dim, s.rope.theta, s.rms_eps, s.settings.qk_norm) == (128, 1e7, 1e-5, "head")
    assert s.routed_layers == tuple(range(1, 62)) and s.dense_dim == 10944 and s.shared_dim == 2816
    assert s.sliding_layers == () and s.sliding_window is None and not s.settings.shared_gated
    assert s.routing == "sigmoid top-6 of 128, selection bias, renormalised, ×2.5"


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"n_group": 3}, "do not split into n_group=3"),
        ({"layer_types": ["full_attention"]}, "layer_types must list 3 layers"),
    ],
)
def test_bad_dots1_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("dots1").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})
