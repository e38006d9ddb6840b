"""AFMoE (``afmoe``, Arcee Trinity) replayed against transformers.

Two configurations (top-k, expert count, shared experts, dense/sparse placement, sliding/full
layer pattern and µP embedding scaling varied), each in float32 and from a bfloat16 checkpoint
(transformers computing in float32 from the same stored values, as ``test_oracle_dtypes``),
with the float32 tolerances of ``test_oracle``: NLL, hidden states and router logits
(``FORWARD``), gradient norms within 2e-3 relative (``GRADIENT``), identical top-k sets on
tokens whose k-th and (k+1)-th selection scores differ by more than ``TIE_GAP``. The attention
gradient norm covers the attention projections, its q/k norms, the input norm and the norm on
the attention output (``post_attention_layernorm``), as the replay's attention group does.
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
from support.oracle_afmoe import afmoe_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

CASES: dict[str, dict[str, Any]] = {
    # dense first layer; sliding, full, sliding; top-2 of 8, one shared expert, × 1.5
    "dense-first-top2-8-experts-one-shared": {},
    # every layer routed, four layers full, sliding, full, sliding (layer_types), top-3 of 12, two
    # shared experts, q/k/v/o biases, µP embedding scaling, a 4-token window
    "all-routed-top3-12-experts-two-shared-mup": {
        "num_dense_layers": 0,
        "num_hidden_layers": 4,
        "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "num_experts_per_tok": 3,
        "num_experts": 12,
        "num_shared_experts": 2,
        "route_scale": 1.0,
        "attention_bias": True,
        "mup_enabled": True,
        "sliding_window": 4,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_afmoe_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "afmoe", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    ref, ours = afmoe_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ckpt.warnings == [] and ckpt.notes == []
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed
    full = tuple(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    sliding = tuple(i for i in range(model.config.num_hidden_layers) if i not in full)
    assert ckpt.spec.nope_layers == full and ckpt.spec.sliding_layers == sliding and full and sliding
    assert min(float(model.model.layers[i].mlp.expert_bias.detach().abs().min()) for i in routed) > 0  # a real bias
    if log := os.environ.get("MOEAUDIT_AFMOE_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_afmoe_each_sandwich_norm_matters(tmp_path: Path) -> None:
    """The replay reads each of the three output norms: a gain changed in the file changes the
    loss (a replay that skipped one would not move)."""
    import safetensors.torch as st

    save_tiny(tmp_path, "afmoe")
    tokens = random_tokens()
    base = observed(Checkpoint(tmp_path), tokens).loss
    (path,) = tmp_path.glob("*.safetensors")
    original = st.load_file(path)
    for key in (
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.post_mlp_layernorm.weight",  # a dense layer's MLP output norm
        "model.layers.1.post_mlp_layernorm.weight",  # a routed layer's MoE output norm
    ):
        st.save_file({**original, key: original[key] * 3.0}, path, metadata={"format": "pt"})
        assert abs(float(observed(Checkpoint(tmp_path), tokens).loss) - float(base)) > 1e-3, key
    st.save_file(original, path, metadata={"format": "pt"})


def test_afmoe_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("afmoe")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.head_dim, spec.rms_eps) == (64, 6, 128, 1e-5)
    assert spec.shared_dim == 2 * hf.moe_intermediate_size and spec.dense_dim == hf.intermediate_size
    assert spec.routed_layers == tuple(range(1, hf.num_hidden_layers))
    assert spec.nope_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "full_attention")
    assert spec.sliding_window == 1024 and spec.embedding_multiplier == 1.0
    cfg = {k: v for k, v in hf.to_dict().items() if k not in ("layer_types", "head_dim", "sliding_window")}
    absent = spec_from_config(cfg)  # the configuration class's defaults when the keys are absent
    assert absent.nope_layers == spec.nope_layers and absent.head_dim == 128 and absent.sliding_window == 1024
    with pytest.raises(CheckpointError, match="layer_types"):
        spec_from_config({**hf.to_dict(), "layer_types": ["full_attention"]})
    with pytest.raises(CheckpointError, match="hidden_act"):
        spec_from_config({**hf.to_dict(), "hidden_act": "gelu"})
