"""Lara-Mini (``lara_mini``) replayed against transformers.

Two configurations (top-k, expert count, shared-expert width, the DeltaNet / sliding / full
layer pattern, key vs value heads, renormalisation, attention biases and tied embeddings
varied), each in float32 and from a bfloat16 checkpoint (transformers computing in float32 from
the same stored values), with the float32 tolerances of ``test_oracle``. The checkpoints are
what ``save_pretrained`` writes: the DeltaNet's input projections fused in one ``in_proj``
(rows q|k|v|z|b|a) and its gated norm as ``out_norm``, which transformers splits and renames on
load and the replay reads as stored. A token mixer's gradient norm covers the DeltaNet
(``linear_attn.``, the fused ``in_proj`` included) or the attention, and the input norm.
"""

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
from support.oracle import transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_famC import _attention_grads_with_linear_layers  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

CASES: dict[str, dict[str, Any]] = {
    # DeltaNet, sliding, DeltaNet, full, sliding; top-2 of 8, shared width 40, tied embeddings
    "released-pattern-top2-8-experts": {},
    # full, DeltaNet, sliding, DeltaNet; top-3 of 12, a wider shared expert, not renormalised,
    # q/k/v/o biases, one value head per key head, untied embeddings, a 4-token window
    "full-first-top3-12-experts-unnormalised": {
        "num_hidden_layers": 4,
        "layer_types": ["full_attention", "linear_attention", "sliding_attention", "linear_attention"],
        "num_experts_per_tok": 3,
        "num_experts": 12,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": False,
        "attention_bias": True,
        "linear_num_value_heads": 2,
        "tie_word_embeddings": False,
        "sliding_window": 4,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_lara_mini_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "lara_mini", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    assert "model.layers.{layer}.linear_attn.in_proj.weight" in ckpt.spec.layout.layer["lin_in"]
    tokens = random_tokens()
    model = load(tmp_path)
    ref = transformers_observed(model, tokens)
    attention = _attention_grads_with_linear_layers(model)
    ref.attention_grads = {i: attention[i] for i in ref.attention_grads}
    ours = observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ckpt.warnings == [] and ckpt.notes == []
    types = model.config.layer_types
    assert ckpt.spec.routed_layers == tuple(range(model.config.num_hidden_layers))
    assert ckpt.spec.linear_layers == tuple(i for i, t in enumerate(types) if t == "linear_attention")
    assert ckpt.spec.nope_layers == tuple(i for i, t in enumerate(types) if t == "full_attention")
    assert ckpt.spec.sliding_layers == tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert ckpt.spec.tie_embeddings == model.config.tie_word_embeddings
    if log := os.environ.get("MOEAUDIT_LARA_MINI_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_lara_mini_fused_in_proj_rows_are_read_in_order(tmp_path: Path) -> None:
    """Each row block of the fused ``in_proj`` (q|k|v, z, b, a) reaches the replay: scaling one
    block in the file moves the loss (a replay that read a block from the wrong rows, or dropped
    one, would move differently from transformers; the oracle above checks the values)."""
    import safetensors.torch as st

    save_tiny(tmp_path, "lara_mini")
    tokens = random_tokens()
    base = float(observed(Checkpoint(tmp_path), tokens).loss)
    (path,) = tmp_path.glob("*.safetensors")
    original = st.load_file(path)
    key = "model.layers.0.linear_attn.in_proj.weight"
    la = Checkpoint(tmp_path).spec.settings.linear_attention
    assert la is not None
    kd, vd, nv = la.num_k_heads * la.k_dim, la.num_v_heads * la.v_dim, la.num_v_heads
    edges = [0, 2 * kd + vd, 2 * kd + 2 * vd, 2 * kd + 2 * vd + nv, 2 * kd + 2 * vd + 2 * nv]
    assert original[key].shape[0] == edges[-1]
    for lo, hi in zip(edges, edges[1:], strict=False):
        w = original[key].clone()
        w[lo:hi] *= 3.0
        st.save_file({**original, key: w}, path, metadata={"format": "pt"})
        ref = load(tmp_path)
        want = float(transformers_observed(ref, tokens).loss)
        got = float(observed(Checkpoint(tmp_path), tokens).loss)
        assert abs(got - base) > 1e-4 and got == pytest.approx(want, rel=1e-5, abs=1e-5), (lo, hi)
    st.save_file(original, path, metadata={"format": "pt"})


def test_lara_mini_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("lara_mini")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.head_dim, spec.rms_eps, spec.rope.theta) == (128, 4, 128, 1e-6, 1e4)
    assert (
        spec.shared_dim == 512
        and not spec.settings.shared_gated
        and spec.settings.norm_topk_prob
        and spec.tie_embeddings
    )
    assert spec.routed_layers == tuple(range(hf.num_hidden_layers)) and spec.norm_offset == 0.0
    assert spec.linear_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "linear_attention")
    assert spec.nope_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "full_attention")
    assert spec.sliding_window == 512 and not spec.settings.gated_attention
    la = spec.settings.linear_attention
    assert la is not None and (la.num_k_heads, la.num_v_heads, la.k_dim, la.v_dim, la.conv_kernel) == (
        8,
        16,
        128,
        128,
        4,
    )
    drop = ("layer_types", "sliding_window", "tie_word_embeddings", "linear_num_key_heads", "linear_num_value_heads")
    absent = {k: v for k, v in hf.to_dict().items() if k not in drop}
    assert spec_from_config(absent) == spec  # the configuration class's defaults when the keys are absent
    with pytest.raises(CheckpointError, match="layer_types"):
        spec_from_config({**hf.to_dict(), "layer_types": ["full_attention"]})
