"""Mellum (``mellum``) replayed against transformers.

Two configurations (top-k, expert count, dense/sparse placement by ``mlp_layer_types``,
sliding/full layer pattern sharing one RoPE or with a RoPE table per layer type, renormalisation
and attention biases varied), each in float32 and from a bfloat16 checkpoint (transformers
computing in float32 from the same stored values), with the float32 tolerances of ``test_oracle``.
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

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
ONE_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

CASES: dict[str, dict[str, Any]] = {
    # all full attention (θ 500000); dense, sparse, sparse; top-2 of 8, renormalised
    "dense-first-top2-8-experts": {},
    # sliding, full, sliding, full sharing θ 10000; sparse, sparse, dense, sparse; top-3 of 12,
    # not renormalised, q/k/v/o biases, a 4-token window
    "sliding-top3-12-experts-unnormalised": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": ONE_ROPE, "sliding_attention": ONE_ROPE},
        "mlp_layer_types": ["sparse", "sparse", "dense", "sparse"],
        "num_experts_per_tok": 3,
        "num_local_experts": 12,
        "norm_topk_prob": False,
        "attention_bias": True,
        "sliding_window": 4,
    },
    # MellumConfig's default RoPE per type (sliding θ 10000, full θ 500000: a table per type);
    # full, sliding, sliding, full, sliding; dense, sparse ×4; top-1 of 6, a 3-token window
    "per-type-rope-default-top1-6-experts": {
        "num_hidden_layers": 5,
        "layer_types": [
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
        "num_experts_per_tok": 1,
        "num_local_experts": 6,
        "sliding_window": 3,
    },
    # sliding θ 50, full θ 3 (RoPE tables far apart); sparse, dense, sparse, sparse; top-4 of 16,
    # not renormalised, biases, a window wider than the canary (T = 12)
    "per-type-rope-top4-16-experts": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 3.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"],
        "num_experts_per_tok": 4,
        "num_local_experts": 16,
        "norm_topk_prob": False,
        "attention_bias": True,
        "sliding_window": 64,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_mellum_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "mellum", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    ref, ours = transformers_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ckpt.warnings == [] and ckpt.notes == []
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed and len(routed) < model.config.num_hidden_layers
    sliding = tuple(i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention")
    assert ckpt.spec.sliding_layers == sliding or model.config.sliding_window >= tokens.shape[1]
    ropes = {t: model.config.rope_parameters[t]["rope_theta"] for t in model.config.layer_types}
    if len(set(ropes.values())) == 1:  # one table, as before attention kinds
        assert ckpt.spec.attention_kinds == () and ckpt.spec.rope.theta == (1e4 if sliding else 5e5)
    else:
        kinds = [ckpt.spec.attention_kind(i) for i in range(model.config.num_hidden_layers)]
        assert [k.rope_theta for k in kinds if k] == [ropes[t] for t in model.config.layer_types]
    if log := os.environ.get("MOEAUDIT_MELLUM_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_mellum_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("mellum")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.head_dim, spec.rms_eps, spec.rope.theta) == (64, 8, 128, 1e-6, 5e5)
    assert spec.routed_layers == tuple(range(hf.num_hidden_layers)) and spec.shared_dim == 0
    assert spec.sliding_layers == () and spec.settings.norm_topk_prob and spec.dense_dim == 7168
    absent = {k: v for k, v in hf.to_dict().items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")}
    assert spec_from_config(absent) == spec  # the configuration class's defaults when the keys are absent


def test_mellum_per_layer_type_rope_and_its_refusals() -> None:
    """Sliding layers beside full ones with MellumConfig's default RoPE (θ 10000 vs 500000): a
    RoPE table per layer type (``attention_kinds``); a flat ``rope_parameters``, a partial rotary
    or another RoPE type per layer type are refused at read."""
    import transformers

    n = 4
    types = ["sliding_attention", "full_attention"] * 2
    hf = transformers.AutoConfig.for_model("mellum", num_hidden_layers=n, layer_types=types)
    assert hf.rope_parameters["sliding_attention"] != hf.rope_parameters["full_attention"]
    spec = spec_from_config(hf.to_dict())
    assert [k.name for k in spec.attention_kinds] == ["full_attention", "sliding_attention"]
    assert spec.layer_kinds == (1, 0, 1, 0) and [k.rope_theta for k in spec.attention_kinds] == [5e5, 1e4]
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64}
    with pytest.raises(CheckpointError, match="default RoPE per layer type only"):
        spec_from_config({**hf.to_dict(), "rope_parameters": {**hf.rope_parameters, "sliding_attention": yarn}})
    with pytest.raises(CheckpointError, match="per layer type"):  # a flat rope_parameters: transformers fails too
        spec_from_config({**hf.to_dict(), "rope_parameters": ONE_ROPE})
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        spec_from_config(
            {
                **hf.to_dict(),
                "layer_types": ["full_attention"] * n,
                "rope_parameters": {"full_attention": {**ONE_ROPE, "partial_rotary_factor": 0.5}},
            }
        )


def test_mellum_mtp_module_is_left_out_with_a_note(tmp_path: Path) -> None:
    """``mtp.*`` (transformers ignores it on load) is recognised and noted, not replayed or warned about."""
    import safetensors.torch as st

    save_tiny(tmp_path, "mellum")
    tokens = random_tokens()
    base = observed(Checkpoint(tmp_path), tokens).loss
    (path,) = tmp_path.glob("*.safetensors")
    tensors = st.load_file(path)
    st.save_file({**tensors, "mtp.0.eh_proj.weight": torch.ones(32, 64)}, path, metadata={"format": "pt"})
    ckpt = Checkpoint(tmp_path)
    assert ckpt.warnings == [] and any("mtp" in n for n in ckpt.notes)
    assert torch.equal(observed(ckpt, tokens).loss, base)


def test_expert_parallel_replay_refuses_mellum_with_rope_per_layer_type(tmp_path: Path) -> None:
    from moeaudit.errors import InputError
    from moeaudit.replay.sharded import sharded_replay

    save_tiny(tmp_path, "mellum", **CASES["per-type-rope-default-top1-6-experts"])
    with pytest.raises(InputError, match="does not replay mellum's attention per kind of layer"):
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
