"""The envelope report, ``moeaudit.envelope/v1`` (docs/envelope.md): every series of a run checked under
the policy's settings, the rules on its per-expert norms, its sampling and its first violation
(:func:`evaluate`). See ``docs/envelope.md`` and ``docs/policy.md``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Literal, TypedDict

from moeaudit.errors import InputError
from moeaudit.judge import envelope_columns as columns
from moeaudit.judge.envelope_checks import SeriesCheck, budget, check_series_long, composed_bound, segments
from moeaudit.judge.envelope_rules import AlertStream, alerts, unevaluable_rules
from moeaudit.judge.envelope_series import EnvelopeSeries, median_gap, resample
from moeaudit.metrics import POOLED
from moeaudit.policy import EnvelopeSettings, alert_rule_problem
from moeaudit.records import EnvelopeComparison, EnvelopeReport, Sampling, ShownRows, StepWindow, Violation

SCHEMA: Literal["moeaudit.envelope/v1"] = "moeaudit.envelope/v1"


class _Optional(TypedDict, total=False):
    """The report's fields that not every report has (``shown`` and ``window`` are placed by
    :func:`evaluate`; ``comparison`` and ``fallback`` are added by :mod:`moeaudit.series`)."""

    shown: dict[str, ShownRows]
    window: StepWindow
    comparison: EnvelopeComparison
    fallback: str
    precision: str


# --- the report (`moeaudit.envelope/v1`) ---------------------------------------------------------


def evaluate(
    series: EnvelopeSeries,
    settings: EnvelopeSettings,
    *,
    breaks: Iterable[int] = (),
    policy_path: str | None = None,
    numpy_rows: int = 0,
) -> EnvelopeReport:
    """Check every series of ``series`` under ``settings``; the plain-dict envelope report.

    ``breaks``: steps of resume / regime-change events; windows re-anchor at the first sample at
    or after each, and the discrete pair across it is not checked (listed under ``skipped``).
    ``numpy_rows``: up to how many samples the caller's memory budget allows the level rule to
    import numpy (:func:`moeaudit.judge.envelope_columns.starvation_columns`).
    """
    _check_fit(series, settings, policy_path)
    d, e, tau = settings.delta, settings.epsilon, settings.window
    breaks = sorted(breaks)
    streams: dict[str, AlertStream] = {}
    fed: columns.LazyValues | None = None
    if isinstance(series.values, columns.LazyValues) and series.norms is not None:
        # a parsed log: V of a sample is computed once, as the checks (or the block means) read
        # it, and fed to the alert rule of its series on the way (docs/envelope.md, "Long series")
        s = settings
        streams = {k: AlertStream(series.steps, s.alert_a, s.alert_b, s.alert_n) for k in series.values}
        fed = series.values.feeding({k: stream.add for k, stream in streams.items()})
        series = replace(series, values=fed, notes=columns.LazyNotes(fed))
    native = series
    if settings.calibrated:  # the variance bound at the sampling it was fitted at
        series = resample(series, settings.sampling_interval)
    # check_series in one pass a series, keeping the rows the report shows (docs/envelope.md,
    # "Long series"); the verdict is over every sample
    checks = {
        key: check_series_long(series.steps, values, d, e, tau, breaks=breaks, notes=series.notes.get(key))
        for key, values in series.values.items()
    }
    thinned: _Optional = (
        {"shown": {key: c.counts for key, c in checks.items()}} if any(c.thinned for c in checks.values()) else {}
    )
    samples = sampling(series, settings)
    if series is not native:
        samples["resampled"] = {
            "native_gap": median_gap(native.steps),
            "block": settings.sampling_interval,
            "samples": len(series.steps),
        }
    span: _Optional = {"window": {"from": native.steps[0], "to": native.steps[-1]}} if native.steps else {}
    # The variance bound (Grönwall + Δ-step) is gated only under calibrated constants: under
    # 000 Table 6's illustrative ones it is reported, never a non-compliance (docs/policy.md).
    # ``compliant`` is the gated rules alone, what certify's envelope check reads; the variance
    # result is named as reported where it is not gated (``variance_within_bound``).
    within = all(c.compliant for c in checks.values())
    report: EnvelopeReport = {
        "schema": SCHEMA,
        "source": series.source,
        "origin": series.origin,
        "variant": series.variant,
        "constants": {"delta": d, "epsilon": e, "window": tau, "budget": budget(d, e)},
        "calibrated": settings.calibrated,
        "provenance": settings.provenance,
        "rules": {
            "alert": {"a": settings.alert_a, "b": settings.alert_b, "n": settings.alert_n},
            "dead_expert": {"grad": settings.dead_grad, "steps": settings.dead_steps},
            "starvation": {
                "share": settings.starve_share,
                "steps": settings.starve_steps,
                "fraction": settings.starve_fraction,
            },
        },
        "series": {key: c.samples for key, c in checks.items()},
        "windows": [{"series": key, **w} for key, c in checks.items() for w in c.windows],
        "discrete": [{"series": key, **r} for key, c in checks.items() for r in c.discrete],
        "compliant": within or not settings.calibrated,
        "first_violation": first_violation(checks),
        "alerts": [],
        "dead_experts": [],
        "starvation": [],
        "findings": list(series.findings),
        "skipped": [
            {
                "check": "discrete",
                "series": "*",
                "from_step": series.steps[s.start - 1],
                "to_step": series.steps[s.start],
                "reason": "resume / regime change between",
            }
            for s in segments(series.steps, breaks)[1:]
        ],
        **thinned,
        "sampling": samples,
        **span,
        "variance_gated": bool(settings.calibrated),
        "variance_within_bound": within,
        "unevaluable": unevaluable_rules(native, settings),
    }
    if native.precision:  # a canary probe over bf16/fp16 weights: not the replay's float32
        report["precision"] = native.precision
    if fed is not None:
        fed.finish()  # the samples no check read (a partial block left out by resample)
    _rules(native, settings, report, streams, numpy_rows)  # the level rules on every logged sample
    if report["starvation"]:
        report["compliant"] = False
        first = min(report["starvation"], key=lambda r: (r["step"], r["layer"] == POOLED))
        fv = report["first_violation"]
        if fv is None or first["step"] < fv["step"]:
            report["first_violation"] = {
                "layer": first["layer"],
                "step": first["step"],
                "check": "starvation",
                "expert": first["expert"],
                "value": first["share"],
                "bound": settings.starve_share,
                "steps": first["steps"],
                "fraction": first["fraction"],
                "series": [first["layer"]],
            }
    return report


def sampling(series: EnvelopeSeries, settings: EnvelopeSettings) -> Sampling:
    """Is the series sampled as the constants assume, and can it fail at this sampling at all?

    ``envelope.sampling_interval`` is the gap the constants were fitted at (``calibrate``
    records it). Constants do not transfer between gaps: the Δ-step bound from V = 0,
    ``ε(1 − (1−δ)^Δ)/δ``, grows with Δ. For the normalized variant V of E experts is at most
    E − 1 (a variance over a squared mean of non-negative values), so where that bound
    reaches E − 1 no value can fail the discrete check, nor the Grönwall windows (whose bound
    is at least ε/δ): such series are listed under ``vacuous``.
    """
    gap = median_gap(series.steps)
    out: Sampling = {
        "policy_interval": settings.sampling_interval,
        "median_gap": gap,
        "floor_bound": None,
        "vacuous": [],
        "warnings": [],
    }
    if gap is None:
        return out
    if gap != settings.sampling_interval:
        out["warnings"].append(
            f"the constants are for samples every {settings.sampling_interval} steps "
            f"(envelope.sampling_interval); this series is sampled every {gap} (median gap) — "
            "constants fitted at one sampling do not transfer to another; calibrate at this one"
        )
    floor = composed_bound(0.0, settings.delta, settings.epsilon, gap)
    out["floor_bound"] = floor
    if series.variant != "normalized" or not series.norms:
        return out
    sizes = {k: len(next((v for v in vs if v is not None), ())) for k, vs in series.norms.items()}
    sizes[POOLED] = sum(sizes.values())
    out["vacuous"] = [k for k in series.values if k in sizes and floor >= sizes[k] - 1]
    if out["vacuous"]:
        out["warnings"].append(
            f"vacuous at this sampling: from V = 0 the {gap}-step bound is {floor:.4g}, at or above "
            f"the largest possible var_grad_norm (E − 1) of series {', '.join(out['vacuous'])}; "
            "nothing there can leave the envelope"
        )
    return out


def _check_fit(series: EnvelopeSeries, settings: EnvelopeSettings, policy_path: str | None) -> None:
    if series.variant != settings.variant:
        raise InputError(
            f"the series is {series.variant!r} variance but the policy asks for {settings.variant!r}",
            path=policy_path,
            hint="build the series with the policy's envelope.variant",
        )
    if len(series.steps) < 2:
        raise InputError("the envelope needs at least two samples (steps) of the series", path=series.origin or None)
    if series.norms is not None:
        sizes = {k: len(v[0]) for k, v in series.norms.items()}  # with_pooled's widths, not its copy
        sizes = {POOLED: sum(sizes.values()), **sizes}
        for key, size in sorted(sizes.items(), key=lambda kv: kv[0] == POOLED):  # layers first
            why = alert_rule_problem(settings.alert_a, settings.alert_b, settings.variant, size)
            if why:
                raise InputError(f"envelope.alert_b: on series {key!r}, {why}", path=policy_path)


def first_violation(checks: Mapping[str, SeriesCheck | columns.LongCheck]) -> Violation | None:
    """The earliest step where any series leaves the envelope (a layer before "pooled")."""
    # (step, rank, series, check, value, bound, from_step of a discrete pair)
    found: list[tuple[int, tuple[bool, int], str, str, float | None, float | None, int | None]] = []
    for order, (key, c) in enumerate(checks.items()):
        rank = (key == POOLED, order)  # at a tie a layer names the place, pooled last
        for r in c.samples:
            if not r["compliant"]:
                found.append((r["step"], rank, key, "gronwall", r["value"], r["bound"], None))
        for p in c.discrete:
            if not p["compliant"]:
                found.append((p["to_step"], rank, key, "discrete", p["value"], p["bound"], p["from_step"]))
    if not found:
        return None
    step, _, key, check, value, bound, from_step = min(found, key=lambda f: (f[0], f[1], f[3] != "gronwall"))
    out: Violation = {"layer": key, "step": step, "check": check, "value": value, "bound": bound}
    if from_step is not None:
        out["from_step"] = from_step
    out["series"] = [f[2] for f in sorted({f[:3] for f in found if f[0] == step}, key=lambda f: f[1])]
    return out


def _rules(
    series: EnvelopeSeries,
    settings: EnvelopeSettings,
    report: EnvelopeReport,
    streams: Mapping[str, AlertStream],
    numpy_rows: int,
) -> None:
    if series.norms is None:
        for check in ("alert rule (000 Eq. 21)", "dead experts (000 §10.3)", "starvation (000 §8.1 level side)"):
            report["skipped"].append(
                {"check": check, "series": "*", "reason": "no per-expert gradient norms in the series"}
            )
        return
    s = settings
    by_series = {POOLED: columns.PooledRows(series.norms), **series.norms}  # with_pooled, a step at a time
    for key, vectors in by_series.items():
        found = (
            streams[key].out
            if key in streams
            else alerts(series.steps, vectors, series.values[key], s.alert_a, s.alert_b, s.alert_n)
        )
        for a in found:
            report["alerts"].append({"series": key, **a})
    for layer, norms in series.norms.items():
        for dead in columns.dead_experts_columns(series.steps, norms, s.dead_grad, s.dead_steps):
            report["dead_experts"].append({"layer": layer, **dead})
        for starved in columns.starvation_columns(
            series.steps, norms, s.starve_share, s.starve_steps, s.starve_fraction, numpy_rows=numpy_rows
        ):
            report["starvation"].append({"layer": layer, **starved})
