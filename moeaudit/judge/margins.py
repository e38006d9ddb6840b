"""Lifecycle margins: handoff and refinement, exact and smooth (`003` Eq. 18–32, SPEC §6).

Torch-free: takes per-layer receipt numbers, returns plain data. Verdicts use the exact
margins; the smooth ones are reported beside them and never substituted (SPEC §6: Eq. 27 is
not zero at θ = θ̄ and π̃ is a soft marginal, so the two need not converge).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from moeaudit.errors import InputError
from moeaudit.judge.policy import MarginSettings


def smin(values: Sequence[float], beta: float) -> float:
    """smin_β(a) = −β⁻¹ ln Σ e^{−β a_i} (Eq. 18); min − ln(n)/β ≤ smin ≤ min."""
    lo = min(values)
    return lo - math.log(sum(math.exp(-beta * (a - lo)) for a in values)) / beta


def smax(values: Sequence[float], beta: float) -> float:
    """smax_β(a) = β⁻¹ ln Σ e^{β a_i} (Eq. 19); max ≤ smax ≤ max + ln(n)/β."""
    return -smin([-a for a in values], beta)


def pi_tail(pi_smooth: Sequence[float], beta: float) -> float:
    """Soft lower-tail occupancy π̃_tail = smin_β over experts of π̃ (Eq. 24).

    smin_β ≥ min − ln(E)/β, so with many experts (E = 64 at β = 50) π̃_tail of a perfectly
    balanced layer is ≤ 0 and the ratios of Eq. 25 / 29 lose their meaning; callers refuse
    to divide by a non-positive tail (`_tail_ratio`)."""
    return smin(list(pi_smooth), beta)


def _tail_ratio(num: float, den: float, notes: list[str], layer: int, beta: float) -> float:
    if den <= 0:
        notes.append(f"layer {layer}: π̃_tail = {den:.4g} ≤ 0 at β = {beta:g} (smin_β undershoots "
                     "min by up to ln(E)/β); the smooth margin is undefined — raise margins.beta")
        return float("nan")
    return num / den


def _layer(receipts: Mapping[str, Any], layer: int) -> Mapping[str, Any]:
    for entry in receipts["layers"]:
        if entry["layer"] == layer:
            return entry
    raise InputError(f"receipts of {receipts['checkpoint']['name']} have no routed layer {layer}")


def _check_same_moe(cand: Mapping[str, Any], ref: Mapping[str, Any]) -> None:
    """π_min and C2 ratios only compare like with like: same experts, top-k and routed layers."""
    a, b = cand["checkpoint"], ref["checkpoint"]
    for key in ("family", "experts", "top_k", "routed_layers"):
        if a.get(key) != b.get(key):
            raise InputError(
                f"reference {b['name']} and candidate {a['name']} have different MoE structure "
                f"({key}: {b.get(key)} vs {a.get(key)})",
                hint="use a healthy reference checkpoint of the same model")


class _Undefined(Exception):
    pass


def _undefined_margin(exc: _Undefined) -> dict[str, Any]:
    return {"exact": None, "smooth": None, "per_layer": [], "reason": str(exc)}


def _need(*values: Any) -> None:
    if any(v is None or (isinstance(v, list) and any(x is None for x in v)) for v in values):
        raise _Undefined("a receipt the margin needs is not finite (NaN/Inf in weights or "
                         "activations); the margin is undefined")


def handoff(cand: Mapping[str, Any], ref: Mapping[str, Any], protected: Sequence[int],
            m: MarginSettings) -> dict[str, Any]:
    try:
        return _handoff(cand, ref, protected, m)
    except _Undefined as exc:
        return {**_undefined_margin(exc), "reference": ref["checkpoint"]["name"]}


def refinement(base: Mapping[str, Any], cand: Mapping[str, Any], drift: Mapping[int, Mapping[str, Any]],
               protected: Sequence[int], m: MarginSettings) -> dict[str, Any]:
    try:
        return _refinement(base, cand, drift, protected, m)
    except _Undefined as exc:
        return {**_undefined_margin(exc), "tau": m.tau}


def _handoff(cand: Mapping[str, Any], ref: Mapping[str, Any], protected: Sequence[int],
             m: MarginSettings) -> dict[str, Any]:
    """h_ex (Eq. 31) and smooth h (Eq. 25–26) of a candidate against a healthy reference."""
    _check_same_moe(cand, ref)
    exact, smooth, per_layer, notes = [], [], [], []
    for layer in protected:
        c, r = _layer(cand, layer), _layer(ref, layer)
        ref_pi_min = r["occupancy"]["pi_min"]
        _need(ref_pi_min, c["occupancy"]["pi_min"], c["occupancy"]["pi_smooth"], r["occupancy"]["pi_smooth"],
              c["overlap"].get("c2_smooth"), r["overlap"].get("c2_smooth"))
        if not ref_pi_min:
            raise InputError(
                f"reference {ref['checkpoint']['name']} has dead experts on protected layer {layer} "
                "(pi_min = 0), so the handoff ratio is undefined",
                hint="use a healthy reference checkpoint, or change margins.protected_layers")
        c2, c2_ref = c["overlap"]["c2"], r["overlap"]["c2"]
        if c2 is None or c2_ref is None:
            reason = (c if c2 is None else r)["overlap"].get("reason", "no C2")
            raise InputError(f"layer {layer} has no C2 ({reason}); the handoff margin needs co-active pairs")
        h_l = m.lambda1 * (c2 - c2_ref) + m.lambda2 * (c["occupancy"]["pi_min"] / ref_pi_min - 1.0)
        tail_c = pi_tail(c["occupancy"]["pi_smooth"], m.beta)
        tail_r = pi_tail(r["occupancy"]["pi_smooth"], m.beta)
        hs_l = m.lambda1 * (c["overlap"]["c2_smooth"] - r["overlap"]["c2_smooth"]) + m.lambda2 * (
            _tail_ratio(tail_c, tail_r, notes, layer, m.beta) - 1.0)
        exact.append(h_l)
        smooth.append(hs_l)
        per_layer.append({"layer": layer, "exact": h_l, "smooth": hs_l})
    out = {"exact": min(exact), "smooth": smin(smooth, m.beta), "per_layer": per_layer,
           "reference": ref["checkpoint"]["name"]}
    if notes:
        out["notes"] = notes
    return out


def _refinement(base: Mapping[str, Any], cand: Mapping[str, Any], drift: Mapping[int, Mapping[str, Any]],
                protected: Sequence[int], m: MarginSettings) -> dict[str, Any]:
    """r_ex (Eq. 32) and smooth r (Eq. 29–30) of a candidate against its base."""
    exact, smooth, per_layer, notes = [], [], [], []
    for layer in protected:
        b, c, d = _layer(base, layer), _layer(cand, layer), drift[layer]
        pb, pc = b["occupancy"]["pi_min"], c["occupancy"]["pi_min"]
        _need(pb, pc, b["occupancy"]["pi_smooth"], c["occupancy"]["pi_smooth"], d.get("boundary"),
              d.get("content"), d.get("boundary_smooth"), d.get("content_smooth"))
        if pb > 0:
            occ = 1.0 - pc / pb
        else:  # a base with a dead expert: the ratio is undefined; occupancy cannot have narrowed
            occ = 0.0
            notes.append(f"base has dead experts on layer {layer}; occupancy term set to 0")
        load = m.mu1 * d["boundary"] + m.mu2 * d["content"] + m.mu3 * occ
        tail_b = pi_tail(b["occupancy"]["pi_smooth"], m.beta)
        tail_c = pi_tail(c["occupancy"]["pi_smooth"], m.beta)
        load_s = m.mu1 * d["boundary_smooth"] + m.mu2 * d["content_smooth"] + m.mu3 * (
            1.0 - _tail_ratio(tail_c, tail_b, notes, layer, m.beta))
        exact.append(load)
        smooth.append(load_s)
        per_layer.append({"layer": layer, "load_exact": load, "load_smooth": load_s})
    out: dict[str, Any] = {"exact": m.tau - max(exact), "smooth": m.tau - smax(smooth, m.beta),
                           "tau": m.tau, "per_layer": per_layer}
    if notes:
        out["notes"] = notes
    return out


def describe_refinement(r_ex: float) -> str:
    if r_ex >= 0:
        return "refinement: candidate stays within the preservation budget on every protected layer"
    return "repurposing: candidate exceeds the preservation budget on a protected layer"


def describe_handoff(h_ex: float) -> str:
    if h_ex >= 0:
        return "handoff licensed: every protected layer clears the reference overlap-and-occupancy floor"
    return "handoff not licensed: a protected layer falls below the reference overlap or occupancy"
