"""Step 3.5 (``step3p5``) and Step-3.7 (``step3p7``): the text decoder replayed against
transformers' ``Step3p7ForConditionalGeneration`` run on text tokens (``hfmodels.wrap.TextView``:
the wrapper's own forward, its one-block vision tower unused); transformers has no causal LM
for ``step3p5`` alone, so the text-only checkpoint (``hfmodels.step.save_step3p5``: the same
files with ``text_config`` as config.json) is checked against the same wrapper.

Two configurations (top-k, expert count, routed scaling, dense/sparse placement, the layer-type
pattern, more or fewer heads on sliding layers, RoPE θ and rotary width per type, the softmax
scale, attention biases), each in float32 and from a bfloat16 checkpoint, with the float32
tolerances of ``test_oracle``. The combine weights compared are transformers' router weights ×
``moe_router_scaling_factor`` (transformers scales the routed sum; the replay's combine weights
carry the factor, as for the other scaled routers)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import (
    random_tokens,  # noqa: E402
    step,
    wrap,
)
from oracle_log import worst as _worst  # noqa: E402
from support.oracle import transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError, InputError  # noqa: E402
from moeaudit.families import FAMILIES, spec_from_config  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

CASES: dict[str, dict[str, Any]] = {
    # hfmodels.step.TEXT: sliding (8 heads, θ 100, whole head), full (4 heads, θ 1e4 on half),
    # sliding, full; the first dense; top-2 of 8, one shared expert
    "more-sliding-heads-top2-8-experts": {},
    # full, sliding, sliding, full, sliding with 2 heads on sliding layers (4 on full); sparse,
    # sparse, dense, sparse, sparse; top-3 of 12, routed sum × 2.5; θ 3 on 6 of 8 dims (full),
    # θ 50 on 4 (sliding); softmax scale 20^-½; q/k/v/o biases; a 4-token window
    "fewer-sliding-heads-top3-12-experts-scaled": {
        "num_hidden_layers": 5,
        "layer_types": [
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        "mlp_layer_types": ["sparse", "sparse", "dense", "sparse", "sparse"],
        "num_experts_per_tok": 3,
        "n_routed_experts": 12,
        "moe_router_scaling_factor": 2.5,
        "attention_bias": True,
        "query_pre_attn_scalar": 20,
        "num_sliding_attention_heads": 2,
        "sliding_window": 4,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 3.0, "partial_rotary_factor": 0.75},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 0.5},
        },
    },
    # Step-3.7-Flash's SwiGLU limits (clamps after the activation) on some layers: the routed
    # experts at 3 on layer 1 and 4 on layer 3 (none on 2: 0.0; layer 0 is dense), the dense MLP
    # of layer 0 at 3.5 and the shared expert of layer 2 at 2.5 (none on 1 and 3); the tiny
    # model's silu(gate) and |up| reach ~7 (90th percentile ~2.3 / ~3.2), so each clamp bites
    "swiglu-limits-on-some-layers": {
        "swiglu_limits": [None, 3.0, 0.0, 4.0],
        "swiglu_limits_shared": [3.5, 0.0, 2.5, None],
    },
}


def _reference(path: Path, tokens: torch.Tensor) -> Any:
    model = step.load_step3p7(path)
    scale = model.config.text_config.moe_router_scaling_factor
    return model, transformers_observed(
        wrap.TextView(model, "step3p7"), tokens, chosen=lambda out: (out[2], out[1] * scale)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_step3p7_text_decoder_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    step.save_step3p7(tmp_path, dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.family == "step3p7" and ckpt.warnings == []
    assert sorted({x.what for x in ckpt.left_out}) == ["vision projector", "vision tower"]
    tokens = random_tokens()
    model, ref = _reference(tmp_path, tokens)
    ours = observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    text, spec = model.config.text_config, ckpt.spec
    layers = model.model.language_model.layers
    assert spec.routed_layers == tuple(i for i, t in enumerate(text.mlp_layer_types) if t == "sparse")
    assert spec.sliding_layers == tuple(i for i, t in enumerate(text.layer_types) if t == "sliding_attention")
    for i, layer in enumerate(layers):
        kind = spec.attention_kind(i)
        assert kind is not None and kind.name == text.layer_types[i]
        assert kind.num_heads == layer.self_attn.num_heads != 0
        inv_freq = getattr(model.model.language_model.rotary_emb, f"{text.layer_types[i]}_inv_freq")
        assert kind.rope_dim == 2 * inv_freq.numel()
    assert len({k.num_heads for k in spec.attention_kinds}) == 2  # the head counts differ by type
    assert "the text decoder" in FAMILIES["step3p7"].audits
    for i, layer in enumerate(layers):  # the clamp bound of each layer, as transformers builds it
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            glu = spec.expert_glu(i)
            assert (float("inf") if glu is None else glu.limit) == mlp.experts.limit
            assert glu is None or (glu.after and glu.alpha == 1.0 and glu.offset == 0.0)
            mlp = mlp.shared_experts
        assert (spec.mlp_glu_limit(i) or float("inf")) == mlp.limit
    if log := os.environ.get("MOEAUDIT_STEP_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


@pytest.mark.parametrize("case", CASES)
def test_step3p5_text_checkpoint_matches_the_wrapper(case: str, tmp_path: Path) -> None:
    """The decoder saved alone (``step3p5``) replays as the wrapper's forward on the same weights."""
    step.save_step3p7(tmp_path / "vl", **CASES[case])
    step.save_step3p5(tmp_path / "text", **CASES[case])
    ckpt = Checkpoint(tmp_path / "text")
    assert ckpt.spec.family == "step3p5" and ckpt.warnings == [] and ckpt.notes == []
    assert ckpt.spec == dataclasses.replace(Checkpoint(tmp_path / "vl").spec, family="step3p5")
    tokens = random_tokens()
    _, ref = _reference(tmp_path / "vl", tokens)
    assert_agree_deepseek(ref, observed(ckpt, tokens), ckpt)


def test_each_step_attention_piece_moves_the_loss(tmp_path: Path) -> None:
    """A single RoPE table, no output gate or the default softmax scale each move the loss by > 1e-3."""
    step.save_step3p7(tmp_path, **CASES["fewer-sliding-heads-top3-12-experts-scaled"])
    ckpt, tokens = Checkpoint(tmp_path), random_tokens()
    spec = ckpt.spec
    base = float(observed(ckpt, tokens).loss)
    full, slide = spec.attention_kinds
    one_rope = dataclasses.replace(slide, rope_theta=full.rope_theta, rotary_dim=full.rotary_dim)
    variants = {
        "one RoPE table": spec.revised(attention_kinds=(full, one_rope)),
        "head_dim^-1/2 scale": spec.revised(attention_scale=None),
    }
    for name, variant in variants.items():
        ckpt.spec = variant
        moved = abs(float(observed(ckpt, tokens).loss) - base)
        assert moved > 1e-3, (name, moved)
    ckpt.spec = spec


def test_each_swiglu_limit_moves_the_loss(tmp_path: Path) -> None:
    """Each clamp of the limits case bites: dropping the routed experts' limit of one layer, or
    the shared expert's / dense MLP's of one layer, moves the loss by > 1e-4; and the stash keeps
    no products of a clamped layer (its experts' backward forms them again)."""
    from moeaudit.replay.stash import ExpertStash

    step.save_step3p7(tmp_path, **CASES["swiglu-limits-on-some-layers"])
    ckpt, tokens = Checkpoint(tmp_path), random_tokens()
    spec = ckpt.spec
    assert spec.expert_glu_limits == (0.0, 3.0, 0.0, 4.0) and spec.mlp_glu_limits == (3.5, 0.0, 2.5, 0.0)
    base = float(observed(ckpt, tokens).loss)
    for field, i in (("experts", 1), ("experts", 3), ("mlp", 0), ("mlp", 2)):
        limits = list(spec.settings.glu_limits)
        limits[i] = dataclasses.replace(limits[i], **{field: 0.0})
        ckpt.spec = spec.revised(glu_limits=tuple(limits))
        moved = abs(float(observed(ckpt, tokens).loss) - base)
        assert moved > 1e-4, (field, i, moved)
    ckpt.spec = spec
    stash = ExpertStash(spec, 16, float("inf"), torch.float32)
    assert [i for i in spec.routed_layers if stash.offer(i) is not None] == [2]


def test_step3p5_config_defaults_and_refusals() -> None:
    import transformers

    hf = transformers.Step3p7TextConfig()
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.head_dim, spec.rms_eps, spec.shared_dim) == (288, 8, 128, 1e-5, 1280)
    assert spec.routed_layers == tuple(range(3, 45)) and spec.norm_offset == 1.0
    assert spec.settings.output_gate == "head_sigmoid" and spec.attention_scale == 128**-0.5
    # Step-3.7-Flash's limits (on its last layers), read as transformers reads them
    flash = spec_from_config(
        {**hf.to_dict(), "swiglu_limits": [None] * 43 + [7, 7], "swiglu_limits_shared": [0] * 43 + [16, 16]}
    )
    assert flash.expert_glu_limits == (0.0,) * 43 + (7.0, 7.0) and flash.mlp_glu_limits == (0.0,) * 43 + (16.0, 16.0)
    assert spec.expert_glu_limits == () and spec.expert_glu(44) is None and spec.mlp_glu_limit(44) == 0.0
    for bad, message in (
        ({"swiglu_limits": [7.0]}, "swiglu_limits"),
        ({"swiglu_limits_shared": [0.0] * 44 + [-1.0]}, "swiglu_limits_shared"),
        ({"gating": "per-channel"}, "gating"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"layer_types": ["minimax_m3_sparse"] * 45}, "layer types"),
        ({"per_layer_config": {"0": {"head_dim": 64}}}, "per_layer_config"),
    ):
        with pytest.raises(CheckpointError, match=message):
            spec_from_config({**hf.to_dict(), **bad})


def test_expert_parallel_replay_refuses_step3p7(tmp_path: Path) -> None:
    from moeaudit.replay.sharded import sharded_replay

    step.save_step3p7(tmp_path)
    with pytest.raises(InputError, match="does not replay step3p7's attention per kind of layer"):
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
