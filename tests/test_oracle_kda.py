"""Kimi Linear (``kimi_linear``) and Ling 3 (``bailing_hybrid``) (docs/decisions.md, "Kimi Delta Attention (kimi_linear,
bailing_hybrid)"), replayed against
transformers' pure-torch path (flash-linear-attention is absent, so ``KimiLinearDeltaAttention``
and ``BailingHybridDeltaAttention`` run ``chunk_kimi_delta_attention``): loss, per-window NLL,
hidden states, MoE inputs, raw router logits, top-k sets off near-ties, combine weights and
gradient norms per expert, router, shared experts and token mixer (Kimi Delta Attention; MLA
without RoPE, or Ling's with interleaved RoPE and a per-head output gate), in float32 and from
bfloat16 checkpoints, on two configurations per family that move top-k, the expert count, the
routing groups, the shared experts' width, the dense/sparse placement, where the KDA and MLA
layers sit, and Ling's forget gate (bounded or softplus); the second of each runs 70 tokens, two
of transformers' 64-token chunks. Tolerances are ``test_oracle``'s (gradient norms 2e-3
relative, NLL 1e-4)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny  # noqa: E402
from oracle_log import worst as _worst  # noqa: E402
from support.oracle import Observed, transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

import moeaudit.replay.kda as kda  # noqa: E402
from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    # KDA, MLA, KDA; a dense first layer; top-2 of 8 in one group, one shared expert; 12 tokens
    "kda-mla-kda-dense-first-top2-8-experts": ("kimi_linear", {}, 12),
    # MLA, KDA, KDA, MLA with a low-rank query and biases; every layer routed; top-3 of 12 in 3
    # groups of which 2 are kept, two shared experts' width; 3 KDA heads; 70 tokens (two chunks)
    "mla-kda-kda-mla-all-routed-top3-12-experts-grouped": (
        "kimi_linear",
        {
            "num_hidden_layers": 4,
            "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
            "mlp_layer_types": ["sparse"] * 4,
            "num_experts_per_tok": 3,
            "num_local_experts": 12,
            "n_group": 3,
            "topk_group": 2,
            "num_shared_experts": 2,
            "routed_scaling_factor": 1.5,
            "q_lora_rank": 12,
            "attention_bias": True,
            "linear_num_heads": 3,
            "linear_head_dim": 6,
            "linear_conv_kernel_dim": 3,
        },
        70,
    ),
    # Ling 3: KDA, MLA (interleaved RoPE, per-head output gate), KDA; a dense first layer; top-2 of
    # 8 in 2 groups of which 1 is kept, one shared expert; the bounded forget gate (bound −2)
    "ling-kda-mla-kda-bounded-gate-top2-8-experts": ("bailing_hybrid", {}, 12),
    # Ling 3: MLA, KDA, KDA, MLA with a low-rank query and biases, every layer routed, top-3 of 12
    # in 3 groups of which 2 are kept, two shared experts' width, the softplus forget gate; 70 tokens
    "ling-mla-kda-kda-mla-softplus-gate-all-routed-top3-12-experts": (
        "bailing_hybrid",
        {
            "num_hidden_layers": 4,
            "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
            "first_k_dense_replace": 0,
            "num_experts_per_tok": 3,
            "num_experts": 12,
            "n_group": 3,
            "topk_group": 2,
            "num_shared_experts": 2,
            "q_lora_rank": 12,
            "attention_bias": True,
            "kda_safe_gate": False,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 6,
        },
        70,
    ),
}


def _check(tmp_path: Path, case: str, dtype: str) -> tuple[Observed, Observed, Checkpoint, Any]:
    family, overrides, T = CASES[case]
    save_tiny(tmp_path, family, dtype=DTYPES[dtype], **overrides)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens(length=T)
    model = load(tmp_path)
    ref, ours = transformers_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    return ref, ours, ckpt, model


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_kda_hybrid_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    ref, ours, ckpt, model = _check(tmp_path, case, dtype)
    assert ckpt.warnings == [] and ckpt.notes == []
    layers = model.model.layers
    routed = tuple(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed
    kinds = model.config.layer_types
    kda_layers = tuple(i for i, t in enumerate(kinds) if t == "linear_attention")
    assert ckpt.spec.kda_layers == kda_layers and 0 < len(kda_layers) < len(kinds)
    attending = tuple(i for i, t in enumerate(kinds) if t != "linear_attention")  # NoPE: of the attention layers
    assert ckpt.spec.nope_layers == (attending if CASES[case][0] == "kimi_linear" else ())
    la = ckpt.spec.settings.linear_attention
    kda_mod = layers[kda_layers[0]].self_attn
    assert la is not None and (la.num_v_heads, la.v_dim) == (kda_mod.num_heads, kda_mod.head_dim)
    assert set(kda_layers) & set(routed) and set(routed) - set(kda_layers)  # both mixers ahead of a MoE
    assert min(float(layers[i].mlp.gate.e_score_correction_bias.abs().min()) for i in routed) > 0  # a real bias
    if log := os.environ.get("MOEAUDIT_KDA_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_the_decay_is_per_channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's decay differs across a head's channels, and a replay that used one decay
    per head (Gated DeltaNet's: the channels' mean) disagrees with transformers."""
    case = "mla-kda-kda-mla-all-routed-top3-12-experts-grouped"
    rule = kda.kda_rule
    spread: list[float] = []

    def per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> Any:
        spread.append(float((g - g.mean(-1, keepdim=True)).abs().max().detach()))
        return rule(q, k, v, g.mean(-1, keepdim=True).expand_as(g), beta)

    monkeypatch.setattr(kda, "kda_rule", per_head)
    monkeypatch.delenv("MOEAUDIT_ORACLE_LOG", raising=False)  # a wrong replay on purpose: not a measurement
    with pytest.raises(AssertionError):
        _check(tmp_path, case, "fp32")
    assert spread and min(spread) > 0.1


def test_kimi_linear_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("kimi_linear")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.rms_eps, spec.gate.scaling) == (256, 8, 1e-5, 2.446)
    assert spec.shared_dim == hf.moe_intermediate_size and spec.dense_dim == hf.intermediate_size
    assert spec.routed_layers == tuple(range(1, hf.num_hidden_layers))
    assert spec.kda_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "linear_attention")
    la = spec.settings.linear_attention
    assert la is not None and (la.num_v_heads, la.v_dim, la.conv_kernel) == (32, 128, 4)
    assert spec.mla is not None and spec.attention_scale == pytest.approx(192**-0.5)
    # the hub's config: DeepSeek names, linear_attn_config (1-indexed layers), first_k_dense_replace
    hub = {
        k: v
        for k, v in hf.to_dict().items()
        if k not in ("layer_types", "mlp_layer_types", "num_experts", "num_experts_per_token", "num_shared_experts")
    }
    hub.update(
        num_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=2,
        linear_attn_config={
            "head_dim": 64,
            "num_heads": 16,
            "short_conv_kernel_size": 3,
            "full_attn_layers": [4, 8],
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8)],
        },
    )
    got = spec_from_config(hub)
    want = transformers.KimiLinearConfig(**hub)
    assert (got.num_experts, got.top_k, got.shared_dim) == (64, 6, 2 * hf.moe_intermediate_size)
    assert got.routed_layers == tuple(i for i, t in enumerate(want.mlp_layer_types) if t == "sparse")
    assert got.kda_layers == tuple(i for i, t in enumerate(want.layer_types) if t == "linear_attention")
    assert 3 not in got.kda_layers and 7 not in got.kda_layers and got.routed_layers[0] == 2
    la = got.settings.linear_attention
    assert la is not None and (la.num_v_heads, la.v_dim, la.conv_kernel) == (16, 64, 3)
    with pytest.raises(CheckpointError, match="layer_types"):
        spec_from_config({**hf.to_dict(), "layer_types": ["linear_attention"]})
    with pytest.raises(CheckpointError, match="mlp_layer_types"):
        spec_from_config({**hf.to_dict(), "mlp_layer_types": ["moe"] * hf.num_hidden_layers})


def test_bailing_hybrid_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("bailing_hybrid")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.rms_eps, spec.gate.scaling) == (512, 8, 1e-6, 2.5)
    assert (spec.gate.n_group, spec.gate.topk_group, spec.rope.theta, spec.mtp_layers) == (8, 4, 6e6, 1)
    assert spec.routed_layers == tuple(range(2, hf.num_hidden_layers)) and spec.settings.kda_gate_bound == -5.0
    assert spec.kda_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "linear_attention")
    la = spec.settings.linear_attention
    assert la is not None and (la.num_v_heads, la.v_dim, la.conv_kernel) == (32, 128, 4)
    assert spec.mla is not None and spec.mla.rope_interleave and spec.settings.output_gate == "head_sigmoid"
    # the released config: head_dim is the KDA head size, no linear_* keys, DeepSeek names
    raw = {"model_type": "bailing_hybrid", "vocab_size": 64, "num_experts": 16, "num_experts_per_tok": 4}
    raw.update(n_group=4, topk_group=2, head_dim=64, num_hidden_layers=6, kda_safe_gate=False)
    raw.update(hidden_size=64, num_attention_heads=4, moe_intermediate_size=32, intermediate_size=128)
    got = spec_from_config(raw)
    want = transformers.BailingHybridConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert got.kda_layers == tuple(i for i, t in enumerate(want.layer_types) if t == "linear_attention")
    assert (
        got.settings.linear_attention is not None and got.settings.linear_attention.v_dim == want.linear_head_dim == 64
    )
    assert (got.top_k, got.gate.n_group, got.settings.kda_gate_bound) == (4, 4, None)
