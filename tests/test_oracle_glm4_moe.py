"""GLM-4.5 (``glm4_moe``) replay against transformers' ``Glm4MoeForCausalLM``.

The tiny models have partial rotary (RoPE on the first part of each head only), q/k/v bias
without an o_proj bias, optional per-head q/k norm, DeepSeek-V3's sigmoid router with a real
selection bias and group-limited top-k, shared experts and a dense first layer. Same checks
and tolerances as the other families (``test_oracle``, ``test_oracle_deepseek``).
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
from moeaudit.replay.model import apply_rope, rope_tables  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "grouped-qknorm-bias": {},
    # GLM-4.5's own settings: one group, no qk norm, no attention bias; a quarter-rotary head
    "one-group-quarter-rotary": {
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": False,
        "attention_bias": False,
        "head_dim": 16,
        "partial_rotary_factor": 0.25,
        "routed_scaling_factor": 1.0,
    },
    "top3-two-shared-no-renorm-full-rotary": {
        "num_experts_per_tok": 3,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "partial_rotary_factor": 1.0,
    },
    "all-routed-top1-group": {"first_k_dense_replace": 0, "topk_group": 1},
}


@pytest.mark.parametrize("case", CASES)
def test_glm4_moe_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    overrides = CASES[case]
    model = save_tiny(tmp_path, "glm4_moe", **overrides)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert_agree_deepseek(transformers_observed(load(tmp_path), tokens), observed(ckpt, tokens), ckpt)
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed
    assert ckpt.warnings == [] and ckpt.notes == []
    bias = model.model.layers[routed[0]].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0  # the oracle ran with a real selection bias
    attn = model.model.layers[0].self_attn
    head_dim = attn.head_dim
    factor = overrides.get("partial_rotary_factor", 0.5)
    assert ckpt.spec.rope_dim == int(head_dim * factor)
    assert ckpt.spec.settings.qk_norm == ("head" if getattr(attn, "use_qk_norm", False) else "none")


def test_fused_glm4_moe_experts_replay_bit_identically(tmp_path: Path) -> None:
    save_tiny(tmp_path / "src", "glm4_moe")
    fused = rewrite(tmp_path / "src", tmp_path / "fused", fuse_experts)
    tokens = random_tokens()
    assert Checkpoint(fused).fused and not Checkpoint(tmp_path / "src").fused
    assert_identical(replay(Checkpoint(tmp_path / "src"), tokens), replay(Checkpoint(fused), tokens))


def test_partial_rope_matches_transformers_apply_rotary_pos_emb() -> None:
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    config = tiny_config("glm4_moe", head_dim=16, partial_rotary_factor=0.25)
    spec = spec_from_config(config.to_dict())
    T = 12
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, T, 16, generator=gen), torch.randn(2, 2, T, 16, generator=gen)
    cos_ref, sin_ref = Glm4MoeRotaryEmbedding(config)(q, torch.arange(T)[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_ref, sin_ref)
    cos, sin = rope_tables(spec, T)
    assert cos.shape == (T, 4)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_ref, rtol=0, atol=1e-6)
    assert torch.equal(apply_rope(q, cos, sin)[..., 4:], q[..., 4:])  # the rest passes through


def test_hub_style_config_reads_as_transformers_does() -> None:
    """GLM-4.5's hub config (v4 style: partial_rotary_factor and rope_theta at the top level)."""
    cfg = {
        "model_type": "glm4_moe",
        "hidden_size": 4096,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 46,
        "vocab_size": 151552,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "partial_rotary_factor": 0.5,
        "rope_theta": 1000000,
        "attention_bias": True,
        "use_qk_norm": False,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-05,
    }
    s = spec_from_config(cfg)
    assert (s.rope_dim, s.head_dim, s.rope.theta, s.rms_eps) == (64, 128, 1e6, 1e-5)
    assert (s.settings.attention_bias, s.settings.o_bias, s.settings.qk_norm, s.mtp_layers) == (True, False, "none", 1)
    assert s.routed_layers == tuple(range(3, 46)) and s.dense_dim == 10944 and s.shared_dim == 1408
    assert s.routing == "sigmoid top-8 of 128, selection bias, renormalised, ×2.5"
    assert s.to_json()["rotary_dim"] == 64 and s.to_json()["o_bias"] is False


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"partial_rotary_factor": 0.0}, "partial_rotary_factor must be in"),
        ({"partial_rotary_factor": "half"}, "partial_rotary_factor must be in"),
        ({"partial_rotary_factor": 0.1}, "the rotary part of a head must be even"),  # int(8·0.1) = 0
        ({"n_group": 3}, "do not split into n_group=3"),
    ],
)
def test_bad_glm4_moe_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("glm4_moe").to_dict()
    cfg.pop("rope_parameters", None)
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})
