"""The Nemotron-H wrappers (docs/decisions.md, "Text decoders inside wrappers
(nemotron_h_omni, nemo_speechlm, hy_v4_vl)"): ``nemotron_h_omni`` (Nemotron 3 Nano Omni: RADIO vision
tower, Parakeet sound encoder) and ``nemo_speechlm`` (Nemotron 3.5 Transcribe: speech recognition
and diarization encoders, a word-timestamp decoder), each saved by transformers' wrapper class
around the tiny Nemotron-H of :mod:`hfmodels.nemotron`. The replay of the text decoder is
compared with the wrapper's own forward on text tokens (``hfmodels.wrap.TextView``): loss,
per-window NLL, hidden states, MoE inputs, router logits, top-k sets off near-ties, combine
weights, gradient norms per expert, router, shared expert and the MoE layer's norm, in float32
and from bfloat16 checkpoints, on ``test_oracle_nemotron``'s two configurations."""

from __future__ import annotations

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
from safetensors.torch import load_file, save_file  # noqa: E402
from support.oracle import FORWARD, GRADIENT  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_nemotron import CASES, hf_observed, worst  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.families import FAMILIES  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
WRAPPERS = ("nemotron_h_omni", "nemo_speechlm")
# the parts each wrapper's tiny checkpoint leaves out (Checkpoint.notes)
LEFT_OUT = {
    "nemotron_h_omni": {"vision tower (RADIO)", "vision projector", "sound encoder (Parakeet)", "sound projector"},
    "nemo_speechlm": {"speech encoders (recognition, diarization) and their projector", "word-timestamp decoder"},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", WRAPPERS)
def test_text_decoder_matches_transformers(family: str, case: str, dtype: str, tmp_path: Path) -> None:
    overrides, (windows, length) = CASES[case]
    wrap.save_wrapper(tmp_path, family, dtype=DTYPES[dtype], **overrides)
    tokens = random_tokens(windows, length)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.family == family and ckpt.warnings == []
    assert {x.what for x in ckpt.left_out} == LEFT_OUT[family]
    ref = hf_observed(wrap.TextView(wrap.load_wrapper(tmp_path, family), family), tokens)
    ours = observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt, FORWARD, GRADIENT)
    nll_abs, grad_rel = worst(ref, ours)
    assert nll_abs <= 1e-4 and grad_rel <= 2e-3
    if path := os.environ.get("MOEAUDIT_WORST_LOG"):  # the figures docs/families.md quotes
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": f"{family}[{case}-{dtype}]", "nll_abs": nll_abs, "grad_rel": grad_rel}) + "\n")
    types = overrides.get("layers_block_type", wrap.nemotron_text()["layers_block_type"])
    assert ckpt.spec.routed_layers == tuple(i for i, t in enumerate(types) if t == "moe")
    assert "the text decoder" in FAMILIES[family].audits


def _renamed(src: Path, dst: Path, rename) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file({rename(k): v for k, v in load_file(src / "model.safetensors").items()}, dst / "model.safetensors")
    return dst


def _same(a: Checkpoint, b: Checkpoint) -> None:
    tokens = random_tokens()
    ours_a, ours_b = observed(a, tokens), observed(b, tokens)
    assert ours_a.loss == ours_b.loss
    assert all(torch.equal(ours_a.expert_grads[i], ours_b.expert_grads[i]) for i in ours_a.expert_grads)


def test_nemo_speechlm_module_names(tmp_path: Path) -> None:
    """transformers 5.24 saves Nemotron 3.5 Transcribe under NVIDIA's NeMo names
    (``llm.model.embed_tokens``, ``llm.model.layers.*`` with ``mixer._fp32_params.A_log``,
    ``llm.model.norm``, ``llm.lm_head``); the same tensors under transformers' module names
    (``model.language_model.embeddings`` / ``layers.*`` / ``norm_f``, ``lm_head``) give the same
    numbers."""
    wrap.save_wrapper(tmp_path / "a", "nemo_speechlm")
    a = Checkpoint(tmp_path / "a")
    assert a.layer_keys(0)["ssm_A_log"] == "llm.model.layers.0.mixer._fp32_params.A_log"
    names = (
        ("llm.model.embed_tokens.", "model.language_model.embeddings."),
        ("llm.model.norm.", "model.language_model.norm_f."),
        ("llm.model.layers.", "model.language_model.layers."),
        ("llm.lm_head.", "lm_head."),
        ("mixer._fp32_params.", "mixer."),
    )

    def module_name(k: str) -> str:
        for old, new in names:
            k = k.replace(old, new)
        return k

    b = Checkpoint(_renamed(tmp_path / "a", tmp_path / "b", module_name))
    assert b.layer_keys(0)["ssm_A_log"] == "model.language_model.layers.0.mixer.A_log"
    _same(a, b)


def test_nemotron_h_omni_names_and_legacy_config(tmp_path: Path) -> None:
    """``language_model.backbone.*`` (as saved and released) and ``language_model.model.*``
    (transformers' module names) give the same numbers; a released config's ``llm_config`` is
    read as ``text_config``, as transformers reads it."""
    wrap.save_wrapper(tmp_path / "a", "nemotron_h_omni")
    a = Checkpoint(tmp_path / "a")
    assert a.layer_keys(0)["ssm_in"] == "language_model.backbone.layers.0.mixer.in_proj.weight"
    b = Checkpoint(_renamed(tmp_path / "a", tmp_path / "b", lambda k: k.replace(".backbone.", ".model.")))
    assert b.layer_keys(0)["ssm_in"] == "language_model.model.layers.0.mixer.in_proj.weight"
    _same(a, b)
    cfg_path = tmp_path / "b" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["llm_config"] = cfg.pop("text_config")
    cfg_path.write_text(json.dumps(cfg))
    c = Checkpoint(tmp_path / "b")
    assert c.spec == b.spec
    _same(a, c)
