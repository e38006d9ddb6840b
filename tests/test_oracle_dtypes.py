"""The stored dtype never changes the math: every family's checkpoint, saved in
bfloat16 or float16 as people ship them, replays as transformers computes it from the same file
in float32 — loss, hidden states, router logits, active sets, combine weights and the gradient
norms (per expert, router, shared expert, attention).

Tolerances are the float32 ones of ``test_oracle`` (``FORWARD``, ``ACTIVATION_SCALE``,
``GRADIENT``), not looser: a bf16 or fp16 number converts to float32 exactly, so both sides
compute in float32 from the same values and differ only in reduction order. A scale factor
applied to a stored-dtype tensor before the cast (Granite's embedding multiplier was: 1.7e-4 in
the NLL, one token re-routed, expert gradient norms 0.9 % off on the tiny bf16 model) shows up
far above them. The float32 case of every family is its own oracle file's test (same checks).
The vision-language wrappers (``llama4``, ``qwen3_5_moe``) replay the text decoders tested here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import DEEPSEEK, FAMILIES, NEW_FAMILIES, load, random_tokens, save_tiny  # noqa: E402
from safetensors import safe_open  # noqa: E402
from support.oracle import Observed, _norm, transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_famC import _attention_grads_with_linear_layers  # noqa: E402
from support.oracle_llama4 import hf_observed as llama4_observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402

HYBRIDS = ("qwen3_next", "qwen3_5_moe_text")
ALL = (*FAMILIES, *DEEPSEEK, "deepseek_v32", *NEW_FAMILIES, *HYBRIDS)
ROUTER = {"granitemoe": ("block_sparse_moe", "router"), "gpt_oss": ("mlp", "router"), "phimoe": ("mlp", "router")}
STORED = {torch.bfloat16: "BF16", torch.float16: "F16"}


def reference(family: str, model: Any, ckpt: Checkpoint, tokens: torch.Tensor) -> Observed:
    """transformers' numbers, with the few families whose module names the generic hooks miss."""
    if family == "llama4_text":
        return llama4_observed(model, ckpt, tokens)
    moe, gate = ROUTER.get(family, ("mlp", "gate"))
    ref = transformers_observed(model, tokens, moe=moe, gate=gate)
    if family == "hunyuan_v1_moe":  # the shared MLP is ``mlp.shared_mlp``
        params = dict(model.named_parameters())
        ref = dataclasses.replace(
            ref,
            shared_grads={
                i: _norm([p.grad for n, p in params.items() if n.startswith(f"model.layers.{i}.mlp.shared_mlp.")])
                for i in ckpt.spec.routed_layers
            },
        )
    if family in HYBRIDS:  # a DeltaNet layer's token mixer is ``linear_attn``
        attention = _attention_grads_with_linear_layers(model)
        ref.attention_grads = {i: attention[i] for i in ref.attention_grads}
    return ref


@pytest.mark.parametrize("dtype", list(STORED), ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ALL)
def test_stored_dtype_replays_as_transformers_upcast(family: str, dtype: torch.dtype, tmp_path: Path) -> None:
    save_tiny(tmp_path, family, dtype=dtype)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # the file really is in that dtype
        stored = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert stored == {STORED[dtype]}, stored
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert_agree_deepseek(reference(family, load(tmp_path), ckpt, tokens), observed(ckpt, tokens), ckpt)
    assert ckpt.warnings == []
