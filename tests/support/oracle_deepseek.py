"""Helpers of tests/test_oracle_deepseek.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import oracle_log  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.replay import replay  # noqa: E402
from support.oracle import (  # noqa: E402
    FORWARD,
    GRADIENT,
    TIE_GAP,
    Observed,
    _by_expert,
    _same_topk,
    assert_close_activations,
    moeaudit_observed,
    rewrite,
)

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 16,
}


def assert_agree_deepseek(
    ref: Observed, ours: Observed, ckpt: Checkpoint, forward: dict = FORWARD, gradient: dict = GRADIENT
) -> None:
    oracle_log.record(ref, ours, ours.decisive, _same_topk(ours, ref, ours.decisive))
    torch.testing.assert_close(ours.loss, ref.loss, **forward)
    torch.testing.assert_close(ours.nll_windows_W, ref.nll_windows_W, **forward)
    torch.testing.assert_close(ours.entropy, ref.entropy, **forward)
    for i, (x, x_ref) in enumerate(zip(ours.layer_inputs, ref.layer_inputs, strict=True)):
        assert_close_activations(x, x_ref, forward, f"hidden {i}")
    assert sorted(ours.scores) == sorted(ref.scores) == list(ckpt.spec.routed_layers)
    for i in ref.scores:
        assert_close_activations(ours.moe_inputs[i], ref.moe_inputs[i], forward, f"MoE input {i}")
        assert_close_activations(ours.scores[i], ref.scores[i], forward, f"router logits {i}")  # raw
        ok = ours.decisive[i]
        assert ok.float().mean() >= 0.9, "too many near-ties to test the active sets"
        ours_topk, ours_c = _by_expert(ours.topk[i], ours.combine[i])
        ref_topk, ref_c = _by_expert(ref.topk[i], ref.combine[i])
        assert torch.equal(ours_topk[ok], ref_topk[ok]), f"layer {i}: top-k sets differ"
        torch.testing.assert_close(ours_c[ok], ref_c[ok].float(), **forward)
        torch.testing.assert_close(ours.expert_grads[i], ref.expert_grads[i], **gradient)
        for name in ("router_grads", "shared_grads", "attention_grads"):
            got, want = getattr(ours, name)[i], getattr(ref, name)[i]
            assert got == pytest.approx(want, rel=gradient["rtol"], abs=gradient["atol"]), name


def observed(ckpt: Checkpoint, tokens: torch.Tensor) -> Observed:
    """Our replay with the raw router logits (what transformers returns) as ``scores`` and the
    tokens whose active set is not within float32 noise of a tie as ``decisive``."""
    ours = moeaudit_observed(ckpt, tokens)
    result = replay(ckpt, tokens)
    ours.scores = {i: r.logits_NE if r.logits_NE is not None else r.scores_NE for i, r in result.routing.items()}
    ours.decisive = {}  # type: ignore[attr-defined]
    for i, r in result.routing.items():
        if r.margin_N is not None:
            ours.decisive[i] = r.margin_N > TIE_GAP  # type: ignore[attr-defined]
        else:
            top = r.scores_NE.topk(ckpt.spec.top_k + 1, dim=-1).values
            ours.decisive[i] = top[:, -2] - top[:, -1] > TIE_GAP  # type: ignore[attr-defined]
    return ours


def _quantize_fp8(block: tuple[int, int]):
    """DeepSeek-V3's release format: every linear weight of the decoder layers (not the router,
    norms, embeddings or LM head) as float8_e4m3fn with one float32 scale per block, the
    scale = the block's max |w| / 448 (e4m3's largest value), stored as ``weight_scale_inv``."""
    bm, bn = block

    def edit(ckpt: Checkpoint, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for key, w in tensors.items():
            if w.dim() != 2 or not key.startswith("model.layers.") or "norm" in key or key.endswith("mlp.gate.weight"):
                continue
            rows, cols = w.shape
            gr, gc = -(-rows // bm), -(-cols // bn)
            padded = torch.zeros(gr * bm, gc * bn)
            padded[:rows, :cols] = w
            amax = padded.view(gr, bm, gc, bn).abs().amax(dim=(1, 3))
            scale = (amax / 448.0).clamp_min(1e-12)
            full = scale.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
            out[key] = (w / full).to(torch.float8_e4m3fn)
            out[key + "_scale_inv"] = scale
        return out

    return edit


def _fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    rewrite(src, dst, _quantize_fp8(block))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
