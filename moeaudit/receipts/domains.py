"""The canary's windows of each domain: what the per-domain NLL (``receipts.state``) and the
domain gradient conflict (``receipts.conflict``) are taken over."""

from __future__ import annotations

import torch

from moeaudit.canary import Canary


def domain_windows(canary: Canary) -> list[torch.Tensor]:
    """Window indices (int64, ascending) of each domain id, from one stable sort: O(W log W),
    where a mask per domain is O(D·W)."""
    ids_W = canary.domain_ids.long()
    sizes = torch.bincount(ids_W, minlength=len(canary.domains)).tolist()
    return list(torch.sort(ids_W, stable=True).indices.split(sizes))
