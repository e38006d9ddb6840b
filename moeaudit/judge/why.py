"""A gate's reason in a few words: the quantity that made it what it is. Torch-free.

Shared by the certify gate table's "why" column and the verdict's reason, so that an INCONCLUSIVE
or FAIL verdict on a YELLOW or RED gate names what narrowed, fell or went below a floor, not
only the step (docs/decisions.md, "The verdict names what made a gate bad").
"""

from __future__ import annotations

from typing import Any

from moeaudit.records import GateEntry


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def why(g: GateEntry) -> str:
    """The quantity that made a gate what it is, short: each occupancy quantity below its floor
    beyond noise, C2 fallen (and on which protected layers), a health floor, the canary NLL
    worsening; for a GREEN gate with C2 fallen, the atlas motion that kept it GREEN."""
    st = g.get("structural") or g.get("continuity")
    out = []
    if st is not None:
        for name, layers in (st.get("below_floor") or {}).items():
            value = st.get("pi_min_ratio" if name.startswith("π") else "entropy_ratio")
            out.append(f"{name} {_fmt(value, '.2f')}{_on(layers)}")
        if st.get("layers_with_more_dead"):
            out.append(f"more dead{_on(st['layers_with_more_dead'])}")
        if not st.get("c2_ok", True):
            fell = f"C2 fell {_fmt(st.get('c2_min_delta'), '+.3f')}{_on(st.get('c2_fallen_layers'))}"
            claims = g.get("claims")
            atlas = any(c.startswith("atlas motion") for c in (claims or {}).get("licensed", []))
            out.append(fell + (", atlas motion" if atlas else ""))
    for f in (g.get("health") or {}).get("failed", [])[:2]:
        value = f.get("value")
        shown = _fmt(value, ".3g") if isinstance(value, (int, float)) else "—"
        out.append(f"{f['what']} {shown} < floor{_on([f['layer']])}")
    if g.get("scalar") == "worsening" and g.get("status") in ("YELLOW", "RED"):
        out.append("canary NLL worsening")
    return "; ".join(out) or ("—" if g.get("status") in ("GREEN", "BASELINE") else "")


def _on(layers: Any) -> str:
    return f" (L{','.join(map(str, layers))})" if layers else ""
