"""Which keys a sparse-attention indexer keeps: the ``k`` best-scoring, exact ties at the cut
broken by position (the earlier key wins), on every device.

``torch.topk`` leaves ties unordered, and its CPU and CUDA kernels break them differently, so
a query whose k-th and (k+1)-th best keys score the same would see different keys on different
devices (docs/decisions.md, "DSA key selection"). Lightning-indexer scores
``Σ_h w_h · ReLU(q_h · k)`` are exactly zero wherever every head's ReLU is, so such ties are
common with few indexer heads. The rule here keeps every key scoring above the k-th best score
and, of those scoring exactly the k-th best, the earliest ones until k are kept: topk's own
selection whenever the cut is not tied. It compares scores only by ``>`` and ``==``, so it
does not depend on how a backend orders −0.0 and +0.0 either (torch's CPU and CUDA sorts are
known to treat the two differently); NaN counts as +∞, as topk and sort rank it first.

Shape suffixes: B batch (any leading dims), S scored keys, K kept.
"""

from __future__ import annotations

import torch


def keep_best(scores_BS: torch.Tensor, k: int) -> torch.Tensor:
    """bool [..., S]: the ``k`` best keys of each row of ``scores_BS`` (all of them where
    S ≤ k, none where k = 0), exact ties at the cut resolved in favour of the earlier key."""
    S = scores_BS.shape[-1]
    if S <= k or k < 1:
        return torch.full_like(scores_BS, k >= 1, dtype=torch.bool)
    inf = torch.tensor(float("inf"), dtype=scores_BS.dtype, device=scores_BS.device)
    s = torch.where(scores_BS.isnan(), inf, scores_BS)
    kth_B1 = s.topk(k, dim=-1).values[..., -1:]  # the k-th best score, whichever key holds it
    above = s > kth_B1
    tied = s == kth_B1
    room_B1 = k - above.sum(-1, keepdim=True)  # ≥ 1: at most k − 1 keys beat the k-th best
    return above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room_B1))
