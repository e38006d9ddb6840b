"""Gates of a run (`003` §7–8, Tables 4, 11, 13; docs/policy.md, "The rules in one place"). Torch-free.

A run is a sequence of gates, one per checkpoint. The first checkpoint, and the first
checkpoint at or after every ``resume`` / ``regime_change`` event, is a new baseline: later
gates are compared with it. Every other gate is compared with the active baseline:
GREEN when its structure holds, YELLOW on a bad gate, RED when bad for ``escalate_after``
consecutive gates (Table 13: YELLOW at 500, 1000, 1500, RED at 2000 on Distill-640) or at once
in Table 11's last row (C2 worsening, occupancy degrading, scalar not improving).

A resume cannot erase a regression: a post-resume baseline is still compared with the baseline
that was active before it ("continuity"); when that comparison is bad the gate is YELLOW/RED
(and still the reference for later gates), and the bad streak goes on. Every checkpoint,
baselines included, is also held to absolute health floors (dead experts, π_min against the
uniform share k/E, normalised load entropy), so a run that starts collapsed is not healthy
merely because it stays as collapsed as it started.

Scalar trend is the canary NLL — the quantity the claims name — with a paired window
bootstrap of its change (the same canary windows at both gates). The logged training loss is
reported beside it under its own name and never stands in for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypedDict

from moeaudit.judge.health import (  # noqa: F401 - the floors' names, also read from here
    NO_GRADIENT_SHARE,
    canary_tokens,
    canary_windows,
    counted_dead,
    dead_experts,
    floor_resolution,
    health,
    silent_experts,
)
from moeaudit.policy import GateSettings
from moeaudit.records import (
    DriftLayer,
    DriftSummary,
    GateClaims,
    GateEntry,
    GateReceipts,
    GateStatus,
    LayerSummary,
    NllChange,
    PairLayer,
    Receipts,
    ReceiptsLayer,
    RunEvent,
    Structural,
)

BASELINE: Final = "BASELINE"
GREEN: Final = "GREEN"
YELLOW: Final = "YELLOW"
RED: Final = "RED"
PASS: Final = "PASS"
FAIL: Final = "FAIL"
INCONCLUSIVE: Final = "INCONCLUSIVE"
IMPROVING, NO_CHANGE, WORSENING = "improving", "no change", "worsening"
STALLING = NO_CHANGE  # the old name of "no change beyond noise" (`003` Table 11: not improving)


@dataclass(frozen=True)
class Checkpointed:
    """One audited checkpoint: its step, receipts document, and why it is a baseline (if)."""

    step: int
    receipts: Receipts
    baseline_reason: str | None = None
    # Mean of each logged training-loss key over (previous gate, step], by its logged name:
    # ``lm_loss`` (language-model loss, no auxiliary terms) and/or ``loss`` (what the training
    # loop reported as its objective). Never stands in for the canary NLL.
    training: Mapping[str, float] | None = None
    # The same keys over the equal window before the previous gate, (2·prev − step, prev]: what
    # the training-loss sentence compares ``training`` with (None: the previous gate's interval)
    training_before: Mapping[str, float] | None = None

    @property
    def training_loss(self) -> float | None:
        """The primary logged training loss: ``lm_loss`` where logged, else ``loss``."""
        named = primary_training(self.training)
        return None if named is None else named[1]


def primary_training(training: Mapping[str, float] | None) -> tuple[str, float] | None:
    for key in ("lm_loss", "loss"):
        if training and training.get(key) is not None:
            return key, training[key]
    return None


def _layers(doc: Receipts) -> dict[int, ReceiptsLayer]:
    return {entry["layer"]: entry for entry in doc["layers"]}


def baselines(steps: Sequence[int], events: Sequence[RunEvent]) -> dict[int, str]:
    """step → reason, for the first checkpoint and the first one at or after each event."""
    out = {steps[0]: "first checkpoint of the run"}
    for ev in events:
        later = [s for s in steps if s >= ev["step"]]
        if later and later[0] not in out:
            note = f": {ev['note']}" if ev.get("note") else ""
            source = f" (declared in {ev['source']})" if ev.get("source") else ""
            out[later[0]] = f"{ev['event']} at step {ev['step']}{source}{note}"
    return out


# --- structure against the active baseline (docs/policy.md) ----------------------------------------------


def _ratio(now: float | None, then: float | None) -> float:
    """now / then; 1 when the baseline is 0 (nothing to lose); 0 when a value is not finite
    (null in the receipts): unknown occupancy never passes a floor."""
    if now is None or then is None:
        return 0.0
    return now / then if then > 0 else 1.0


def _half_width(entry: ReceiptsLayer) -> float:
    ci = entry["overlap"].get("ci95", {}).get("c2")
    return 0.5 * (ci[1] - ci[0]) if ci else 0.0


def structural(gate: Receipts, base: Receipts, protected: Sequence[int], g: GateSettings) -> Structural:
    """c2_ok and occupancy_ok of a gate against a baseline (docs/policy.md, "The rules in one place").

    A protected layer's C2 counts as fallen when ΔC2 < −max(tol_c2, tol_c2_rel·|C2_b|, noise),
    where noise is the 95% half-width of the difference from the two window-bootstrap intervals
    (√(hw_j² + hw_b²)): a drop inside the canary's own sampling noise is not evidence of damage
    (`003` §5), and the practical tolerance is relative because C2's level depends on the
    model's width, E and k.
    """
    now, then = _layers(gate), _layers(base)
    res, res_b = floor_resolution(gate, g), floor_resolution(base, g)  # zero counts within it: noise
    W, W_b = canary_windows(gate), canary_windows(base)
    c2_deltas, slack = {}, {}
    not_applicable: dict[str, str] = {}  # layer → why C2 has no value by construction
    not_computed: list[int] = []  # a C2 that should exist and does not (never signed "held")
    for layer in protected:
        a, b = now[layer]["overlap"].get("c2"), then[layer]["overlap"].get("c2")
        if a is not None and b is not None:
            c2_deltas[layer] = a - b
            noise = (_half_width(now[layer]) ** 2 + _half_width(then[layer]) ** 2) ** 0.5
            slack[layer] = max(g.tol_c2, g.tol_c2_rel * abs(b), noise)
        elif a is None and b is None and now[layer]["overlap"].get("reason"):
            not_applicable[str(layer)] = now[layer]["overlap"]["reason"]  # top-1 routing
        else:
            not_computed.append(layer)
    fallen = [layer for layer, d in c2_deltas.items() if d < -slack[layer]]
    c2_min = min(c2_deltas.values()) if c2_deltas else None
    dead_up: list[int] = []
    pi_ratio: list[float] = []
    h_ratio: list[float] = []
    below: dict[str, list[int]] = {"π_min ratio": [], "entropy ratio": []}
    bounds: dict[str, tuple[float, list[float] | None]] = {}  # quantity → (lowest ratio, its interval)
    for layer, entry in now.items():
        o, ob = entry["occupancy"], then[layer]["occupancy"]
        if len(counted_dead(entry, res, W)) > len(counted_dead(then[layer], res_b, W_b)) + g.tol_dead:
            dead_up.append(layer)
        for name, key, floor, ratios in (
            ("π_min ratio", "pi_min", g.pi_min_ratio_floor, pi_ratio),
            ("entropy ratio", "entropy_norm", g.entropy_ratio_floor, h_ratio),
        ):
            r, ci = _ratio(o[key], ob[key]), ratio_interval(o, ob, key)
            ratios.append(r)
            if name not in bounds or r < bounds[name][0]:
                bounds[name] = (r, ci)
            if r < floor and (ci is None or ci[1] < floor):  # below the floor beyond noise
                below[name].append(layer)
    occupancy_ok = not dead_up and not any(below.values())
    excluded = {
        str(layer): n for layer in c2_deltas if (n := now[layer]["overlap"].get("c2_excluded_tokens"))
    }  # tokens left out of C2 where the pair weight vanishes (receipts.overlap)
    c2_ok = not fallen and not not_computed
    out: Structural = {
        "against": base["checkpoint"]["name"],
        "c2_ok": c2_ok,
        "c2_min_delta": c2_min,
        "c2_deltas": {str(k): v for k, v in c2_deltas.items()},
        "c2_tolerance": {str(k): v for k, v in slack.items()},
        "c2_fallen_layers": fallen,
        "occupancy_ok": occupancy_ok,
        "layers_with_more_dead": dead_up,
        "pi_min_ratio": min(pi_ratio),
        "entropy_ratio": min(h_ratio),
        "ratio_ci95": {"pi_min": bounds["π_min ratio"][1], "entropy": bounds["entropy ratio"][1]},
        "below_floor": {name: layers for name, layers in below.items() if layers},
        "ok": c2_ok and occupancy_ok,
    }
    # held / fell need no status beyond c2_ok; the two cases that sign no C2 say which
    if not_computed and not fallen:
        out["c2_status"] = "not computed"
    elif not c2_deltas and not not_computed:
        out["c2_status"] = "not applicable"
    if not_applicable:
        out["c2_not_applicable"] = not_applicable
    if not_computed:
        out["c2_not_computed_layers"] = not_computed
    if excluded:
        out["c2_excluded_tokens"] = excluded
        out["c2_tokens"] = canary_tokens(gate)
    return out


def ratio_interval(now: Mapping[str, Any], then: Mapping[str, Any], key: str) -> list[float] | None:
    """The range of now[key] / then[key] (an occupancy ratio) over the two checkpoints' 95%
    window-bootstrap intervals: [low(now)/high(then), high(now)/low(then)], or None without
    intervals. A ratio below its floor counts only when this whole range lies below it: the
    gate's occupancy must be distinguishable from the baseline's own interval, not only from
    its point value (`003` §5: windows are the independent units; a first checkpoint saved
    before the router has learned anything sits near the uniform share by chance)."""
    ca, cb = (now.get("ci95") or {}).get(key), (then.get("ci95") or {}).get(key)
    if ca and cb and cb[0] > 0:
        return [ca[0] / cb[1], ca[1] / cb[0]]
    return None


# --- the scalar trend: canary NLL with a paired window bootstrap ---------------------------------


Interval = Callable[[list[float], list[float], int, int], list[float]]


def paired_interval(wa: list[float], wb: list[float], resamples: int, seed: int) -> list[float]:
    """95% paired window-bootstrap interval of mean(wb − wa): the canary is the same at both
    gates, so windows are resampled jointly (`003` §5: windows, not tokens, are the independent
    units)."""
    import numpy as np

    diffs = np.asarray(wb, dtype=np.float64) - np.asarray(wa, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(len(diffs), size=(resamples, len(diffs)))
    stats = np.sort(diffs[idx].mean(axis=1))  # PCG64: the same draws on every platform
    return [float(stats[int(0.025 * (resamples - 1))]), float(stats[int(0.975 * (resamples - 1))])]


def nll_change(
    previous: Receipts, now: Receipts, resamples: int, seed: int, interval: Interval = paired_interval
) -> NllChange:
    """Change of canary NLL between two gates, with its 95% paired window-bootstrap interval
    (``interval``: :func:`paired_interval`, or a cached copy of it)."""
    a, b = previous.get("nll"), now.get("nll")
    out: NllChange = {"from": a, "to": b, "delta": None if a is None or b is None else b - a, "ci95": None}
    wa, wb = previous.get("nll_windows"), now.get("nll_windows")
    if resamples and isinstance(wa, list) and isinstance(wb, list) and len(wa) == len(wb) and wa:
        fa, fb = [x for x in wa if x is not None], [x for x in wb if x is not None]
        if len(fa) == len(fb) == len(wa):  # every window's NLL is finite
            out["ci95"] = interval(fa, fb, resamples, seed)
    return out


def scalar_trend(change: NllChange, tol: float) -> str:
    """improving / worsening only when the change exceeds ``tol`` and its interval excludes 0;
    anything else is "no change" beyond noise (`003` Table 11: it counts as not improving)."""
    d, ci = change["delta"], change["ci95"]
    if d is None:
        return "unknown"
    if d < -tol and (ci is None or ci[1] < 0):
        return IMPROVING
    if d > tol and (ci is None or ci[0] > 0):
        return WORSENING
    return NO_CHANGE


def _fmt_change(c: NllChange) -> str:
    ci = c["ci95"]
    interval = "" if ci is None else f", 95% CI of the change [{ci[0]:+.4f}, {ci[1]:+.4f}]"
    return f"from {c['from']:.4f} to {c['to']:.4f} (Δ {c['delta']:+.4f}{interval})"


# --- claims (Table 4, Table 11), from the quantities they name ---------------------------------

TRAINING_KEYS = {
    "lm_loss": "the logged lm_loss (language-model loss of the training batches, no auxiliary terms)",
    "loss": "the logged loss (the training loop's reported objective, auxiliary terms included "
    "where the model adds them)",
}


def _training_sentences(training: Mapping[str, Any] | None) -> list[str]:
    """One sentence per logged training-loss key, each named exactly as logged."""
    out = []
    for key, name in TRAINING_KEYS.items():
        pair = (training or {}).get(key)
        if not pair or pair[0] is None or pair[1] is None:
            continue
        a, b = pair
        verb = "fell" if b < a else "rose" if b > a else "held"
        out.append(
            f"{name} {verb} from {a:.4f} to {b:.4f} (interval means; the run's own training batches, not the canary)"
        )
    return out


def _scalar_sentence(trend: str, change: NllChange) -> str:
    """One vocabulary, from the interval: improving / worsening / no change beyond noise. A
    point estimate inside noise is never signed as "fell" or "rose" (docs/decisions.md, "Scalar trend is the canary
    NLL")."""
    if trend == IMPROVING:
        return f"canary NLL improving beyond noise: fell {_fmt_change(change)}"
    if trend == WORSENING:
        return f"canary NLL worsening beyond noise: rose {_fmt_change(change)}"
    return f"canary NLL: no change beyond tolerance and bootstrap noise, {_fmt_change(change)}"


def claims(
    status: str,
    trend: str,
    change: NllChange | None,
    st: Structural | None,
    training: Mapping[str, Any] | None = None,
    tol: float = 0.0,
    health_problems: Sequence[str] = (),
    stage: str = "pretraining",
    since_base: str = NO_CHANGE,
) -> GateClaims:
    """What this gate's receipts license and what they do not, each sentence naming its numbers.

    ``training``: logged key → (value at the previous gate, value here), interval means."""
    lic, not_lic = [], []
    if change is not None and change["delta"] is not None:
        lic.append(_scalar_sentence(trend, change))
        if trend == IMPROVING:
            lic.append("the objective improved on the visited region (the canary)")
            not_lic.append("the routed model (atlas) was preserved — falling NLL alone never licenses it")
        if scalar_bad(trend, stage):
            lic.append(
                "the held-out canary NLL worsened during pretraining: a bad gate by itself "
                "(overfitting or divergence), whatever the structure"
            )
            not_lic.append("progress on the pretraining objective at this gate")
    lic += _training_sentences(training)
    both = {k: v for k, v in (training or {}).items() if v[0] is not None and v[1] is not None}
    key = next((k for k in ("lm_loss", "loss") if k in both), None)
    training_fell = key is not None and both[key][1] < both[key][0] - tol
    if health_problems:
        lic.append(
            "expert usage is below an absolute health floor: "
            + "; ".join(health_problems[:3])
            + (f" (and {len(health_problems) - 3} more)" if len(health_problems) > 3 else "")
        )
    if st is None:
        lic.append("this is the state of the routed model at this reference point")
        not_lic.append("any preservation claim about training after this point (needs the next gate)")
        return {"licensed": lic, "not_licensed": not_lic}
    against = st.get("against", "the baseline")
    if st["occupancy_ok"] and not health_problems:
        ci = (st.get("ratio_ci95") or {}).get("pi_min")
        noise = "" if ci is None else f", range over both bootstrap intervals {ci[0]:.3f}–{ci[1]:.3f}"
        lic.append(
            f"expert usage stayed within the occupancy floors of {against} beyond the canary's noise "
            f"(π_min ratio {st['pi_min_ratio']:.3f}{noise}; entropy ratio {st['entropy_ratio']:.3f})"
        )
    elif not st["occupancy_ok"]:
        lic.append(
            f"expert usage narrowed against {against} (occupancy degeneration: π_min ratio "
            f"{st['pi_min_ratio']:.3f}, entropy ratio {st['entropy_ratio']:.3f})"
        )
    lic.append(_c2_sentence(st, against))
    if atlas_motion(st, bool(health_problems), since_base, stage):
        lic.append(
            f"atlas motion during pretraining (003 Table 11, third row): C2 fell against {against} "
            "while occupancy held and the canary NLL improved beyond noise against it; reported, "
            "not a bad gate while the atlas is being formed"
        )
    structure_ok = st["ok"] and not health_problems
    if not structure_ok and trend == IMPROVING:
        lic.append("scalar improvement without geometric recovery (canary NLL improving, structure did not hold)")
        not_lic.append("structural health or preservation of the routed model")
    elif not structure_ok and training_fell:
        canary = "no change beyond noise" if trend == NO_CHANGE else f"{trend} beyond noise"
        lic.append(
            f"training-loss improvement without geometric recovery (the logged {key} fell, "
            f"structure did not hold; canary NLL: {canary})"
        )
        not_lic.append("structural health or preservation of the routed model")
    if structure_ok:
        rule = " (judged on occupancy alone: C2 not applicable)" if st.get("c2_status") == "not applicable" else ""
        lic.append(f"structure preserved against {against} at this gate{rule}")
    if status == BASELINE:
        not_lic.append("any preservation claim about training after this point (needs the next gate)")
    not_lic.append("compatibility of co-active experts from occupancy alone, or broad usage from C2 alone")
    return {"licensed": lic, "not_licensed": not_lic}


def _c2_sentence(st: Structural, against: str) -> str:
    """C2's sentence: "held" only for a C2 computed on every protected layer at both gates;
    otherwise it says what it is — fallen, not applicable (and what was judged instead) or not
    computed (docs/policy.md, "C2 in the claims")."""
    status = c2_status(st)
    if status == "fell":
        fallen = st["c2_fallen_layers"]
        return f"co-active overlap compatibility (C2) fell on protected layer(s) {fallen} against {against}"
    if status == "not computed":
        return (
            f"co-active overlap compatibility (C2) not computed on protected layer(s) "
            f"{st.get('c2_not_computed_layers')} (a receipt without a value here or at {against}): no C2 claim"
        )
    if status == "not applicable":
        why = "; ".join(sorted(set((st.get("c2_not_applicable") or {}).values()))) or "no co-active pairs"
        rule = " — the structural rule for k = 1" if "top-1" in why else ""
        return (
            f"co-active overlap compatibility (C2): not applicable on the protected layers ({why}); "
            f"structure judged on occupancy alone{rule}"
        )
    excluded = st.get("c2_excluded_tokens") or {}
    if excluded:
        n = st.get("c2_tokens")
        of = f" of {n}" if n else ""
        counts = ", ".join(
            f"layer {layer}: {k}{of}" for layer, k in sorted(excluded.items(), key=lambda kv: int(kv[0]))
        )
        return (
            "co-active overlap compatibility (C2) held on the protected layers (over the canary tokens "
            f"with a co-active pair weight; left out where it vanishes: {counts})"
        )
    return "co-active overlap compatibility (C2) held on the protected layers"


# --- the gates ------------------------------------------------------------------------------------


def scalar_bad(trend: str, stage: str) -> bool:
    """In pretraining the canary is held-out data of the objective being trained, so its NLL
    worsening beyond noise is a bad gate by itself (an overfitting or diverging run; `003`
    Table 11 licenses continuation only while the loss improves). In post-training the canary
    measures what the base model could do, and a rise is the expected price of a new objective:
    the refinement margin, not the scalar, decides there (docs/policy.md)."""
    return trend == WORSENING and stage != "post-training"


def atlas_motion(st: Structural, health_bad: bool, since_base: str, stage: str) -> bool:
    """`003` Table 11, third row, in pretraining: C2 fell against the baseline while occupancy
    held, every health floor is cleared and the canary NLL improved beyond noise against the
    same baseline(s) (``since_base``: the C2 trend and the loss trend over one horizon). "Atlas
    motion is visible without occupancy collapse; the relevant question becomes … whether that motion is acceptable for
    the current stage": while the atlas is being formed it is (a from-scratch run's experts
    specialise away from their near-random start, and C2 falls with it). Reported in the
    claims, not a bad gate. In post-training the refinement margin answers that question."""
    return (
        stage != "post-training"
        and bool(st["c2_fallen_layers"])  # a fall measured, never a C2 that could not be computed
        and not st.get("c2_not_computed_layers")
        and st["occupancy_ok"]
        and not health_bad
        and since_base == IMPROVING
    )


def structure_bad(st: Structural, health_bad: bool, since_base: str, stage: str) -> bool:
    return (not st["ok"] or health_bad) and not atlas_motion(st, health_bad, since_base, stage)


def _status(
    st: Structural,
    health_bad: bool,
    trend: str,
    streak: int,
    g: GateSettings,
    stage: str = "pretraining",
    since_base: str = NO_CHANGE,
) -> GateStatus:
    """GREEN when structure holds, every health floor is cleared and the scalar is not bad;
    otherwise YELLOW, or RED after ``escalate_after`` consecutive bad gates, or at once when
    structure and scalar are both bad (docs/policy.md, "The rules in one place": structure bad and canary NLL worsening;
    `003` Table 11's last row: C2 fallen and occupancy degraded while the scalar is not improving).
    Pretraining atlas motion (:func:`atlas_motion`) is not bad structure."""
    structure_bad_ = structure_bad(st, health_bad, since_base, stage)
    if not structure_bad_ and not scalar_bad(trend, stage):
        return GREEN
    both_bad = structure_bad_ and trend == WORSENING
    table11_last_row = bool(st["c2_fallen_layers"]) and not st["occupancy_ok"] and trend != IMPROVING
    return RED if streak >= g.escalate_after or both_bad or table11_last_row else YELLOW


C2_SEVERITY = {"not applicable": 0, "held": 1, "not computed": 2, "fell": 3}


def c2_status(st: Structural) -> str:
    """held / fell / not applicable / not computed (the first two from ``c2_ok``)."""
    if st.get("c2_fallen_layers"):
        return "fell"
    return str(st.get("c2_status") or ("held" if st["c2_ok"] else "fell"))


def c2_severity(st: Structural) -> int:
    return C2_SEVERITY[c2_status(st)]


def _combine(comparisons: Sequence[Structural]) -> Structural:
    """One structural reading from the comparisons with every baseline so far (the active one
    last): ok only if every comparison holds — events add baselines, so they can add a
    comparison but never remove one (docs/decisions.md, "Events cannot improve a verdict"). The deciding comparison is
    the first that fails (else the active one); the others are listed."""
    active = comparisons[-1]
    failing = [c for c in comparisons if not c["ok"]]
    deciding: Structural = {**(failing[0] if failing else active)}
    deciding["c2_ok"] = all(c["c2_ok"] for c in comparisons)
    worst = max(comparisons, key=c2_severity)
    if c2_severity(worst) > c2_severity(deciding):
        deciding["c2_fallen_layers"] = worst["c2_fallen_layers"]
        deciding.pop("c2_status", None)
        deciding.pop("c2_not_computed_layers", None)
        if "c2_status" in worst:
            deciding["c2_status"] = worst["c2_status"]
        if "c2_not_computed_layers" in worst:
            deciding["c2_not_computed_layers"] = worst["c2_not_computed_layers"]
    deciding["occupancy_ok"] = all(c["occupancy_ok"] for c in comparisons)
    deciding["ok"] = not failing
    deciding["active"] = active["against"]
    others = [c for c in comparisons if c is not (failing[0] if failing else active)]
    if others:
        deciding["also_against"] = [
            {
                "against": c["against"],
                "ok": c["ok"],
                "c2_ok": c["c2_ok"],
                "occupancy_ok": c["occupancy_ok"],
                "c2_min_delta": c["c2_min_delta"],
                "pi_min_ratio": c["pi_min_ratio"],
                "entropy_ratio": c["entropy_ratio"],
            }
            for c in others
        ]
    return deciding


class _GateParts(TypedDict, total=False):
    """The fields of a :class:`~moeaudit.records.GateEntry` that not every gate has, each placed
    where the gate is written (``drift`` is added by certify and gate)."""

    duplicate_of: int
    reason: str
    new_baseline: bool
    continuity: Structural
    structural: Structural
    drift: DriftSummary


def evaluate_gates(
    points: Sequence[Checkpointed],
    protected: Sequence[int],
    g: GateSettings,
    *,
    resamples: int = 1000,
    seed: int = 0,
    interval: Interval = paired_interval,
    stage: str | Callable[[int], str] = "pretraining",
) -> list[GateEntry]:
    """The gates of a run (docs/policy.md, "The rules in one place"). Each gate is compared with every baseline before
    it — the first checkpoint and each event's — and is judged by the worst comparison, so an event
    written by the audited party can start a new drift baseline but never erase a regression.

    ``stage``: the run's stage, or the stage in force at a step (a declared stage applies from
    its step on). Each gate is judged by the stage in force at the base of its pair, the
    previous gate: the pair 100 → 200 of a run that turns to post-training at 200 is
    pretraining."""
    fixed = stage
    stage_at = stage if callable(stage) else (lambda _step: str(fixed))
    gates: list[GateEntry] = []
    bases: list[Checkpointed] = []
    previous: Checkpointed | None = None
    seen: dict[str, int] = {}  # digest → first step with it
    streak = 0
    for p in points:
        gate_stage = stage_at(p.step if previous is None else previous.step)
        change = None if previous is None else nll_change(previous.receipts, p.receipts, resamples, seed, interval)
        trend = "first" if change is None else scalar_trend(change, g.nll_tol)
        before = p.training_before if p.training_before is not None or previous is None else previous.training
        training = (
            None
            if previous is None
            else {k: (None if before is None else before.get(k), p.training.get(k)) for k in (p.training or {})}
            if p.training
            else None
        )
        summary = gate_summary(p.receipts)
        summary["training_loss"] = p.training_loss
        hp = health(p.receipts, g)
        named = p.receipts["checkpoint"].get("digest")
        digest = named.get("sha256") if isinstance(named, dict) else named
        duplicate: _GateParts = {}
        if isinstance(digest, str) and digest in seen:
            duplicate["duplicate_of"] = seen[digest]  # the same bytes under another step name
        elif isinstance(digest, str):
            seen[digest] = p.step
        st = _combine([structural(p.receipts, b.receipts, protected, g) for b in bases]) if bases else None
        # the canary NLL against every baseline, the horizon C2 is judged on: read only where a
        # C2 fall with occupancy held may be atlas motion (the previous gate's trend is reused)
        since_base = NO_CHANGE
        if st is not None and st["c2_fallen_layers"] and st["occupancy_ok"]:
            since = {
                trend
                if b is previous
                else scalar_trend(nll_change(b.receipts, p.receipts, resamples, seed, interval), g.nll_tol)
                for b in bases
            }
            since_base = IMPROVING if since == {IMPROVING} else NO_CHANGE
        health_bad, bad = not hp["ok"], False
        if st is not None:
            bad = structure_bad(st, health_bad, since_base, gate_stage) or scalar_bad(trend, gate_stage)
            streak = streak + 1 if bad else 0
        # a new baseline (the first checkpoint, or an event's): its structure against the earlier
        # baselines is its continuity, which a resume cannot erase; else the gate's structural
        before_status: _GateParts = {}
        after_status: _GateParts = {}
        if st is None or p.baseline_reason is not None:
            before_status["reason"] = p.baseline_reason or "first checkpoint of the run"
            before_status["new_baseline"] = True
            if st is not None:
                before_status["continuity"] = st
            status: GateStatus = (
                BASELINE if st is None or not bad else _status(st, health_bad, trend, streak, g, gate_stage, since_base)
            )
            baseline = p.step if not bases else bases[-1].step
            bases.append(p)
        else:
            status = _status(st, health_bad, trend, streak, g, gate_stage, since_base)
            baseline = bases[-1].step
            after_status["structural"] = st
        gates.append(
            {
                "step": p.step,
                "scalar": trend,
                "nll_change": change,
                "receipts": summary,
                "health": hp,
                **duplicate,
                **before_status,
                "status": status,
                "stage": gate_stage,
                "baseline": baseline,
                **after_status,
                "consecutive_bad": streak,
                "claims": claims(
                    status, trend, change, st, training, g.nll_tol, hp["problems"], gate_stage, since_base
                ),
            }
        )
        if hp.get("unresolved"):  # a reading the canary cannot resolve licenses neither way
            gates[-1]["claims"]["not_licensed"].append(
                "that expert usage clears the dead-expert and π_min floors: "
                + "; ".join(hp["unresolved"][:2])
                + f", and {hp.get('resolution')}"
            )
        previous = p
    return gates


def gate_summary(doc: Receipts) -> GateReceipts:
    """The receipts a gate rests on (`003` Table 3 columns), per layer and in aggregate."""
    layers, W = doc["layers"], canary_windows(doc)
    c2 = [v for e in layers if (v := e["overlap"].get("c2")) is not None]
    state1 = [e["boundary"]["margin_mean"] for e in layers if e["boundary"].get("margin_mean") is not None]
    cvs = [e["occupancy"]["cv"] for e in layers if e["occupancy"].get("cv") is not None]
    ents = [e["occupancy"]["entropy_norm"] for e in layers if e["occupancy"].get("entropy_norm") is not None]
    return {
        "checkpoint": doc["checkpoint"]["name"],
        "digest": doc["checkpoint"]["digest"],
        "nll": doc["nll"],
        "c2_mean": sum(c2) / len(c2) if c2 else None,
        "state1_mean": sum(state1) / len(state1) if state1 else None,
        "dead": sum(len(dead_experts(e, W)) for e in layers),
        "cv_mean": sum(cvs) / len(cvs) if cvs else None,
        "entropy_norm_min": min(ents) if ents else None,
        "nll_by_domain": doc.get("nll_by_domain", {}),
        "per_layer": [_layer_summary(e, W) for e in layers],
    }


def _layer_summary(e: ReceiptsLayer, windows: int) -> LayerSummary:
    row: LayerSummary = {
        "layer": e["layer"],
        "c2": e["overlap"].get("c2"),
        "c2_ci95": e["overlap"].get("ci95", {}).get("c2"),
        "dead": len(dead_experts(e, windows)),
        "pi_min": e["occupancy"]["pi_min"],
        "state1": e["boundary"]["margin_mean"],
        "entropy_norm": e["occupancy"]["entropy_norm"],
    }
    silent = silent_experts(e, windows)
    if silent:
        row["no_gradient"] = silent
    if e["overlap"].get("c2_excluded_tokens"):
        row["c2_excluded_tokens"] = e["overlap"]["c2_excluded_tokens"]
    return row


DRIFTS = ("coordinate", "boundary", "transition", "content")


class Drifts(TypedDict):
    """What :func:`drift_summary` reads: a pair document, or a compare document's layers."""

    base_step: int
    layers: list[PairLayer]


def drift_summary(pair: Drifts) -> DriftSummary:
    """The four exact drifts (`003` §5) per layer, with their intervals, for the signed gate."""
    return {"against_step": pair["base_step"], "layers": [_drift_layer(e["drift"], e["layer"]) for e in pair["layers"]]}


def _drift_layer(drift: Mapping[str, Any], layer: int) -> DriftLayer:
    ci95 = drift.get("ci95") or {}
    return {
        "layer": layer,
        "coordinate": drift.get("coordinate"),
        "boundary": drift.get("boundary"),
        "transition": drift.get("transition"),
        "content": drift.get("content"),
        "ci95": {k: ci95.get(k) for k in DRIFTS},
    }


def nonfinite_findings(docs: Iterable[Receipts]) -> list[str]:
    """ "checkpoint: what" for every NaN/Inf weight, then every non-finite receipt."""
    docs = list(docs)
    bad = [f"{d['checkpoint']['name']}: weight {w}" for d in docs for w in d["nonfinite_weights"]]
    bad += [f"{d['checkpoint']['name']}: {f['path']}" for d in docs for f in d.get("nonfinite", [])]
    return bad
