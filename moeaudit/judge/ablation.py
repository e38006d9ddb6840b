"""Which experts the ablation receipt removes, and what its numbers say (docs/decisions.md,
"Ablation receipt"). Torch-free: the replay is :mod:`moeaudit.receipts.ablation`.

Unused is not unneeded: an interventional study (arXiv 2606.10703) found no routing-occupancy
metric that predicts an expert's causal importance, so the occupancy floors name candidates and
the canary NLL with the expert removed from routing says whether each is needed. Reported, not
gated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from moeaudit.judge.health import canary_windows, dead_experts, silent_experts
from moeaudit.records import AblationExpert, AblationMeasurement, AblationReceipt, Receipts

Mode = Literal["low-occupancy", "all"]
MODES: tuple[Mode, ...] = ("low-occupancy", "all")

RARELY_NEEDED = "rarely used but needed"
RARELY_UNNEEDED = "unused and not needed"
# the interval holds 0 but also a rise beyond the resolution: the data do not show it is needed,
# nor that it is not (a rarely used expert is not "unused" on that evidence)
RARELY_UNSHOWN = "rarely used, not shown to be needed"
USED_NEEDED = "used and needed"
USED_UNNEEDED = "used but not needed"
USED_UNSHOWN = "used, not shown to be needed"

FLAG_RULE = (
    "an expert of a routed layer is flagged when it is dead (no canary token routed to it, or routed "
    "tokens but no canary gradient reaching it) or its share of the canary's routed slots is below the "
    "π floor of the health gate: π_e · E/k < gates.floor_pi_share"
)


def flagged_experts(doc: Receipts, floor_pi_share: float) -> dict[int, dict[int, list[str]]]:
    """Routed layer → flagged expert → why (``"no token"``, ``"no gradient"``, ``"π below floor"``)
    in the receipts document of one checkpoint: the experts the health floors count against a
    layer (``judge.health.health``: dead experts, π_min share of k/E), each expert by its own π."""
    ck = doc["checkpoint"]
    E, k, W = ck.get("experts"), ck.get("top_k"), canary_windows(doc)
    out: dict[int, dict[int, list[str]]] = {}
    for entry in doc["layers"]:
        counts = entry["occupancy"].get("counts") or []
        pi = entry["occupancy"].get("pi") or []
        silent = set(silent_experts(entry, W))
        why: dict[int, list[str]] = {}
        for e in dead_experts(entry, W):
            why.setdefault(e, []).append("no gradient" if e in silent else "no token")
        if E and k:
            for e, p in enumerate(pi):
                if p is not None and p * E / k < floor_pi_share and (e >= len(counts) or counts[e] > 0):
                    why.setdefault(e, []).append("π below floor")
        if why:
            out[int(entry["layer"])] = {e: why[e] for e in sorted(why)}
    return out


def removals(
    doc: Receipts, mode: Mode, floor_pi_share: float
) -> tuple[dict[int, list[int]], dict[int, dict[int, list[str]]]]:
    """(routed layer → experts to remove, the flags): the flagged experts, or with ``all``
    every expert of every routed layer."""
    flags = flagged_experts(doc, floor_pi_share)
    if mode == "low-occupancy":
        return {layer: sorted(f) for layer, f in flags.items()}, flags
    E = int(doc["checkpoint"].get("experts") or 0)
    return {int(entry["layer"]): list(range(E)) for entry in doc["layers"]}, flags


# Below this a change of the canary's mean NLL is float32 rounding, not an effect: an expert the
# router never chooses still moves a plain softmax's other probabilities in their last bits when it
# leaves the softmax (≈ 1e-8 nats on the samples, always one sign in some windows).
NLL_RESOLUTION = 1e-6


def needed(delta: float | None, ci95: Sequence[float] | None) -> bool | None:
    """Removing the expert raises the canary NLL beyond the window-bootstrap noise: the whole 95 %
    interval above 0 — above :data:`NLL_RESOLUTION` (without an interval, bootstrap 0: the point
    change). None: no number."""
    if ci95 is not None:
        return ci95[0] > NLL_RESOLUTION
    return None if delta is None else delta > NLL_RESOLUTION


def not_needed(delta: float | None, ci95: Sequence[float] | None) -> bool:
    """Removing the expert does not raise the canary NLL beyond :data:`NLL_RESOLUTION` anywhere in
    its 95 % interval (without an interval: the point change)."""
    if ci95 is not None:
        return ci95[1] <= NLL_RESOLUTION
    return delta is not None and delta <= NLL_RESOLUTION


def reading(flagged: bool, is_needed: bool | None, is_not_needed: bool = True) -> str:
    """The expert's reading: needed (the whole interval above the resolution), not needed (the
    whole interval at or below it), else not shown either way."""
    if is_needed is None:
        return "not measured"
    if flagged:
        return RARELY_NEEDED if is_needed else RARELY_UNNEEDED if is_not_needed else RARELY_UNSHOWN
    return USED_NEEDED if is_needed else USED_UNNEEDED if is_not_needed else USED_UNSHOWN


def _expert(e: AblationExpert) -> str:
    return f"layer {e['layer']} expert {e['expert']}"


def sentences(receipt: AblationReceipt) -> list[str]:
    """Plain sentences over an ablation receipt: the flagged experts that are needed (rarely used
    but needed), those that are not (unused and not needed), and any layer it could not remove from."""
    experts = receipt.get("experts") or []
    out: list[str] = []
    flagged = [e for e in experts if e.get("flagged")]
    if receipt.get("mode") == "low-occupancy" and not flagged:
        out.append("No expert is flagged by the occupancy floors at this checkpoint: nothing was removed.")
    verbs = {
        RARELY_NEEDED: "raises the canary NLL beyond its 95 % window-bootstrap interval",
        RARELY_UNNEEDED: "does not raise the canary NLL anywhere in its 95 % window-bootstrap interval",
        RARELY_UNSHOWN: "changes the canary NLL by less than its 95 % window-bootstrap interval can tell",
    }
    for label, verb in verbs.items():
        hit = [e for e in flagged if e.get("reading") == label]
        if hit:
            shown = "; ".join(f"{_expert(e)} (ΔNLL {_signed(e.get('nll_delta'))})" for e in hit)
            out.append(f"{label.capitalize()}: {shown} — removing each from routing {verb}.")
    used = [e for e in experts if not e.get("flagged")]
    if used:
        n_needed = sum(1 for e in used if e.get("reading") == USED_NEEDED)
        out.append(f"Of {len(used)} experts not flagged, {n_needed} raise the canary NLL when removed.")
    for r in receipt.get("refused") or []:
        out.append(f"Not removed on layer {r['layer']}: {r['reason']}.")
    return out


def _signed(x: Any) -> str:
    return "—" if x is None else f"{x:+.4g}"


def assemble(
    measured: AblationMeasurement,
    flags: Mapping[int, Mapping[int, list[str]]],
    doc: Receipts,
    mode: Mode,
    floor_pi_share: float,
    step: int,
) -> AblationReceipt:
    """The signed ablation record (``records.AblationReceipt``): the measured ΔNLLs of
    :func:`moeaudit.receipts.ablation.ablation_receipt` with each expert's flags, π and reading,
    and the sentences over them."""
    pi = {int(e["layer"]): e["occupancy"].get("pi") or [] for e in doc["layers"]}
    experts: list[AblationExpert] = []
    for row in measured["experts"]:
        layer, e = row["layer"], row["expert"]
        why = list((flags.get(layer) or {}).get(e, []))
        shares = pi.get(layer) or []
        experts.append(
            {
                "layer": layer,
                "expert": e,
                "flagged": bool(why),
                "flags": why,
                "pi": shares[e] if e < len(shares) else None,
                "nll": row["nll"],
                "nll_delta": row["nll_delta"],
                "ci95": row["ci95"],
                "reading": reading(
                    bool(why), needed(row["nll_delta"], row["ci95"]), not_needed(row["nll_delta"], row["ci95"])
                ),
            }
        )
    out: AblationReceipt = {
        "mode": mode,
        "checkpoint": doc["checkpoint"]["name"],
        "step": step,
        "flag_rule": FLAG_RULE,
        "floor_pi_share": floor_pi_share,
        "removal": measured["removal"],
        "nll": measured["nll"],
        "experts": experts,
        "refused": list(measured["refused"]),
        "cost": {**measured["cost"]},
        "sentences": [],
    }
    out["sentences"] = sentences(out)
    return out
