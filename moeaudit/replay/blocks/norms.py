"""Norms of the decoder: RMSNorm, the block norm (RMSNorm or LayerNorm) and the weightless L2 norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.spec.config import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def block_norm(
    spec: ModelSpec,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """The decoder's block and final norm: RMSNorm, or LayerNorm with a bias (Phi-3.5-MoE);
    ``eps`` the final norm's (``spec.final_eps``) where it differs from the layers' (JetMoE)."""
    eps = spec.rms_eps if eps is None else eps
    if spec.layer_norm:
        return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
    return rms_norm(x, weight, eps)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def _linear(x: torch.Tensor, p: dict[str, torch.Tensor], w: str, b: str) -> torch.Tensor:
    return F.linear(x, p[w], p.get(b))
