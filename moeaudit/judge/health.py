"""Absolute health floors of one checkpoint, and what its canary can resolve of them. Torch-free.

Every checkpoint, baselines included, is held to floors on every routed layer: dead experts
(no token routed to one, `003` Eq. 17, or no canary gradient reaching it), π_min against the
uniform share k/E, and the normalised load entropy (docs/policy.md, "The rules in one place").

A zero count is a reading of the canary, not of the router: an expert that holds a healthy share
can still receive none of N canary tokens. When an expert sitting exactly at the π_min floor would
receive no canary token more than 5 % of the time, the canary cannot tell a dead expert from a
live one at the floor, nor read π_min against the floor: those readings are *unresolved* — the
health check is INCONCLUSIVE on them, never FAIL, and they do not make a gate bad; nor does a
reading above the floors clear them there (:data:`NOT_RESOLVED`: never PASS). N counts distinct
token contexts (docs/decisions.md, "A canary of repeated content"). The entropy floor likewise,
where the canary's tokens read even a balanced router's H_norm too low to tell
(:class:`EntropyResolution`). An expert routed loss-bearing tokens that receives no gradient (zero
weights, severed) is exact evidence at any canary size; each window's last token bears no loss,
so the receipts count the others (``loss_bearing_counts``; without them, more routed tokens than
the canary has windows) (docs/decisions.md, "A canary too small for its experts").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from moeaudit.policy import GateSettings
from moeaudit.records import Health, HealthFailure, Receipts, ReceiptsLayer

# Share of the layer's mean canary gradient below which an expert counts as receiving none. Zero
# weights give exactly zero gradient (every factor of a (gated) MLP's weight gradient is 0), as
# does an expert no token reaches; 1e-6 of the mean leaves float noise no room to hide one.
NO_GRADIENT_SHARE = 1e-6

# The largest chance that an expert at the π_min floor receives no canary token for which a zero
# count still counts as a dead expert (and π_min is read against its floor).
FLOOR_MISS_CHANCE: Final = 0.05

NOT_RESOLVED: Final = (
    "every layer: the canary does not resolve the dead-expert and π_min floors, so no reading clears them"
)


def silent_experts(entry: ReceiptsLayer, windows: int = 0) -> list[int]:
    """Experts routed tokens that receive no canary gradient at this checkpoint: zero weights, or
    an expert severed from the loss. The replay sees them even when routing does not.

    The last position of each of the canary's ``windows`` predicts nothing, so no gradient
    reaches what it routes to: a zero gradient is evidence only for an expert routed a token whose
    output the loss reads — counted exactly where the receipts hold ``loss_bearing_counts``, else
    known only for an expert routed more than ``windows`` tokens."""
    grads = (entry.get("gradients") or {}).get("grad_norms")
    bearing = entry["occupancy"].get("loss_bearing_counts")
    counts, windows = (bearing, 0) if bearing is not None else (entry["occupancy"].get("counts") or [], windows)
    if not grads or any(x is None for x in grads):
        return []
    mean = sum(grads) / len(grads)
    if not mean > 0:
        return []
    return [e for e, x in enumerate(grads) if x <= NO_GRADIENT_SHARE * mean and e < len(counts) and counts[e] > windows]


def dead_experts(entry: ReceiptsLayer, windows: int = 0) -> list[int]:
    """Every dead expert of a layer at this checkpoint: no token routed to it (`003` Eq. 17), or
    no canary gradient reaching it (:func:`silent_experts`). Zero share is not the only death."""
    counts = entry["occupancy"].get("counts")
    routed_dead = [e for e, c in enumerate(counts) if c == 0] if counts is not None else []
    if counts is None and entry["occupancy"].get("dead"):
        return list(range(entry["occupancy"]["dead"]))  # a count without the vector: as many
    return sorted(set(routed_dead) | set(silent_experts(entry, windows)))


def canary_windows(doc: Receipts) -> int:
    """W, the canary's windows: as many of its tokens (each window's last) predict nothing."""
    return int((doc.get("canary") or {}).get("windows") or 0)


def canary_tokens(doc: Receipts) -> int | None:
    """N = W·T, the canary tokens every routed layer's receipts are over."""
    k = doc["checkpoint"].get("top_k")
    counts = doc["layers"][0]["occupancy"].get("counts") if doc["layers"] else None
    return sum(counts) // k if k and counts else None


def resolution_tokens(doc: Receipts) -> int | None:
    """The canary tokens the floors' resolution counts: N, or fewer where contexts repeat (a
    repeated context routes the same way, so it is no further draw of the router's input; the
    receipts' ``canary.distinct_contexts``, moeaudit/canary_units.py)."""
    n = canary_tokens(doc)
    distinct = (doc.get("canary") or {}).get("distinct_contexts")
    return n if n is None or distinct is None else min(n, int(distinct))


@dataclass(frozen=True)
class FloorResolution:
    """What N canary tokens resolve of the occupancy floors of a layer with E experts, top-k."""

    tokens: int  # N
    share: float  # an expert at the π_min floor: floor_pi_share·k/E of the tokens (k/E with no floor)
    chance: float  # (1 − share)^N: such an expert receives no canary token
    needed: int  # the fewest tokens at which that chance is at most FLOOR_MISS_CHANCE

    @property
    def resolved(self) -> bool:
        return self.chance <= FLOOR_MISS_CHANCE

    def sentence(self) -> str:
        return (
            f"an expert at the π_min floor ({self.share:.3g} of the tokens) expects {self.share * self.tokens:.2g} "
            f"of the canary's {self.tokens} distinct token contexts and receives none {self.chance:.0%} of the time; "
            f"a canary of at least {self.needed} tokens resolves the floors"
        )


def floor_resolution(doc: Receipts, g: GateSettings) -> FloorResolution | None:
    """The canary's resolution of this checkpoint's occupancy floors, or None where the receipts
    do not say E, k or N (then every reading counts, as it always did). Each canary token routes
    to k of E experts, so an expert at share s misses all N tokens with chance (1 − s)^N."""
    ck = doc["checkpoint"]
    E, k, n = ck.get("experts"), ck.get("top_k"), resolution_tokens(doc)
    if not E or not k or not n:
        return None
    if k >= E:  # every expert on every token: no count can be zero
        return FloorResolution(n, 1.0, 0.0, 1)
    share = min(1.0, (g.floor_pi_share or 1.0) * k / E)
    if share >= 1.0:
        return FloorResolution(n, share, 0.0, 1)
    chance = math.exp(n * math.log1p(-share))
    needed = math.ceil(math.log(FLOOR_MISS_CHANCE) / math.log1p(-share))
    return FloorResolution(n, share, chance, needed)


@dataclass(frozen=True)
class EntropyResolution:
    """What N canary tokens resolve of the load-entropy floor of a layer with E experts, top-k.

    The plug-in entropy of n = N·k routed slots reads a balanced router low by about
    (E − 1)/(2n), Miller–Madow's bias, and never above ln n when n < E: in H_norm units the
    ``deficit`` is the larger of (E − 1)/(2n ln E) and 1 − ln n / ln E. The canary resolves
    the floor when that deficit is at most half the floor's headroom 1 − floor: a balanced router
    then reads well above the floor, and a reading below it is evidence (docs/decisions.md, "A
    canary too small for its experts")."""

    tokens: int  # N
    deficit: float  # how far below 1 a balanced router's H_norm reads on N tokens
    headroom: float  # 1 − floor_entropy_norm
    needed: int  # the fewest tokens at which the deficit is at most half the headroom

    @property
    def resolved(self) -> bool:
        return self.deficit <= self.headroom / 2

    def sentence(self) -> str:
        return (
            f"a balanced router's load entropy reads about {self.deficit:.2g} below 1 on the canary's "
            f"{self.tokens} distinct token contexts, more than half the floor's headroom {self.headroom:.3g}; "
            f"a canary of at least {self.needed} tokens resolves it"
        )


def entropy_resolution(doc: Receipts, g: GateSettings) -> EntropyResolution | None:
    """The canary's resolution of the H_norm floor, or None where the receipts do not say E, k
    or N, or no floor applies (then every reading counts)."""
    ck = doc["checkpoint"]
    E, k, n = ck.get("experts"), ck.get("top_k"), resolution_tokens(doc)
    headroom = 1.0 - g.floor_entropy_norm
    if not E or not k or not n or not headroom > 0:
        return None
    if k >= E:  # every expert on every token: the load is exactly uniform
        return EntropyResolution(n, 0.0, headroom, 1)
    slots, lnE = n * k, math.log(E)
    deficit = max((E - 1) / (2 * slots * lnE), 1 - math.log(slots) / lnE if slots < E else 0.0)
    needed = math.ceil(max(E, (E - 1) / (headroom * lnE)) / k)
    return EntropyResolution(n, deficit, headroom, needed)


def counted_dead(entry: ReceiptsLayer, res: FloorResolution | None, windows: int = 0) -> list[int]:
    """The dead experts a floor or a comparison counts: every one where the canary resolves the
    floors, else only those with no gradient (exact at any canary size)."""
    return dead_experts(entry, windows) if res is None or res.resolved else silent_experts(entry, windows)


def health(doc: Receipts, g: GateSettings) -> Health:
    """Absolute floors of one checkpoint: dead experts ≤ floor_dead_fraction·E, π_min ≥
    floor_pi_share·k/E (the uniform share), H_norm ≥ floor_entropy_norm, on every routed layer.
    ``failed`` holds each failure as {layer, what, value, threshold} for scripts; ``unresolved``
    (only when there are any) the dead-expert, π_min and H_norm readings below a floor that the
    canary cannot resolve (:func:`floor_resolution`, :func:`entropy_resolution`)."""
    ck = doc["checkpoint"]
    E, k = ck.get("experts"), ck.get("top_k")
    res, ent, W = floor_resolution(doc, g), entropy_resolution(doc, g), canary_windows(doc)
    problems: list[str] = []
    failed: list[HealthFailure] = []
    unresolved: list[str] = []
    for entry in doc["layers"]:
        o, layer = entry["occupancy"], entry["layer"]
        dead_max = int(g.floor_dead_fraction * E) if E else 0
        dead, silent, counted = dead_experts(entry, W), silent_experts(entry, W), counted_dead(entry, res, W)
        if len(counted) > dead_max:
            starved = (
                f"; starved: expert(s) {', '.join(map(str, silent))} routed tokens but receive no canary "
                "gradient (zero weights or severed)"
                if silent
                else ""
            )
            problems.append(f"layer {layer}: {len(counted)} dead expert(s) (floor: at most {dead_max}){starved}")
            failed.append({"layer": layer, "what": "dead experts", "value": len(counted), "threshold": dead_max})
        elif len(dead) > dead_max:
            unseen = [e for e in dead if e not in silent]
            unresolved.append(
                f"layer {layer}: expert(s) {', '.join(map(str, unseen))} received no canary token "
                f"(floor: at most {dead_max} dead)"
            )
        share = None if o["pi_min"] is None or not E or not k else o["pi_min"] * E / k
        if share is None or (share < g.floor_pi_share and (res is None or res.resolved)):
            shown = "unknown" if share is None else f"{share:.3f}"
            problems.append(f"layer {layer}: π_min is {shown} of the uniform share k/E (floor {g.floor_pi_share})")
            failed.append({"layer": layer, "what": "π_min share of k/E", "value": share, "threshold": g.floor_pi_share})
        elif share < g.floor_pi_share:
            unresolved.append(f"layer {layer}: π_min is {share:.3f} of k/E (floor {g.floor_pi_share})")
        h = o["entropy_norm"]
        if h is None or (h < g.floor_entropy_norm and (ent is None or ent.resolved)):
            shown = "unknown" if h is None else f"{h:.3f}"
            problems.append(f"layer {layer}: H_norm {shown} (floor {g.floor_entropy_norm})")
            failed.append({"layer": layer, "what": "H_norm", "value": h, "threshold": g.floor_entropy_norm})
        elif h < g.floor_entropy_norm:
            unresolved.append(f"layer {layer}: H_norm {h:.3f} (floor {g.floor_entropy_norm})")
    if res is not None and not res.resolved and not any("H_norm" not in u for u in unresolved):
        # no reading below the floors, but none above them is evidence either: an expert at the π_min
        # floor would read zero as often as not, so the canary cannot say that usage clears them
        unresolved.append(NOT_RESOLVED)
    out: Health = {"ok": not problems, "problems": problems, "failed": failed}
    if unresolved:
        out["unresolved"] = unresolved
        out["resolution"] = "; ".join(r.sentence() for r in (res, ent) if r is not None and not r.resolved)
    return out
