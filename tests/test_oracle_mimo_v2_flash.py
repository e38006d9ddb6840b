"""MiMo-V2-Flash (``mimo_v2_flash``) replayed against transformers.

Two configurations (top-k, expert count, grouped routing, renormalisation, routed scaling,
dense/sparse placement by ``mlp_layer_types``, the full/sliding layer pattern, RoPE per layer
type with different θ and rotary widths, the value scale, attention biases varied), each in
float32 and from a bfloat16 checkpoint (transformers computing in float32 from the same stored
values), with the float32 tolerances of ``test_oracle``. Sliding layers have twice the kv heads
and attention sinks; values are narrower than keys (``v_head_dim``). MiMo has no shared expert.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny  # noqa: E402
from oracle_log import worst as _worst  # noqa: E402
from support.oracle import transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError, InputError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

CASES: dict[str, dict[str, Any]] = {
    # MiMoV2FlashConfig's defaults at tiny size (hfmodels.mimo): full, sliding ×4, full; the first
    # layer dense; top-2 of 8, one group; RoPE θ 5e6 / 1e4 on 4 of 12 dims; values × 0.707
    "default-pattern-top2-8-experts": {},
    # sliding, full, sliding, sliding; sparse, sparse, dense, sparse; top-3 of 12 in the best 2 of
    # 4 groups, not renormalised, × 2.5; full RoPE θ 3 on 6 dims, sliding θ 50 on all 12; no value
    # scale (null); q/k/v biases; a 4-token window
    "grouped-top3-12-experts-own-rotary": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        "mlp_layer_types": ["sparse", "sparse", "dense", "sparse"],
        "num_experts_per_tok": 3,
        "n_routed_experts": 12,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 2.5,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 3.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 1.0},
        },
        "attention_value_scale": None,
        "attention_bias": True,
        "sliding_window": 4,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_mimo_v2_flash_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "mimo_v2_flash", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    ref, ours = transformers_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ckpt.warnings == [] and ckpt.notes == []
    cfg, spec = model.config, ckpt.spec
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert spec.routed_layers == routed and len(routed) < cfg.num_hidden_layers
    sliding = tuple(i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention")
    assert spec.sliding_layers == sliding and sliding and len(sliding) < cfg.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        kind, attn = spec.attention_kind(i), layer.self_attn
        assert kind is not None and kind.name == cfg.layer_types[i]
        assert kind.num_kv_heads * kind.head_dim == attn.k_proj.out_features
        assert kind.num_kv_heads * kind.value_dim == attn.v_proj.out_features
        assert kind.sinks == (attn.sinks is not None) and kind.value_scale == attn.v_scale
        inv_freq = getattr(model.model.rotary_emb, f"{cfg.layer_types[i]}_inv_freq")
        assert kind.rope_dim == 2 * inv_freq.numel()
    if log := os.environ.get("MOEAUDIT_MIMO_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_each_difference_of_mimo_attention_moves_the_loss(tmp_path: Path) -> None:
    """The kv heads, sinks, value scale and RoPE per type each change the loss by > 1e-3 when
    dropped, so the agreement above checks every one of them."""
    save_tiny(tmp_path, "mimo_v2_flash", **CASES["grouped-top3-12-experts-own-rotary"])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    base = float(observed(ckpt, tokens).loss)
    spec = ckpt.spec
    full, slide = spec.attention_kinds
    variants = {
        "one RoPE table": dataclasses.replace(
            spec,
            attention_kinds=(full, dataclasses.replace(slide, rope_theta=full.rope_theta, rotary_dim=full.rotary_dim)),
        ),
        "no sinks": spec.revised(attention_kinds=(full, dataclasses.replace(slide, sinks=False))),
        "value scale": dataclasses.replace(
            spec,
            attention_kinds=tuple(dataclasses.replace(k, value_scale=0.5) for k in spec.attention_kinds),
        ),
    }
    for name, variant in variants.items():
        ckpt.spec = variant
        moved = abs(float(observed(ckpt, tokens).loss) - base)
        assert moved > 1e-3, (name, moved)
    ckpt.spec = spec


def test_mimo_v2_flash_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("mimo_v2_flash")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.head_dim, spec.rms_eps) == (256, 8, 192, 1e-5)
    assert spec.routed_layers == tuple(range(1, 48)) and spec.shared_dim == 0 and spec.dense_dim == 16384
    full, slide = spec.attention_kinds
    assert (full.num_kv_heads, slide.num_kv_heads, full.rotary_dim, full.v_head_dim) == (4, 8, 64, 128)
    assert (full.rope_theta, slide.rope_theta, slide.sinks, full.sinks) == (5e6, 1e4, True, False)
    assert spec.sliding_window == 129 and spec.sliding_layers == tuple(
        i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"
    )
    keep = ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size", "num_experts_per_tok")
    keep += ("n_routed_experts", "moe_intermediate_size", "tie_word_embeddings", "rms_norm_eps")
    assert spec_from_config({"model_type": "mimo_v2_flash", **{k: hf.to_dict()[k] for k in keep}}) == spec
    window = spec_from_config({**hf.to_dict(), "sliding_window_size": 128})
    assert window.sliding_window == hf.__class__(sliding_window_size=128).sliding_window == 129
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64}
    with pytest.raises(CheckpointError, match="default RoPE per layer type only"):
        spec_from_config({**hf.to_dict(), "rope_parameters": {**hf.rope_parameters, "sliding_attention": yarn}})


def test_expert_parallel_replay_refuses_mimo_v2_flash(tmp_path: Path) -> None:
    from moeaudit.replay.sharded import sharded_replay

    save_tiny(tmp_path, "mimo_v2_flash")
    with pytest.raises(InputError, match="does not replay mimo_v2_flash's attention per kind of layer"):
        sharded_replay(
            None,  # type: ignore[arg-type]  (refused before the session is used)
            Checkpoint(tmp_path),
            random_tokens(),
            backward=True,
            observers=(),
            progress=None,
            dtype=torch.float32,
            device=None,
        )
