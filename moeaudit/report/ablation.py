"""The certificate's ablation section (``certify --ablate``; docs/decisions.md, "Ablation receipt"):
per removed expert its occupancy, the canary NLL change with it removed from routing and the 95 %
window-bootstrap interval, and what that says — "rarely used but needed" or "unused and not needed"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeaudit.records import AblationReceipt
from moeaudit.report.svg import sig

Doc = Mapping[str, Any]


def ablation_view(receipt: AblationReceipt | None) -> dict[str, Any] | None:
    """The rows and sentences the template shows; None without the receipt (the section is absent)."""
    if not receipt:
        return None
    rows = []
    for e in receipt.get("experts") or []:
        ci = e.get("ci95")
        rows.append(
            {
                "layer": str(e.get("layer")),
                "expert": str(e.get("expert")),
                "flags": ", ".join(e.get("flags") or []) or "—",
                "pi": sig(e.get("pi")),
                "delta": sig(e.get("nll_delta")),
                "ci": f"[{sig(ci[0])}, {sig(ci[1])}]" if ci else "—",
                "reading": str(e.get("reading") or "—"),
                "needed": str(e.get("reading") or "").endswith("and needed") or "but needed" in str(e.get("reading")),
            }
        )
    cost = receipt.get("cost") or {}
    return {
        "mode": str(receipt.get("mode") or "—"),
        "checkpoint": str(receipt.get("checkpoint") or "—"),
        "flag_rule": str(receipt.get("flag_rule") or ""),
        "removal": str(receipt.get("removal") or ""),
        "nll": sig(receipt.get("nll"), 5),
        "rows": rows,
        "sentences": [str(s) for s in receipt.get("sentences") or []],
        "cost": f"{cost.get('layer_forwards', '—')} decoder-layer forwards "
        f"(one forward of the canary is {cost.get('replay_layer_forwards', '—')})",
    }
