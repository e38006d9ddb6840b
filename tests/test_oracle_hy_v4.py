"""HY-V4 (``hy_v4``, Hunyuan V4) replayed against transformers.

Hyper-connections: the layer input is the ``hc_mult`` residual streams, [B, T, hc, H]; the
replay's layer inputs are compared stream by stream with transformers' hidden states, and the
last with its output after the hyper head and the final norm. Configurations vary the stream
count, top-k, expert count, shared experts, dense/sparse layer placement, the SwiGLU clamp and
the DSA indexer (keeping fewer keys than the window, so the selection decides what each query
sees; with four indexer heads the probe's scores tie at the cut, and transformers' top-k then
breaks the ties as the replay does, ``support.indexer_ties``; sixteen heads meet no tie and are
compared with transformers as it is), each in float32 and from a bfloat16 checkpoint
(transformers computing in float32 from the same stored values, as ``test_oracle_dtypes``), with
``test_oracle``'s float32 tolerances.
The MoE input h is what the MoE block's pre-norm reads: the mix the MLP sub-block's
hyper-connection forms (docs/decisions.md, HY-V4). The attention gradient norm covers the
attention projections, its gate and sinks, the input norm and the attention sub-block's
hyper-connection (``attn_hc``), as the replay's attention group does.
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
from support.indexer_ties import watch_indexers  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_hy_v4 import CASES, UNTIED, hy_v4_observed, layer_inputs  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CanaryError, CheckpointError, InputError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay.engine import replay  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_hy_v4_replay_matches_transformers(
    case: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ties = watch_indexers(monkeypatch, by_position=case not in UNTIED)
    save_tiny(tmp_path, "hy_v4", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    ref, ours = hy_v4_observed(model, tokens), observed(ckpt, tokens)
    ours.layer_inputs = layer_inputs(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ties.calls > 0 and (ties.tied_cuts == 0) == (case in UNTIED)
    assert ckpt.warnings == [] and ckpt.notes == []
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed and ckpt.spec.hc.streams == model.config.hc_mult
    assert ckpt.spec.sparse_index is not None and ckpt.spec.sparse_index.topk < tokens.shape[1]
    assert min(float(model.model.layers[i].mlp.gate.e_score_correction_bias.abs().min()) for i in routed) > 0
    if log := os.environ.get("MOEAUDIT_HY_V4_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_hy_v4_the_clamp_bites_in_the_tiny_checkpoint(tmp_path: Path) -> None:
    """The first case's experts meet their SwiGLU clamp (else the oracle would not test it):
    raising the limit changes the loss."""
    tokens = random_tokens()
    save_tiny(tmp_path / "a", "hy_v4")
    save_tiny(tmp_path / "b", "hy_v4", swiglu_limit=100.0)
    a, b = (replay(Checkpoint(tmp_path / d), tokens, backward=False).nll for d in ("a", "b"))
    assert abs(a - b) > 1e-4


def test_hy_v4_shared_indexer_layers(tmp_path: Path) -> None:
    """transformers' default indexer pattern (layers reusing the previous layer's key selection)
    is replayed for windows of at most index_topk tokens, where DSA keeps every causal key and
    the replay agrees with transformers; longer windows are refused by name before the replay."""
    save_tiny(tmp_path, "hy_v4", indexer_types=["full", "full", "shared"], index_topk=12)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.shared_index_layers == (2,)
    tokens = random_tokens()
    ours = observed(ckpt, tokens)
    ours.layer_inputs = layer_inputs(ckpt, tokens)
    assert_agree_deepseek(hy_v4_observed(load(tmp_path), tokens), ours, ckpt)
    save_tiny(tmp_path / "short", "hy_v4", indexer_types=["full", "full", "shared"], index_topk=5)
    with pytest.raises(CanaryError, match=r"layers \[2\] reuse another layer's sparse-attention key selection"):
        replay(Checkpoint(tmp_path / "short"), tokens)


def test_hy_v4_greedy_generation_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generation receipts' greedy continuation passes the hyper head too: each new token is
    the argmax of transformers' logits on the sequence so far (no cache: the replay keeps none;
    the sequences' indexer cuts tie, so transformers breaks the ties by position too)."""
    from moeaudit.replay.engine import greedy_generate

    watch_indexers(monkeypatch, by_position=True)
    save_tiny(tmp_path, "hy_v4")
    model, prompts = load(tmp_path), random_tokens()[:, :8]
    ours = greedy_generate(Checkpoint(tmp_path), prompts, 3)
    seq = prompts
    with torch.no_grad():
        for _ in range(3):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(ours, seq[:, 8:])


def test_hy_v4_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("hy_v4")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.rms_eps, spec.hc.streams, spec.hc.magnitude) == (256, 8, 1e-5, 4, 2.0)
    assert spec.routed_layers == tuple(i for i, t in enumerate(hf.mlp_layer_types) if t == "sparse")
    assert spec.shared_index_layers == tuple(i for i, t in enumerate(hf.indexer_types) if t == "shared")
    assert spec.gate.scaling == hf.routed_scaling_factor and spec.clamped_glu is not None
    assert spec.clamped_glu.limit == hf.swiglu_limit and spec.mla is not None and not spec.mla.rope_interleave
    cfg = {k: v for k, v in hf.to_dict().items() if k not in ("mlp_layer_types", "indexer_types", "layer_types")}
    absent = spec_from_config(cfg)  # the configuration class's rules when the keys are absent
    assert (absent.routed_layers, absent.shared_index_layers) == (spec.routed_layers, spec.shared_index_layers)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"swiglu_limit": 0.0}, "swiglu_limit=0 is ambiguous"),
        ({"layer_types": ["sliding_attention"] * 34}, "does not replay layer_types"),
        ({"indexer_types": ["shared"] * 34}, "the first layer's indexer_types must be 'full'"),
        ({"q_lora_rank": None}, "needs q_lora_rank"),
        ({"hc_mult": 0}, "hc_mult must be in 1..64"),
    ],
)
def test_inconsistent_hy_v4_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    import transformers

    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**transformers.AutoConfig.for_model("hy_v4").to_dict(), **bad})


def test_expert_parallel_replay_refuses_hy_v4(tmp_path: Path) -> None:
    from moeaudit.replay.sharded import sharded_replay

    save_tiny(tmp_path, "hy_v4")
    with pytest.raises(InputError, match="does not replay hy_v4's hyper-connections"):
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
