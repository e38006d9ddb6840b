"""Hyper-connections (``spec.blocks.HyperConnection``): HY-V4's several residual streams, DeepSeek-V4's
manifold-constrained ones (Sinkhorn)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from moeaudit.spec.config import ModelSpec


class HCWrite(NamedTuple):
    """How a hyper-connection writes a sub-block's output f back onto the streams: x_s + post_s · f
    (HY-V4), or, with a residual mixing matrix (DeepSeek-V4's mHC), Σ_j comb_js x_j + post_s · f."""

    post_BTS: torch.Tensor
    comb_BTSS: torch.Tensor | None = None


def sinkhorn(comb_BTSS: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """DeepSeek-V4's projection of softmax(·, rows) + ε onto doubly-stochastic matrices, as
    ``DeepseekV4HyperConnection`` does it: the columns normalised once, then ``iters`` − 1 times
    the rows then the columns, each sum + ε."""
    comb = comb_BTSS / (comb_BTSS.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mix(
    spec: ModelSpec, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, x_BTSH: torch.Tensor, head: bool = False
) -> tuple[HCWrite | None, torch.Tensor]:
    """A hyper-connection's read (transformers' ``HYV4HyperConnection`` / ``DeepseekV4HyperConnection``,
    in float32): logits W_fn · flat(x) / rms(flat(x)) from the S streams flattened, pre = σ(logit·scale
    + base) + ε, the sub-block's input Σ_s pre_s x_s (in x's dtype); post = magnitude · σ(·) + ε from
    the next S logits. ``HyperConnection.sinkhorn_iters`` > 0 (DeepSeek-V4): post = magnitude · σ(·) without
    ε, and the last S² logits give the residual mixing matrix comb = Sinkhorn(softmax(logit·scale +
    base) + ε). ``head``: the final hyper head, pre only (no write)."""
    hc = spec.hc
    assert hc is not None
    S, eps = hc.streams, hc.eps
    flat = x_BTSH.flatten(-2).float()
    mixes = F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + spec.rms_eps)
    write = None
    if head:
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    elif hc.sinkhorn_iters:
        pre_l, post_l, comb_l = mixes.split([S, S, S * S], dim=-1)
        pre_b, post_b, comb_b = base.float().split([S, S, S * S], dim=-1)
        pre_s, post_s, comb_s = scale.float().unbind(0)
        pre = torch.sigmoid(pre_l * pre_s + pre_b) + eps
        post = hc.magnitude * torch.sigmoid(post_l * post_s + post_b)
        logits = comb_l.unflatten(-1, (S, S)) * comb_s + comb_b.view(S, S)
        comb = torch.softmax(logits, dim=-1) + eps
        write = HCWrite(post, sinkhorn(comb, hc.sinkhorn_iters, eps))
    else:
        pre_b, post_b = base.split(S, dim=-1)
        pre_s, post_s = scale.unbind(0)
        pre_l, post_l = mixes.split(S, dim=-1)
        pre = torch.sigmoid(pre_l * pre_s + pre_b) + eps
        write = HCWrite(hc.magnitude * torch.sigmoid(post_l * post_s + post_b) + eps)
    return write, (pre.unsqueeze(-1) * x_BTSH).sum(dim=-2).to(x_BTSH.dtype)


def hc_add(write: HCWrite, out_BTH: torch.Tensor, x_BTSH: torch.Tensor) -> torch.Tensor:
    """A sub-block's output onto every stream: x_s + post_s · f, in float32, back in x's dtype; with
    a mixing matrix (DeepSeek-V4), Σ_j comb_js x_j + post_s · f in x's dtype, as transformers does."""
    if write.comb_BTSS is not None:
        dt = x_BTSH.dtype
        mixed = torch.matmul(write.comb_BTSS.to(dt).transpose(-1, -2), x_BTSH)
        return write.post_BTS.to(dt).unsqueeze(-1) * out_BTH.to(dt).unsqueeze(-2) + mixed
    post_BTS = write.post_BTS
    return (post_BTS.float().unsqueeze(-1) * out_BTH.float().unsqueeze(-2) + x_BTSH.float()).to(x_BTSH.dtype)
