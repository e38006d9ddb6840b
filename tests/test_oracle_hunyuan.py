"""Hunyuan-MoE v1 (``hunyuan_v1_moe``) replay against transformers' ``HunYuanMoEV1ForCausalLM``.

The tiny models have q/k RMSNorm per head applied after RoPE (the one new piece of math), bias
on all four attention projections, softmax top-k renormalised and an ungated shared MLP. Same
checks and tolerances as the other families; the shared MLP's gradient norm is taken from
``mlp.shared_mlp`` (transformers' name here) instead of ``mlp.shared_expert``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_config  # noqa: E402
from support.oracle import _norm, transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "bias-top2": {},
    "no-bias-top1-gqa": {"attention_bias": False, "moe_topk": 1, "num_key_value_heads": 1},
    "top3-of-4": {"moe_topk": 3},
}


@pytest.mark.parametrize("case", CASES)
def test_hunyuan_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "hunyuan_v1_moe", **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    want = transformers_observed(model, tokens)
    grads = dict(model.named_parameters())
    shared = {
        i: _norm([p.grad for n, p in grads.items() if n.startswith(f"model.layers.{i}.mlp.shared_mlp.")])
        for i in ckpt.spec.routed_layers
    }
    assert all(v > 0 for v in shared.values())
    assert_agree_deepseek(dataclasses.replace(want, shared_grads=shared), observed(ckpt, tokens), ckpt)
    assert ckpt.spec.routed_layers == tuple(range(3)) and ckpt.warnings == [] and ckpt.notes == []
    assert ckpt.spec.settings.qk_norm == "head_after_rope"


def test_norm_after_rope_is_what_the_oracle_checks(tmp_path: Path) -> None:
    """The order matters: q/k normed before RoPE give another loss on the same weights (so the
    agreement above pins the order)."""
    from moeaudit.replay import replay

    save_tiny(tmp_path, "hunyuan_v1_moe")
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    after = replay(ckpt, tokens).nll
    ckpt.spec = ckpt.spec.revised(qk_norm="head")
    before = replay(ckpt, tokens).nll
    assert abs(float(after) - float(before)) > 1e-4


def test_hub_style_config_reads_as_transformers_does() -> None:
    cfg = {
        "model_type": "hunyuan_v1_moe",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 32,
        "vocab_size": 128167,
        "intermediate_size": 3072,
        "num_experts": 64,
        "moe_topk": 8,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    s = spec_from_config(cfg)
    assert (s.num_experts, s.top_k, s.expert_dim, s.shared_dim, s.settings.shared_gated) == (64, 8, 3072, 3072, False)
    assert s.routing == "softmax top-8 of 64, renormalised" and s.routed_layers == tuple(range(32))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"moe_topk": [2, 2, 2]}, "'moe_topk' must be int"),
        ({"moe_topk": 5}, "moe_topk=5 not in 1..4"),
        ({"rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0}}, "rope type 'dynamic' is not supported"),
    ],
)
def test_bad_hunyuan_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("hunyuan_v1_moe").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})
