"""The ablation receipt of one checkpoint: the canary NLL change when one routed expert is removed
from routing, with a window-bootstrap 95 % interval (docs/decisions.md, "Ablation receipt").

ΔNLL_e = mean over windows of (NLL_w without e − NLL_w as trained): every window has the same
number of predicted tokens, so this is the change of the canary's mean next-token NLL. The
interval resamples windows (`003` §5) with the layer's own resamples, the same windows and seed
as its state receipts (``drift.bootstrap_for``), paired: both NLLs of a window move together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moeaudit.canary import Canary
from moeaudit.checkpoint.checkpoint import Checkpoint
from moeaudit.policy import ReceiptSettings
from moeaudit.receipts.drift import bootstrap_for
from moeaudit.records import AblationMeasurement, AblationRefusal, AblationRemoval
from moeaudit.replay.ablation import ablation_nll, removable
from moeaudit.replay.result import Progress


def removal_rule(spec: Any) -> str:
    """How this family's router runs with an expert removed (``replay.excluded``), in words."""
    g = spec.gate
    if g.scoring == "sparsemixer":
        first = "sparsemixer: its logit is −inf, so it is neither of the top two nor a rival in either softmax"
    elif g.scoring == "softmax":
        first = "softmax router: its logit is −inf, so it is left out of the softmax (the others renormalise)"
    else:
        first = f"{g.scoring} router: its logit is −inf, so its score is 0"
    parts = [first + (" (after the logit softcap)" if spec.moe.softcap else "")]
    parts.append("a selection bias, where the router has one, is −inf for it, so it is never chosen")
    if g.grouped:
        parts.append("groups are ranked on their remaining experts")
    parts.append(
        "top-k chooses among the rest, the chosen weights renormalised over what was chosen"
        if spec.moe.renormalise
        else "top-k chooses among the rest, the chosen weights not renormalised (as the family routes)"
    )
    return "; ".join(parts)


def ablation_receipt(
    ckpt: Checkpoint,
    canary: Canary,
    settings: ReceiptSettings,
    removals: Mapping[int, Sequence[int]],
    *,
    device: str | None = None,
    progress: Progress | None = None,
) -> AblationMeasurement:
    """NLL as trained, each removal's ΔNLL and interval, the layers refused and the cost."""
    spec = ckpt.spec
    refused: list[AblationRefusal] = []
    todo: dict[int, list[int]] = {}
    for layer, experts in sorted(removals.items()):
        why = removable(spec, layer)
        if why is not None:
            refused.append({"layer": layer, "reason": why})
        elif experts:
            todo[layer] = sorted(set(experts))
    result = ablation_nll(ckpt, canary.tokens, todo, device=device, progress=progress) if todo else None
    rows: list[AblationRemoval] = []
    for (layer, e), removed_W in sorted(result.removed_W.items() if result is not None else []):
        assert result is not None
        delta_W = removed_W - result.base_W
        boot = bootstrap_for(settings, canary.num_windows, layer)
        ci = boot.ratio(delta_W, torch.ones_like(delta_W))
        rows.append(
            {
                "layer": layer,
                "expert": e,
                "nll": float(removed_W.mean()),
                "nll_delta": float(delta_W.mean()),
                "ci95": ci,
            }
        )
    ckpt.verify_unchanged()  # what was read is what was hashed
    return {
        "removal": removal_rule(spec),
        "nll": None if result is None else float(result.base_W.mean()),
        "experts": rows,
        "refused": refused,
        "cost": {
            "layer_forwards": 0 if result is None else result.layer_forwards,
            "replay_layer_forwards": spec.num_layers,
        },
    }
