"""Experts removed from routing, for the ablation receipt (docs/decisions.md, "Ablation receipt").

One context variable holds a boolean mask [E] of the experts the router may not choose while a
layer is recomputed; :func:`exclude` applies it inside the family's routing rule
(``replay.model.route``), after any softcap and before any softmax, score or selection:

* the removed expert's router logit is −inf: softmax routers exclude it from the softmax (its
  probability is exactly 0 and the others' renormalise over the remaining experts); sigmoid
  and √softplus routers give it score 0;
* a selection bias (DeepSeek-V3's correction bias, ERNIE's) is −inf for it too, so a biased
  score cannot pick it; group-limited routers rank groups on what is left of each group;
* top-k then chooses among the remaining experts, and the family's own renormalisation of the
  chosen weights (``MoE.renormalise``) runs over what was chosen, as the family routes.

Nothing here imports the decoder: ``replay.model`` reads the mask in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

EXCLUDED: ContextVar[torch.Tensor | None] = ContextVar("moeaudit_excluded_experts", default=None)


@contextlib.contextmanager
def excluded(mask_E: torch.Tensor | None) -> Iterator[None]:
    """Route with the experts ``mask_E`` marks removed (None: every expert, as trained)."""
    token = EXCLUDED.set(mask_E)
    try:
        yield
    finally:
        EXCLUDED.reset(token)


def exclude(logits_NE: torch.Tensor, bias_E: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, selection bias) with the removed experts at −inf; unchanged when none is removed."""
    mask = EXCLUDED.get()
    if mask is None:
        return logits_NE, bias_E
    mask = mask.to(logits_NE.device)
    logits_NE = logits_NE.masked_fill(mask, float("-inf"))
    return logits_NE, None if bias_E is None else bias_E.float().masked_fill(mask.to(bias_E.device), float("-inf"))
