"""HY-V4-VL (``hy_v4_vl``): its text decoder replayed against transformers'
``HYV4VLForConditionalGeneration`` run on text tokens (``hfmodels.wrap.TextView``: the wrapper's
own forward, its one-block vision tower unused), saved by that class around the tiny HY-V4 of
:mod:`hfmodels.hy_v4`; ``test_oracle_hy_v4``'s checks (loss, per-window NLL, each layer's
streams, MoE inputs, router logits, top-k sets off near-ties, combine weights, gradient norms per
expert, router, shared expert and attention sub-block) and its configurations, in float32 and
from bfloat16 checkpoints (transformers' indexers breaking tied cuts by position as the replay
does, except on the case that meets none: ``support.indexer_ties``). The three ways the VL
decoder differs from HY-V4's (adjacent-pair RoPE in the attention and in the indexer, latent
norms at ``rms_norm_eps``) are each shown to matter."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import (
    random_tokens,  # noqa: E402
    wrap,
)
from oracle_log import worst as _worst  # noqa: E402
from support.indexer_ties import watch_indexers  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_hy_v4 import CASES, UNTIED, hy_v4_observed, layer_inputs  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.families import FAMILIES  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_hy_v4_vl_text_decoder_matches_transformers(
    case: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ties = watch_indexers(monkeypatch, by_position=case not in UNTIED)
    wrap.save_wrapper(tmp_path, "hy_v4_vl", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.family == "hy_v4_vl" and ckpt.warnings == []
    assert [x.what for x in ckpt.left_out] == ["vision tower"]
    tokens = random_tokens()
    model = wrap.load_wrapper(tmp_path, "hy_v4_vl")
    ref, ours = hy_v4_observed(wrap.TextView(model, "hy_v4_vl"), tokens), observed(ckpt, tokens)
    ours.layer_inputs = layer_inputs(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ties.calls > 0 and (ties.tied_cuts == 0) == (case in UNTIED)
    worst = _worst(ref, ours)
    assert worst["nll_abs"] <= 1e-4 and worst["grad_rel"] <= 2e-3
    if path := os.environ.get("MOEAUDIT_WORST_LOG"):  # the figures docs/families.md quotes
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": f"hy_v4_vl[{case}-{dtype}]", **worst}) + "\n")
    text = model.config.text_config
    s = ckpt.spec
    assert s.routed_layers == tuple(i for i, t in enumerate(text.mlp_layer_types) if t == "sparse")
    assert s.hc.streams == text.hc_mult and s.settings.mla_norm_eps == text.rms_norm_eps
    assert s.mla is not None and s.mla.rope_interleave and s.settings.index_rope_interleave
    assert "the text decoder" in FAMILIES["hy_v4_vl"].audits


def test_each_difference_from_hy_v4_matters(tmp_path: Path) -> None:
    """Replayed as HY-V4 would replay it (rotate-half RoPE in the attention or in the indexer,
    latent norms at 1e-6), the loss moves by far more than the oracle's tolerance."""
    wrap.save_wrapper(tmp_path, "hy_v4_vl", **CASES["four-streams-top3-12-experts-two-shared"])
    ckpt, tokens = Checkpoint(tmp_path), random_tokens()
    s = ckpt.spec
    assert s.mla is not None
    base = float(observed(ckpt, tokens).loss)
    for changed in (
        dataclasses.replace(s, mla=dataclasses.replace(s.mla, rope_interleave=False)),
        s.revised(index_rope_interleave=False),
        s.revised(mla_norm_eps=None),
    ):
        ckpt.spec = changed
        assert abs(float(observed(ckpt, tokens).loss) - base) > 1e-2
    ckpt.spec = s


def test_hy_v4_vl_module_names(tmp_path: Path) -> None:
    """``model.*`` (as saved and released) and ``model.language_model.*`` with the hyper head and
    gates under transformers' module names give the same numbers."""
    from safetensors.torch import load_file, save_file

    wrap.save_wrapper(tmp_path / "a", "hy_v4_vl")
    a = Checkpoint(tmp_path / "a")
    assert a.layer_keys(1)["router"] == "model.layers.1.mlp.gate.weight"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    names = (
        ("model.layers.", "model.language_model.layers."),
        ("model.embed_tokens.", "model.language_model.embed_tokens."),
        ("model.norm.", "model.language_model.norm."),
        ("model.hc_head.hc_pre.hc_head_", "model.language_model.hc_head.hc_"),
        ("hc_pre.hc_attn_layer.hc_", "attn_hc."),
        ("hc_pre.hc_mlp_layer.hc_", "ffn_hc."),
        ("linear_gate.", "gate_proj."),
        ("learnable_sink_param", "sinks"),
    )
    tensors = {}
    for k, t in load_file(tmp_path / "a" / "model.safetensors").items():
        for old, new in names:
            k = k.replace(old, new)
        tensors[k] = t
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    b = Checkpoint(tmp_path / "b")
    assert b.layer_keys(1)["router"] == "model.language_model.layers.1.mlp.gate.weight"
    assert b.warnings == [] and [x.what for x in b.left_out] == ["vision tower"]
    tokens = random_tokens()
    ours_a, ours_b = observed(a, tokens), observed(b, tokens)
    assert ours_a.loss == ours_b.loss
    assert all(torch.equal(ours_a.expert_grads[i], ours_b.expert_grads[i]) for i in ours_a.expert_grads)
