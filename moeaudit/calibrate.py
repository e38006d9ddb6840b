"""``moeaudit calibrate``: fit every tolerance the verdict uses on one healthy run (docs/envelope.md, docs/policy.md).

What is fitted, and how (docs/policy.md is the reference):

* the envelope (`000` Eq. 16): ε = c·Var_t[V], δ = δ*/2, c ∈ [2, 5] for the smallest budget
  ε/δ (:func:`moeaudit.judge.envelope.calibrate_tightest`); the level (starvation) share from a
  low quantile of the healthy run's expert shares, halved — one zero norm cannot set it to 0;
* the gate tolerances, from certify's own gates of the healthy run: ``tol_c2_rel`` (the
  largest protected-layer C2 drop plus its excess over the canary noise, relative to the
  baseline's level), ``pi_min_ratio_floor``
  (half the lowest π_min ratio), ``entropy_ratio_floor`` (twice the largest entropy-ratio dip
  below 1). A fitted tolerance is never tighter than the built-in default: the defaults are
  already meant to pass healthy runs; calibration widens them only where this model needs it.

Refused (exit 4, one line, the reason): calibrating on a run that fails the absolute health
floors, or whose own certificate under the built-in policy is not PASS; any constant that
cannot fail — a threshold of 0, ε/δ ≥ E − 1 for the normalized variance, tol_c2_rel ≥ 1 — and
any envelope under which a synthetic starved version of the run (one expert per layer carrying
the gradient, or half the experts at zero) is compliant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moeaudit.errors import InputError
from moeaudit.policy import BUILTIN, GateSettings, Policy, to_toml, validate

SAFETY = 2.0  # every fitted excursion is doubled (the level side already halves its share)


@dataclass(frozen=True)
class Fitted:
    key: str  # "gates.tol_c2_rel", "envelope.epsilon", …
    value: Any
    default: Any
    how: str


@dataclass
class CalibrationResult:
    policy: Policy
    fitted: list[Fitted]
    not_fitted: list[tuple[str, str]]  # (key, why it keeps its value)
    steps: tuple[int, int]  # the checkpoints the gate tolerances were fitted on
    envelope_steps: tuple[int, int]
    warnings: list[str] = field(default_factory=list)

    def header(self, run_dir: Path) -> str:
        lines = [
            f"moeaudit policy — calibrated by `moeaudit calibrate {run_dir}`",
            f"gate tolerances fitted on checkpoints {self.steps[0]}–{self.steps[1]}; "
            f"envelope on the series at steps {self.envelope_steps[0]}–{self.envelope_steps[1]}",
            "fitted:",
        ]
        lines += [f"  {f.key} = {f.value:.6g} (default {f.default:g}): {f.how}" for f in self.fitted]
        lines.append("kept (not fitted):")
        lines += [f"  {key}: {why}" for key, why in self.not_fitted]
        lines.append("alert_b for the normalized variant is 1.0: expert-gradient coefficient of variation above 1")
        return "\n".join(lines)


def gate_excursions(gates: Sequence[Mapping[str, Any]], protected: Sequence[int]) -> dict[str, float]:
    """The healthy run's worst excursions against its baselines, over every comparison certify
    made: the C2 allowance a protected layer needs (relative to its baseline's level), lowest
    π_min and entropy ratios."""
    c2_rel, pi, ent = 0.0, float("inf"), float("inf")
    for g in gates:
        st = g.get("structural") or g.get("continuity")
        if st is None:
            continue
        for cmp in [st, *st.get("also_against", [])]:
            pi = min(pi, cmp["pi_min_ratio"])
            ent = min(ent, cmp["entropy_ratio"])
        base = {e["layer"]: e for e in _baseline_layers(gates, g["baseline"])}
        for e in g["receipts"]["per_layer"]:
            b = base.get(e["layer"])
            if e["layer"] in protected and b and b["c2"] and e["c2"] is not None:
                drop = b["c2"] - e["c2"]
                noise = (_half(e) ** 2 + _half(b) ** 2) ** 0.5  # as gates.structural takes it
                if drop > noise:  # a drop inside noise passes whatever tol_c2_rel is
                    # the drop plus its excess over noise again: the healthy run passes its
                    # own calibration (2·drop − noise > drop), with room that grows with the
                    # part of the drop its noise does not explain
                    c2_rel = max(c2_rel, (2 * drop - noise) / abs(b["c2"]))
    if pi == float("inf"):
        raise InputError(
            "calibration needs at least two checkpoints: nothing was compared with a baseline",
            hint="calibrate on a healthy run with several checkpoints",
        )
    return {"c2_rel_drop": c2_rel, "pi_min_ratio": pi, "entropy_ratio": ent}


def _half(entry: Mapping[str, Any]) -> float:
    ci = entry.get("c2_ci95")
    return 0.5 * (ci[1] - ci[0]) if ci else 0.0


def _baseline_layers(gates: Sequence[Mapping[str, Any]], step: int) -> list[Mapping[str, Any]]:
    return next(g["receipts"]["per_layer"] for g in gates if g["step"] == step)


def fit_gates(
    gates: Sequence[Mapping[str, Any]], protected: Sequence[int], base: GateSettings, provenance: str
) -> tuple[GateSettings, list[Fitted]]:
    x = gate_excursions(gates, protected)
    default = GateSettings()
    rel = max(default.tol_c2_rel, x["c2_rel_drop"])
    pi = min(default.pi_min_ratio_floor, x["pi_min_ratio"] / SAFETY)
    ent = min(default.entropy_ratio_floor, 1 - SAFETY * max(0.0, 1 - x["entropy_ratio"]))
    if rel >= 1:
        raise InputError(
            f"the healthy run's C2 fell so far on a protected layer that the fitted "
            f"tol_c2_rel = {rel:.3g} ≥ 1 could never fail",
            hint="calibrate on a healthy run whose overlap compatibility holds",
        )
    for name, value in (("pi_min_ratio_floor", pi), ("entropy_ratio_floor", ent)):
        if not value > 0:
            raise InputError(
                f"the fitted gates.{name} is {value:.3g}: a floor of 0 can never fail",
                hint="calibrate on a healthy run (its occupancy narrowed to nothing)",
            )
    fitted = [
        Fitted(
            "gates.tol_c2_rel",
            rel,
            default.tol_c2_rel,
            "largest (2·drop − noise)/|C2 baseline| over protected layers and gates (the drop "
            "plus its excess over the bootstrap noise), never below the default",
        ),
        Fitted(
            "gates.pi_min_ratio_floor",
            pi,
            default.pi_min_ratio_floor,
            f"lowest π_min ratio {x['pi_min_ratio']:.3f} / {SAFETY:g}, never above the default",
        ),
        Fitted(
            "gates.entropy_ratio_floor",
            ent,
            default.entropy_ratio_floor,
            f"lowest entropy ratio {x['entropy_ratio']:.3f}: 1 − {SAFETY:g}·(1 − ratio), never above the default",
        ),
    ]
    settings = replace(
        base, tol_c2_rel=rel, pi_min_ratio_floor=pi, entropy_ratio_floor=ent, calibrated=True, provenance=provenance
    )
    return settings, fitted


NOT_FITTED = [
    ("gates.tol_c2", "absolute floor under the relative C2 tolerance; the canary's bootstrap noise is added per gate"),
    (
        "gates.nll_tol",
        "the canary NLL trend is decided by its paired bootstrap interval; nll_tol "
        "is only a floor on a practically relevant change",
    ),
    (
        "gates.floor_*",
        "absolute health floors are sanity floors, not tolerances: the healthy run "
        "must clear them (checked), they are not widened to fit it",
    ),
    ("gates.escalate_after, tol_dead, inconclusive_band", "decision rules, not noise levels"),
]


def calibrate_run(
    run_dir: Path,
    base: Policy,
    canary: Any,
    *,
    source: str,
    variant: str,
    since: int | None,
    cache: Any = None,
    say: Callable[[str], None] = lambda _m: None,
    progress: Any = None,
) -> CalibrationResult:
    """Fit the envelope and the gate tolerances on the healthy run ``run_dir``."""
    from moeaudit.certify import audit_run
    from moeaudit.run import discover
    from moeaudit.series import infer_warmup, model_tag, run_series

    run = discover(run_dir)
    if since is None:
        warmup = infer_warmup(run)
        for finding in warmup.findings:
            say(f"warning: {finding}")
        since = warmup.step
        say(f"warm-up: samples before step {since} are left out of the envelope fit ({warmup.how}; --since overrides)")
    audit = audit_run(run_dir, canary, base, cache=cache, say=say, progress=progress)
    pred = audit.statement["predicate"]
    health = next(c for c in pred["checks"] if c["name"] == "health")
    if health["status"] == "FAIL":
        raise InputError(
            f"not a healthy run: {health['reason']}",
            path=run_dir,
            hint="calibrate on a run that clears the absolute health floors",
        )
    # Only a run the built-in policy certifies PASS is "the healthy run": a failing or
    # inconclusive one would set loose tolerances that then transfer to every other run
    # (docs/policy.md, "What calibrate does and refuses").
    own = pred if base.source == BUILTIN else _builtin_predicate(run_dir, canary, cache, say, progress)
    if own["verdict"] != "PASS":
        raise InputError(
            f"not a healthy run: its certificate under the built-in policy is {own['verdict']} "
            f"({own['verdict_reason']})",
            path=run_dir,
            hint="calibrate on a run that moeaudit certify passes under the built-in defaults",
        )
    steps = (pred["run"]["checkpoints"][0], pred["run"]["checkpoints"][-1])
    gates, fitted = fit_gates(
        pred["gates"],
        pred["protected_layers"],
        base.gates,
        f"calibrated on {run_dir} (checkpoints {steps[0]}–{steps[1]})",
    )

    series, breaks = run_series(run_dir, source, variant, canary.source or None, progress, cache=cache)
    series = series.since(since)
    kept = [b for b in breaks if b >= since]
    stage = run.stage or base.gates.stage or "pretraining"
    model = model_tag(run.checkpoints[0][1].spec)
    try:
        settings, warnings, check = _fit_envelope(
            series, base, variant, kept, run_dir, since=since, stage=stage, model=model
        )
    except InputError as exc:  # no falsifiable variance bound: fit and gate the level side only
        settings, warnings = _level_only(
            series, base, variant, kept, run_dir, exc, since=since, stage=stage, model=model
        )
        check = None
    if check is not None:
        settings = replace(
            settings,
            provenance=settings.provenance
            + (
                f"; falsifiable: a starved version of this run leaves the envelope at step "
                f"{check['at_step']} ({check['caught_by']} check)"
            ),
        )
        fitted += [
            Fitted(
                "envelope.sampling_interval",
                settings.sampling_interval,
                base.envelope.sampling_interval,
                "the block size the fit holds at (steps)",
            ),
            Fitted("envelope.epsilon", settings.epsilon, base.envelope.epsilon, "c·Var_t[V] (000 Eq. 16)"),
            Fitted("envelope.delta", settings.delta, base.envelope.delta, "δ*/2 (docs/envelope.md)"),
        ]
    fitted.append(
        Fitted(
            "envelope.starve_share",
            settings.starve_share,
            base.envelope.starve_share,
            "1% quantile of the healthy expert shares, halved",
        )
    )
    policy = replace(base, envelope=settings, gates=gates)
    validate(policy, "<calibrated policy>")
    return CalibrationResult(policy, fitted, NOT_FITTED, steps, (series.steps[0], series.steps[-1]), warnings)


def _builtin_predicate(run_dir: Path, canary: Any, cache: Any, say: Callable[[str], None], progress: Any) -> Any:
    """The run's own certificate predicate under the built-in policy."""
    from moeaudit.certify import audit_run

    say("checking the run under the built-in policy (calibrate fits only a run it certifies PASS)")
    return audit_run(run_dir, canary, Policy(), cache=cache, say=say, progress=progress).statement["predicate"]


LADDER = (2, 5, 10, 20, 50, 100, 200, 500)  # block sizes tried after the native sampling
MIN_BLOCKS = 8


def _fit_envelope(
    series: Any, base: Policy, variant: str, breaks: Sequence[int], where: Path, *, since: int, stage: str, model: str
) -> tuple[Any, list[str], dict[str, Any]]:
    """The tightest falsifiable envelope at the finest sampling that admits one: the native
    sampling first, then block means of 2, 5, 10, … steps (a log of every step carries each
    minibatch's noise; `000`'s V is an expectation). The policy records the block size as
    ``sampling_interval``, and evaluation averages finer series into it (envelope.resample)."""
    from moeaudit.judge import envelope as env

    gap = env.median_gap(series.steps) or 1
    span = series.steps[-1] - series.steps[0] if series.steps else 0
    blocks = [gap] + [k for k in LADDER if k > gap and span / k >= MIN_BLOCKS]
    first_error: InputError | None = None
    for k in blocks:
        sub = env.resample(series, k)
        try:
            fit = env.calibrate_tightest(sub, replace(base.envelope, variant=variant), breaks=breaks)
            settings = replace(
                fit.settings,
                source=series.source,
                warmup_steps=since,
                alert_b=base.envelope.alert_b if variant == "raw" else 1.0,
                calibrated_stage=stage,
                calibrated_model=model,
            )
            warnings, bad = _refuse_unfalsifiable(sub, settings, breaks, where)
        except InputError as exc:
            first_error = first_error or exc
            continue
        check = env.falsifiability(sub, settings, breaks=breaks, known_bad_report=bad)
        if k != gap:
            warnings.append(
                f"the series (logged every {gap} step(s)) admits no falsifiable envelope at "
                f"that sampling; fitted on means over blocks of {k} steps, and checked so"
            )
        return settings, warnings, check
    assert first_error is not None
    tried = ", ".join(map(str, blocks[1:]))  # none when the series is too short for coarser blocks
    raise InputError(
        first_error.what + (f" (also tried block means of {tried} steps)" if tried else ""),
        path=first_error.path,
        hint=first_error.hint,
    )


def _level_only(
    series: Any,
    base: Policy,
    variant: str,
    breaks: Sequence[int],
    where: Path,
    why: InputError,
    *,
    since: int,
    stage: str,
    model: str,
) -> tuple[Any, list[str]]:
    """When no variance bound both fits the healthy run and can fail (small, noisy runs: a rise
    between samples larger than ε·Δ for every c in [2, 5]), the variance side keeps its
    illustrative constants — reported, never gated — and only the scale-free level check is
    fitted; it must still reject both synthetic starved runs."""
    from moeaudit.judge import envelope as env

    share = env.healthy_share(series)
    if share is None:
        raise why
    settings = replace(
        base.envelope,
        variant=variant,
        source=series.source,
        warmup_steps=since,
        starve_share=share / env.LEVEL_SAFETY,
        calibrated=False,
        calibrated_stage=stage,
        calibrated_model=model,
        alert_b=base.envelope.alert_b if variant == "raw" else 1.0,
        provenance=(
            f"variance bound not fitted ({why.what}); illustrative, reported and "
            f"not gated. starve_share = {share:.4g}/{env.LEVEL_SAFETY:g} (1% "
            f"quantile of the expert shares of {series.origin}, halved)"
        ),
    )
    warnings, _ = _refuse_unfalsifiable(series, settings, breaks, where)
    warnings.append(
        f"no falsifiable variance bound fits this run ({why.what}); the variance side "
        "stays illustrative (reported, not gated) and only the starvation level check "
        "is fitted and gated"
    )
    return settings, warnings


def _refuse_unfalsifiable(series: Any, settings: Any, breaks: Sequence[int], where: Path) -> tuple[list[str], Any]:
    """Refuse an envelope that cannot fail; the warnings for one that is merely loose, and the
    report of the run with one expert per layer carrying the gradient (for falsifiability)."""
    from moeaudit.judge import envelope as env

    if not settings.starve_share > 0:
        raise InputError(
            "the fitted starvation share is 0: the healthy run has an expert with zero "
            "gradient on more than the quantile's share of its samples",
            path=where,
            hint="calibrate on a healthy run (no starved experts)",
        )
    budget = settings.epsilon / settings.delta
    sizes = [len(v[0]) for v in (series.norms or {}).values() if v]
    if settings.calibrated and settings.variant == "normalized" and sizes and budget >= min(sizes) - 1:
        raise InputError(
            f"the fitted budget ε/δ = {budget:.4g} is at or above E − 1 = {min(sizes) - 1}, "
            "the largest normalized variance E experts can have: the variance bound "
            "could never fail",
            path=where,
            hint="calibrate on a healthy run, or at a coarser sampling",
        )
    reports = []
    for starve, what in (
        (env.known_bad, "one expert per layer carrying the gradient"),
        (env.half_dead, "half the experts of every layer at zero gradient"),
    ):
        report = env.evaluate(starve(series), settings, breaks=breaks)  # one starved copy at a time
        reports.append(report)
        rejected = bool(report["starvation"]) or (settings.calibrated and not report["compliant"])
        if not rejected:
            raise InputError(
                f"the fitted envelope (budget ε/δ = {budget:.4g}, starve_share "
                f"{settings.starve_share:.3g}) accepts a starved run — {what} — so it "
                "could certify nothing",
                path=where,
                hint="calibrate on a longer healthy run, or at a coarser sampling",
            )
    warnings = []
    if settings.calibrated and settings.variant == "normalized" and sizes and budget >= (min(sizes) - 1) / 2:
        warnings.append(
            f"the variance bound alone is loose (ε/δ = {budget:.4g} ≥ (E − 1)/2 = "
            f"{(min(sizes) - 1) / 2:g}); a starved run is still rejected by the level check"
        )
    return warnings, reports[0]


def write_policy(result: CalibrationResult, run_dir: Path, out: Path) -> None:
    from moeaudit.jsonio import atomic_write

    atomic_write(out, to_toml(result.policy, result.header(run_dir)))
