"""Lifecycle margins: handoff and refinement, exact and smooth (`003` Eq. 18–32; docs/policy.md, "[margins]").

Torch-free: takes per-layer receipt numbers, returns plain data. Verdicts use the exact
margins; the smooth ones are reported beside them and never substituted (`003` Eq. 27 is
not zero at θ = θ̄ and π̃ is a soft marginal, so the two need not converge).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

from moeaudit.errors import InputError
from moeaudit.policy import MarginSettings
from moeaudit.records import Margin, MarginLayer


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
        notes.append(
            f"layer {layer}: π̃_tail = {den:.4g} ≤ 0 at β_π = {beta:g} (smin_β undershoots "
            "min by up to ln(E)/β); the smooth margin is undefined — raise margins.beta_pi"
        )
        return float("nan")
    return num / den


def beta_pi(m: MarginSettings, experts: int, top_k: int) -> float:
    """β_π of the soft lower tail: the policy's, or 10·E·ln(E)/k, so that smin_β undershoots
    min_e π̃ by at most ln(E)/β_π = a tenth of the uniform share k/E."""
    if m.beta_pi > 0:
        return m.beta_pi
    return 10.0 * experts * math.log(max(experts, 2)) / max(top_k, 1)


SMOOTH_NOTE = (
    "smooth margins are 003's differentiable surrogates (Eq. 25–30: soft tail of π̃, "
    "C2 over the top-2k candidates, Eq. 27–28 drifts); they describe the soft router, "
    "are not zero at θ = θ̄, and never decide a gate — the exact margin does"
)


def _reps(entry: Mapping[str, Any], group: str, name: str) -> list[float] | None:
    value = (entry.get(group) or {}).get("replicates") or {}
    got = value.get(name)
    return got if isinstance(got, list) and got and all(isinstance(x, (int, float)) for x in got) else None


def _same_draws(*docs: Mapping[str, Any]) -> bool:
    """Receipts whose replicates are paired draws: same canary, same bootstrap seed and size."""

    def key(d: Mapping[str, Any]) -> tuple[Any, ...]:
        canary = d.get("canary") or {}
        digest = canary.get("digest") or {}
        receipts = (d.get("settings") or {}).get("receipts") or {}
        return (
            digest.get("sha256") if isinstance(digest, Mapping) else digest,
            receipts.get("seed"),
            receipts.get("bootstrap"),
        )

    keys = {key(d) for d in docs}
    return len(keys) == 1 and None not in next(iter(keys))


def _quantiles(values: list[float]) -> list[float]:
    ordered = sorted(values)
    n = len(ordered)
    return [ordered[int(0.025 * (n - 1))], ordered[int(0.975 * (n - 1))]]


def _hw(ci: Sequence[float] | None) -> float:
    return 0.0 if not ci else 0.5 * (ci[1] - ci[0])


def _interval(values: Sequence[tuple[float, float]], pick: Any) -> list[float]:
    """[lo, hi] of min/max over layers of (value ± half-width) — an interval for the margin."""
    return [pick(v - w for v, w in values), pick(v + w for v, w in values)]


def _ci(entry: Mapping[str, Any], group: str, name: str) -> Sequence[float] | None:
    return (entry[group].get("ci95") or {}).get(name)


def _layer(receipts: Mapping[str, Any], layer: int) -> Mapping[str, Any]:
    for entry in receipts["layers"]:
        if entry["layer"] == layer:
            return cast(Mapping[str, Any], entry)
    raise InputError(f"receipts of {receipts['checkpoint']['name']} have no routed layer {layer}")


def check_same_moe(cand: Mapping[str, Any], ref: Mapping[str, Any]) -> None:
    """π_min and C2 ratios only compare like with like: same experts, top-k and routed layers."""
    a, b = cand["checkpoint"], ref["checkpoint"]
    for key in ("family", "experts", "top_k", "routed_layers"):
        if a.get(key) != b.get(key):
            raise InputError(
                f"reference {b['name']} and candidate {a['name']} have different MoE structure "
                f"({key}: {b.get(key)} vs {a.get(key)})",
                hint="use a healthy reference checkpoint of the same model",
            )


class _Undefined(Exception):
    pass


def _undefined_margin(exc: _Undefined) -> Margin:
    return {"exact": None, "ci95": None, "smooth": None, "per_layer": [], "reason": str(exc)}


def _need(*values: Any) -> None:
    if any(v is None or (isinstance(v, list) and any(x is None for x in v)) for v in values):
        raise _Undefined(
            "a receipt the margin needs is not finite (NaN/Inf in weights or activations); the margin is undefined"
        )


def handoff(cand: Mapping[str, Any], ref: Mapping[str, Any], protected: Sequence[int], m: MarginSettings) -> Margin:
    try:
        return _handoff(cand, ref, protected, m)
    except _Undefined as exc:
        return {**_undefined_margin(exc), "reference": ref["checkpoint"]["name"]}


def refinement(
    base: Mapping[str, Any],
    cand: Mapping[str, Any],
    drift: Mapping[int, Mapping[str, Any]],
    protected: Sequence[int],
    m: MarginSettings,
) -> Margin:
    try:
        return _refinement(base, cand, drift, protected, m)
    except _Undefined as exc:
        return {**_undefined_margin(exc), "tau": m.tau}


def _handoff(cand: Mapping[str, Any], ref: Mapping[str, Any], protected: Sequence[int], m: MarginSettings) -> Margin:
    """h_ex (Eq. 31) and smooth h (Eq. 25–26) of a candidate against a healthy reference."""
    check_same_moe(cand, ref)
    exact, smooth, spread = [], [], []
    per_layer: list[MarginLayer] = []
    notes: list[str] = []
    bp = beta_pi(m, cand["checkpoint"].get("experts") or 2, cand["checkpoint"].get("top_k") or 1)
    for layer in protected:
        c, r = _layer(cand, layer), _layer(ref, layer)
        ref_pi_min = r["occupancy"]["pi_min"]
        _need(
            ref_pi_min,
            c["occupancy"]["pi_min"],
            c["occupancy"]["pi_smooth"],
            r["occupancy"]["pi_smooth"],
            c["overlap"].get("c2_smooth"),
            r["overlap"].get("c2_smooth"),
        )
        if not ref_pi_min:
            raise InputError(
                f"reference {ref['checkpoint']['name']} has dead experts on protected layer {layer} "
                "(pi_min = 0), so the handoff ratio is undefined",
                hint="use a healthy reference checkpoint, or change margins.protected_layers",
            )
        c2, c2_ref = c["overlap"]["c2"], r["overlap"]["c2"]
        if c2 is None or c2_ref is None:
            reason = (c if c2 is None else r)["overlap"].get("reason", "no C2")
            raise InputError(f"layer {layer} has no C2 ({reason}); the handoff margin needs co-active pairs")
        pi_c = c["occupancy"]["pi_min"]
        h_l = m.lambda1 * (c2 - c2_ref) + m.lambda2 * (pi_c / ref_pi_min - 1.0)
        # 95% half-width from the receipts' window-bootstrap intervals, terms taken as
        # independent (candidate and reference are different checkpoints): delta method
        w = math.hypot(
            m.lambda1 * _hw(_ci(c, "overlap", "c2")),
            m.lambda1 * _hw(_ci(r, "overlap", "c2")),
            m.lambda2 * _hw(_ci(c, "occupancy", "pi_min")) / ref_pi_min,
            m.lambda2 * pi_c * _hw(_ci(r, "occupancy", "pi_min")) / ref_pi_min**2,
        )
        tail_c = pi_tail(c["occupancy"]["pi_smooth"], bp)
        tail_r = pi_tail(r["occupancy"]["pi_smooth"], bp)
        hs_l = m.lambda1 * (c["overlap"]["c2_smooth"] - r["overlap"]["c2_smooth"]) + m.lambda2 * (
            _tail_ratio(tail_c, tail_r, notes, layer, bp) - 1.0
        )
        exact.append(h_l)
        smooth.append(hs_l)
        spread.append((h_l, w))
        per_layer.append({"layer": layer, "exact": h_l, "ci95": [h_l - w, h_l + w], "smooth": hs_l})
    ci, method = _interval(spread, min), INDEPENDENT
    paired = _paired_handoff(cand, ref, protected, m)
    if paired is not None:
        ci, method = paired, PAIRED
    out: Margin = {
        "exact": min(exact),
        "ci95": ci,
        "ci_method": method,
        "smooth": smin(smooth, m.beta_h),
        "betas": {"pi": bp, "h": m.beta_h},
        "smooth_note": SMOOTH_NOTE,
        "per_layer": per_layer,
        "reference": ref["checkpoint"]["name"],
    }
    if notes:
        out["notes"] = notes
    return out


def _refinement(
    base: Mapping[str, Any],
    cand: Mapping[str, Any],
    drift: Mapping[int, Mapping[str, Any]],
    protected: Sequence[int],
    m: MarginSettings,
) -> Margin:
    """r_ex (Eq. 32) and smooth r (Eq. 29–30) of a candidate against its base."""
    exact, smooth, notes, spread = [], [], [], []
    per_layer: list[MarginLayer] = []
    bp = beta_pi(m, cand["checkpoint"].get("experts") or 2, cand["checkpoint"].get("top_k") or 1)
    for layer in protected:
        b, c, d = _layer(base, layer), _layer(cand, layer), drift[layer]
        pb, pc = b["occupancy"]["pi_min"], c["occupancy"]["pi_min"]
        _need(
            pb,
            pc,
            b["occupancy"]["pi_smooth"],
            c["occupancy"]["pi_smooth"],
            d.get("boundary"),
            d.get("content"),
            d.get("boundary_smooth"),
            d.get("content_smooth"),
        )
        w_occ = 0.0
        if pb > 0:
            occ = 1.0 - pc / pb
            w_occ = math.hypot(_hw(_ci(c, "occupancy", "pi_min")) / pb, pc * _hw(_ci(b, "occupancy", "pi_min")) / pb**2)
        else:  # a base with a dead expert: the ratio is undefined; occupancy cannot have narrowed
            occ = 0.0
            notes.append(f"base has dead experts on layer {layer}; occupancy term set to 0")
        load = m.mu1 * d["boundary"] + m.mu2 * d["content"] + m.mu3 * occ
        dci = d.get("ci95") or {}
        w = math.hypot(m.mu1 * _hw(dci.get("boundary")), m.mu2 * _hw(dci.get("content")), m.mu3 * w_occ)
        tail_b = pi_tail(b["occupancy"]["pi_smooth"], bp)
        tail_c = pi_tail(c["occupancy"]["pi_smooth"], bp)
        load_s = (
            m.mu1 * d["boundary_smooth"]
            + m.mu2 * d["content_smooth"]
            + m.mu3 * (1.0 - _tail_ratio(tail_c, tail_b, notes, layer, bp))
        )
        exact.append(load)
        smooth.append(load_s)
        spread.append((load, w))
        per_layer.append({"layer": layer, "load_exact": load, "load_ci95": [load - w, load + w], "load_smooth": load_s})
    hi_lo = _interval(spread, max)
    ci, method = [m.tau - hi_lo[1], m.tau - hi_lo[0]], INDEPENDENT
    paired = _paired_refinement(base, cand, drift, protected, m)
    if paired is not None:
        ci, method = paired, PAIRED
    out: Margin = {
        "exact": m.tau - max(exact),
        "ci95": ci,
        "ci_method": method,
        "smooth": m.tau - smax(smooth, m.beta_r),
        "tau": m.tau,
        "betas": {"pi": bp, "r": m.beta_r},
        "smooth_note": SMOOTH_NOTE,
        "per_layer": per_layer,
    }
    if notes:
        out["notes"] = notes
    return out


PAIRED = (
    "paired window bootstrap: each replicate recomputes the margin from the same "
    "resampled canary windows in every receipt it uses"
)
INDEPENDENT = (
    "per-term window-bootstrap half-widths combined as independent (conservative: "
    "the receipts carry no paired replicates)"
)


def _aligned(*series: list[float] | None) -> list[list[float]] | None:
    """The replicate lists when every one is present and of one length, else None."""
    present = [x for x in series if x is not None]
    if len(present) != len(series) or len({len(x) for x in present}) != 1:
        return None
    return present


def _paired_refinement(
    base: Mapping[str, Any],
    cand: Mapping[str, Any],
    drift: Mapping[int, Mapping[str, Any]],
    protected: Sequence[int],
    m: MarginSettings,
) -> list[float] | None:
    """r_ex per bootstrap replicate (Eq. 32 on replicate b of every term), its 95% interval."""
    if not _same_draws(base, cand):
        return None
    rows = []
    for layer in protected:
        d_reps = drift[layer].get("replicates") or {}
        terms = _aligned(
            _reps(_layer(base, layer), "occupancy", "pi_min"),
            _reps(_layer(cand, layer), "occupancy", "pi_min"),
            d_reps.get("boundary"),
            d_reps.get("content"),
        )
        if terms is None:
            return None
        pb, pc, bnd, cnt = terms
        rows.append(
            [
                m.mu1 * bnd[j] + m.mu2 * cnt[j] + m.mu3 * ((1.0 - pc[j] / pb[j]) if pb[j] > 0 else 0.0)
                for j in range(len(pb))
            ]
        )
    return _quantiles([m.tau - max(col) for col in zip(*rows, strict=True)])


def _paired_handoff(
    cand: Mapping[str, Any], ref: Mapping[str, Any], protected: Sequence[int], m: MarginSettings
) -> list[float] | None:
    """h_ex per replicate (Eq. 31): candidate and reference on the same canary windows."""
    if not _same_draws(cand, ref):
        return None
    rows = []
    for layer in protected:
        c, r = _layer(cand, layer), _layer(ref, layer)
        terms = _aligned(
            _reps(c, "overlap", "c2"),
            _reps(r, "overlap", "c2"),
            _reps(c, "occupancy", "pi_min"),
            _reps(r, "occupancy", "pi_min"),
        )
        if terms is None or any(x <= 0 for x in terms[3]):
            return None
        c2c, c2r, pc, pr = terms
        rows.append([m.lambda1 * (c2c[j] - c2r[j]) + m.lambda2 * (pc[j] / pr[j] - 1.0) for j in range(len(pc))])
    return _quantiles([min(col) for col in zip(*rows, strict=True)])


def describe_refinement(r_ex: float) -> str:
    if r_ex >= 0:
        return "refinement: candidate stays within the preservation budget on every protected layer"
    return "repurposing: candidate exceeds the preservation budget on a protected layer"


def describe_handoff(h_ex: float) -> str:
    if h_ex >= 0:
        return "handoff licensed: every protected layer clears the reference overlap-and-occupancy floor"
    return "handoff not licensed: a protected layer falls below the reference overlap or occupancy"
