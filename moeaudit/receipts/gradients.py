"""Per-expert gradient receipts (`000` Def. 6.1–6.2)."""

from __future__ import annotations

from typing import Any

import torch


def grad_stats(g_E: torch.Tensor) -> dict[str, float]:
    """var_grad = (1/E) Σ (g_e − ḡ)² (population variance) and its scale-free form / ḡ²."""
    g = g_E.double()
    mean = float(g.mean())
    var = float(((g - mean) ** 2).mean())
    return {
        "grad_mean": mean,
        "var_grad": var,
        "var_grad_norm": var / mean**2 if mean > 0 else float("nan"),
    }


def gradients(g_E: torch.Tensor, router: float, shared: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"grad_norms": g_E.double().tolist(), **grad_stats(g_E)}
    out["router_grad_norm"] = router
    if shared is not None:
        out["shared_grad_norm"] = shared
    return out
