"""Flint (``flint``) replayed against transformers.

Two configurations (top-k, expert count, shared-expert width, dense/sparse placement, sliding/full
layer pattern and renormalisation varied), each in float32 and from a bfloat16 checkpoint
(transformers computing in float32 from the same stored values, as ``test_oracle_dtypes``), with
the float32 tolerances of ``test_oracle``: NLL, hidden states and router logits, gradient norms
within 2e-3 relative, identical top-k sets on tokens whose k-th and (k+1)-th selection scores
(σ of the logits) differ by more than ``TIE_GAP``. The attention gradient norm covers the sinks.
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

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay.model import route  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

CASES: dict[str, dict[str, Any]] = {
    # full, full, sliding, full; the first two dense; top-2 of 8, shared width 40, renormalised
    "two-dense-top2-8-experts": {},
    # five layers sliding, full, sliding, sliding, full (layer_types), only layer 1 dense, top-3 of
    # 12, a wider shared expert, q/k/v/o biases, not renormalised, a 4-token window
    "one-dense-top3-12-experts-unnormalised": {
        "num_hidden_layers": 5,
        "mlp_only_layers": [1],
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        "num_experts_per_tok": 3,
        "num_experts": 12,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": False,
        "attention_bias": True,
        "sliding_window": 4,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_flint_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "flint", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    ref, ours = transformers_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ckpt.warnings == [] and ckpt.notes == []
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed and len(routed) < model.config.num_hidden_layers
    full = tuple(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    sliding = tuple(i for i in range(model.config.num_hidden_layers) if i not in full)
    assert ckpt.spec.nope_layers == full and ckpt.spec.sliding_layers == sliding and full and sliding
    sinks = model.model.layers[0].self_attn.sinks.detach()
    assert float(sinks.abs().min()) > 0  # the oracle ran with real sinks
    if log := os.environ.get("MOEAUDIT_FLINT_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_flint_chooses_on_sigmoid_as_transformers() -> None:
    """Where σ saturates (logits above ~17 all read 1.0 in float32), transformers' top-k of σ
    breaks the tie as torch.topk does; the replay chooses on the same σ, so its set is
    transformers' (choosing on the logits would take the largest logit instead)."""
    import transformers

    cfg = transformers.AutoConfig.for_model("flint").to_dict()
    spec = spec_from_config({**cfg, "num_experts": 4, "num_experts_per_tok": 1, "hidden_size": 4})
    router = torch.eye(4, 4)
    y = torch.tensor([[30.0, 20.0, 25.0, -1.0]])  # σ = 1.0, 1.0, 1.0 in float32
    hf = torch.topk(torch.sigmoid(torch.nn.functional.linear(y, router)), 1, dim=-1).indices
    assert torch.equal(route(spec, router, y).topk_NK, hf)
    assert int(torch.topk(y, 1).indices) == 0 and int(hf) != 0  # on the logits it would differ


def test_flint_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("flint")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.head_dim, spec.rms_eps, spec.rope.theta) == (256, 6, 128, 1e-6, 1e4)
    assert spec.shared_dim == 1024 and spec.dense_dim == 6144 and not spec.settings.shared_gated
    assert spec.routed_layers == tuple(range(2, hf.num_hidden_layers)) and spec.settings.attention_sinks
    assert spec.nope_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "full_attention")
    assert spec.sliding_window == 513 and spec.settings.sigmoid_select and spec.settings.norm_topk_prob
    absent = {k: v for k, v in hf.to_dict().items() if k not in ("layer_types", "mlp_only_layers", "sliding_window")}
    again = spec_from_config(absent)  # the configuration class's defaults when the keys are absent
    assert (again.nope_layers, again.routed_layers, again.sliding_window) == (
        spec.nope_layers,
        spec.routed_layers,
        513,
    )
    with pytest.raises(CheckpointError, match="layer_types"):
        spec_from_config({**hf.to_dict(), "layer_types": ["full_attention"]})
