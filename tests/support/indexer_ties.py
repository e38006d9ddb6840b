"""transformers' sparse-attention indexers with their key top-k watched, or replaced by the
replay's rule (docs/decisions.md, "DSA key selection: ties broken by position, on every device").

transformers' indexers end in ``index_scores.topk(k, dim=-1)``, which leaves exact ties at the
cut to the kernel: on the CPU it does not keep the earliest of tied keys. The replay keeps the
earliest on every device, so where a probe's scores tie at the cut the two select different keys
and only an oracle that breaks the ties by the same rule can be compared with it exactly.
:func:`watch_indexers` counts the tied cuts transformers' indexers meet (so a test comparing with
unpatched transformers can assert it meets none) and, with ``by_position``, breaks them as the
replay does — implemented here independently of the replay, by a stable descending sort.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

# (module, class) of every lightning indexer the oracle tests run; each ends in one Tensor.topk
INDEXERS = (
    ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Indexer"),
    ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaIndexer"),
    ("transformers.models.hy_v4.modeling_hy_v4", "HYV4Indexer"),
    ("transformers.models.hy_v4_vl.modeling_hy_v4_vl", "HYV4VLIndexer"),
    ("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Indexer"),
)


@dataclass
class TopkLog:
    """What the indexers' top-k met: calls, and rows whose cut falls inside a run of equal
    scores of keys the query may read."""

    calls: int = 0
    tied_cuts: int = 0


def tied_cuts(scores: torch.Tensor, k: int) -> int:
    """Rows whose k-th and (k+1)-th best scores are equal and not masked (masked keys score
    −inf, or float32's lowest value plus a score, as transformers' additive causal mask makes them)."""
    if scores.shape[-1] <= k:
        return 0
    best = scores.sort(dim=-1, descending=True).values
    kth, nxt = best[..., k - 1], best[..., k]
    return int(((kth == nxt) & (kth > torch.finfo(scores.dtype).min / 2)).sum())


def position_topk(scores: torch.Tensor, k: int) -> Any:
    """``scores.topk(k, dim=-1)`` with exact ties going to the earlier key: the first k of a
    stable descending sort, −0.0 made +0.0 first (so no backend can order the two apart)."""
    order = (scores + 0.0).sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.return_types.topk([scores.gather(-1, order), order])


def watch_indexers(monkeypatch: pytest.MonkeyPatch, by_position: bool) -> TopkLog:
    """Wrap every indexer's forward so that the ``Tensor.topk`` inside it is counted (and, with
    ``by_position``, replaced by :func:`position_topk`); return the running tally."""
    log = TopkLog()
    plain = torch.Tensor.topk

    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        assert dim in (-1, self.dim() - 1) and largest
        log.calls += 1
        log.tied_cuts += tied_cuts(self, k)
        return position_topk(self, k) if by_position else plain(self, k, dim=dim)

    for module, name in INDEXERS:
        cls = getattr(importlib.import_module(module), name)
        monkeypatch.setattr(cls, "forward", _with_topk(cls.forward, topk, plain))
    return log


def _with_topk(forward: Any, topk: Any, plain: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        torch.Tensor.topk = topk  # type: ignore[method-assign]
        try:
            return forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = plain  # type: ignore[method-assign]

    return wrapped
