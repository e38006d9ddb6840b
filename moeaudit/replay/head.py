"""The LM head of a replay and the loss's gradient into it (docs/glossary.md, "Replay": L = mean next-token NLL):
shared by the one-process replay (``replay.engine``) and the expert-parallel one
(``replay.sharded``), with ``backward_from``, the one way both push a gradient through a graph."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeaudit.checkpoint.checkpoint import Checkpoint
from moeaudit.replay.model import block_norm
from moeaudit.spec.config import ModelSpec

HEAD_CHUNK_ELEMENTS = 1 << 23  # logits rows per LM-head chunk × vocabulary (32 MB of float32)


@dataclass
class Head:
    """The LM head over all W·(T−1) predicted positions, computed in row chunks so that the
    [N, V] logits never exist at once."""

    nll_WT1: torch.Tensor
    entropy_WT1: torch.Tensor
    grad_x_WTH: torch.Tensor | None  # dL/dx of the final hidden state, when asked


def lm_head_pass(
    spec: ModelSpec,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
    x_WTH: torch.Tensor,
    tokens_WT: torch.Tensor,
    grad_nll_WT1: torch.Tensor | None,
    *,
    final_norm_bias: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
) -> Head:
    """NLL and predictive entropy per position; with ``grad_nll_WT1`` = dL/dnll also dL/dx.
    Rows are independent through the final norm, the head and the softmax, so chunking them
    changes no value; the last position of each window predicts nothing and is skipped."""
    W, T, H = x_WTH.shape
    x_RH = x_WTH[:, :-1].reshape(-1, H)
    target_R = tokens_WT[:, 1:].reshape(-1)
    nll_R, ent_R = x_RH.new_empty(x_RH.shape[0]), x_RH.new_empty(x_RH.shape[0])
    grad_RH = torch.zeros_like(x_RH) if grad_nll_WT1 is not None else None
    g_R = None if grad_nll_WT1 is None else grad_nll_WT1.reshape(-1)
    step = max(1, HEAD_CHUNK_ELEMENTS // lm_head.shape[0])
    for a in range(0, x_RH.shape[0], step):
        rows = slice(a, a + step)
        xc = x_RH[rows].detach().requires_grad_(g_R is not None)
        with torch.set_grad_enabled(g_R is not None):
            xn = block_norm(spec, xc, final_norm, final_norm_bias, spec.final_eps)
        with torch.no_grad():
            logits = F.linear(xn, lm_head, lm_head_bias).float()
            if spec.logits_scaling != 1.0:  # Granite: logits ÷ s
                logits = logits / spec.logits_scaling
            logp = torch.log_softmax(logits, dim=-1)
            tgt = target_R[rows, None]
            nll_R[rows] = -logp.gather(1, tgt).squeeze(1)  # = F.cross_entropy
            p_RV = logp.exp()
            ent_R[rows] = -(p_RV * logp).sum(-1)
            del logp
        if g_R is not None and grad_RH is not None:
            # d nll / d logits = softmax − onehot(target) (what autograd's log_softmax backward
            # forms), scaled by dL/dnll; the head's own weight gradient is never needed.
            g = g_R[rows, None]
            dlogits = p_RV.mul_(g)
            dlogits.scatter_add_(1, tgt, -g)
            if spec.logits_scaling != 1.0:
                dlogits.div_(spec.logits_scaling)
            backward_from([xn], [(dlogits @ lm_head).to(xn.dtype)])
            assert xc.grad is not None
            grad_RH[rows] = xc.grad
        del p_RV, xn, xc
    grad = None
    if grad_RH is not None:
        grad = torch.zeros_like(x_WTH)
        grad[:, :-1] = grad_RH.view(W, T - 1, H)
    return Head(nll_R.view(W, T - 1), ent_R.view(W, T - 1), grad)


def head_biases(ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The final LayerNorm's bias and the LM head's bias, where the family has them (Phi-3.5-MoE)."""
    s = ckpt.spec
    names = (["final_norm_bias"] if s.layer_norm and s.norm_bias else []) + (["lm_head_bias"] if s.lm_head_bias else [])
    return {n: ckpt.read_global(n, dtype) for n in names}


def backward_from(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(roots, grads)``, through the scalar roots Σ root ⊙ grad.

    The gradients are the same bits: d/d(root) of Σ root ⊙ g is 1·g = g exactly, and the new
    sum and product nodes all run before any node of the original graph, which then runs in
    its own order (tested bit for bit against ``torch.autograd.backward`` on mixtral, qwen2_moe
    and deepseek checkpoints). What it avoids is torch's explicit-gradient path, whose first use
    in a process imports ``torch.fx``'s symbolic shapes and with them sympy — 0.55 s (482
    modules) of every replay (docs/benchmarks.md §1e).
    """
    torch.autograd.backward([(r * g.detach()).sum() for r, g in zip(roots, grads, strict=True)])


def loss_grad(W: int, T1: int, window_weights_W: torch.Tensor | None) -> torch.Tensor:
    """dL/dnll_wt for L = mean_wt nll (or Σ_w weight_w · mean_t nll_wt), as autograd forms it."""
    if window_weights_W is None:
        return torch.ones(W, T1) / (W * T1)
    return window_weights_W.to(torch.float32)[:, None].expand(W, T1) / T1
