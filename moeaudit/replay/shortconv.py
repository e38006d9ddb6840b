"""LFM2's short convolution mixer (``Lfm2ShortConv``), as transformers' sequence path computes it:

    B | C | x = W_in · norm(x)           (three chunks of H channels, optional bias)
    y = C ⊙ conv(B ⊙ x)                  (causal depthwise conv over time, kernel L, optional bias)
    out = W_out · y                      (optional bias)

The convolution is ``F.conv1d`` with L − 1 zeros of left padding per window (transformers'
``causal_conv1d_fn`` fallback), so each position sees itself and the L − 1 before it; there is no
activation. Canonical names: ``conv_in`` [3H, H], ``conv_w`` [H, 1, L], ``conv_out`` [H, H] and
their biases (``SHORT_CONV_NAMES``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(p: dict[str, torch.Tensor], x_BTH: torch.Tensor) -> torch.Tensor:
    """The mixer's output for the normed input ``x_BTH``."""
    T = x_BTH.shape[1]
    b, c, x = F.linear(x_BTH, p["conv_in"], p.get("conv_in_bias")).chunk(3, dim=-1)
    w = p["conv_w"]  # [H, 1, L]
    h_BHT = (b * x).transpose(1, 2)
    conv = F.conv1d(h_BHT, w, p.get("conv_bias"), padding=w.shape[-1] - 1, groups=w.shape[0])[..., :T]
    return F.linear(c * conv.transpose(1, 2), p["conv_out"], p.get("conv_out_bias"))
