"""Helpers of tests/test_oracle_gpt_oss.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from moeaudit.checkpoint import (
    mxfp4,  # noqa: E402
)


def assert_experts_backward_is_autograd(
    back: Any,
    experts: list[dict[str, torch.Tensor]],
    y: torch.Tensor,
    topk: torch.Tensor,
    c: torch.Tensor,
    g_out: torch.Tensor,
    contribution: Any,
) -> None:
    """``experts_backward``'s dL/dy, dL/dc and per-expert ‖∇θ‖² against autograd through
    out = Σ_k contribution(w_{e_k}, y, c_k) for L = ⟨out, g_out⟩."""
    leaves = [{n: t.clone().requires_grad_(True) for n, t in w.items()} for w in experts]
    y_, c_ = y.clone().requires_grad_(True), c.clone().requires_grad_(True)
    out = torch.zeros_like(y)
    for k in range(topk.shape[1]):
        for e, w in enumerate(leaves):
            rows = topk[:, k] == e
            out = out.index_add(0, rows.nonzero()[:, 0], contribution(w, y_[rows], c_[rows, k, None]))
    (out * g_out).sum().backward()
    assert y_.grad is not None and c_.grad is not None
    torch.testing.assert_close(back.y_NH, y_.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(back.combine_NK, c_.grad, rtol=1e-5, atol=1e-6)
    want = torch.tensor(
        [sum(float(t.grad.double().pow(2).sum()) for t in w.values() if t.grad is not None) for w in leaves],
        dtype=torch.float64,
    )
    torch.testing.assert_close(back.sq_E, want, rtol=1e-5, atol=1e-9)


def _mxfp4_checkpoint(src: Path, dst: Path) -> None:
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[key + "_blocks"], out[key + "_scales"] = mxfp4.quantize(t)
        else:
            out[key] = t.to(torch.bfloat16)
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(cfg))
