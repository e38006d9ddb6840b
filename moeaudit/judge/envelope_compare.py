"""Training logs vs checkpoint replays, window by window (docs/envelope.md, "Logs vs replays, window by window").

The windows are the intervals ``[t_a, t_b]`` between consecutive checkpoints (consecutive replay
samples). For every window and series (each routed layer and ``pooled``) three verdicts:

* ``replay`` — the Δ-step composed condition (`000` Eq. 11 applied Δ = t_b − t_a times) between
  the replays at t_a and t_b, under the replay constants;
* ``logs`` — every logged discrete pair ending in (t_a, t_b], each the composed condition over
  its own gap, under the logs constants. By the composition law, passing all of them implies
  passing the composed condition between any two logged steps of the window;
* ``logs_endpoints`` — the Δ-step condition between the logged samples at t_a and t_b only: the
  replay's check, on the other source, under the constants for logs sampled at checkpoints;
* ``probe`` (when the run has the hook's ``canary_probe.jsonl``) — the same check on the
  canary gradients the training process logged at its saves: the replay's quantity computed
  by other code (the trainer's autograd, in the trainer's numerics), so where the replay and
  the probe disagree, one of them is wrong.

Within one segment (no break), a series is compliant iff all its discrete pairs are (the
Grönwall windows are implied by the pairs), so the windows partition the run verdict between
the first and last checkpoint. Torch-free, plain data (STYLE).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from moeaudit.judge.envelope import (
    Calibration,
    EnvelopeSeries,
    budget,
    calibrate,
    discrete_checks,
    segments,
)
from moeaudit.records import (
    Agreement,
    AgreementRate,
    AgreementRates,
    ComparedWindow,
    EndpointCheck,
    LogsWindow,
    NotCompared,
    PairCheck,
    ProbeAgreement,
    ViewConstants,
    ViewsConstants,
    WindowComparison,
)

if TYPE_CHECKING:
    from moeaudit.policy import EnvelopeSettings

VIEWS = ("replay", "logs", "logs_endpoints")  # which constants each verdict is judged under


def calibrate_sources(
    base: EnvelopeSettings,
    *,
    logs: EnvelopeSeries | None = None,
    replay: EnvelopeSeries | None = None,
    probe: EnvelopeSeries | None = None,
    breaks: Iterable[int] = (),
) -> dict[str, EnvelopeSettings]:
    """Each view's constants fitted on one healthy run, from the same source and sampling.

    ``logs`` on every logged step, ``replay`` on the replays, and with both, ``logs_endpoints``
    on the logs at the replay's (checkpoint) steps only. Trim warm-up before calling.
    """
    breaks = list(breaks)
    fits: dict[str, Calibration] = {}
    if replay is not None:
        fits["replay"] = calibrate(replay, base, breaks=breaks)
    if logs is not None:
        fits["logs"] = calibrate(logs, base, breaks=breaks)
    if logs is not None and replay is not None:
        fits["logs_endpoints"] = calibrate(logs.at(replay.steps), base, breaks=breaks)
    if probe is not None:
        fits["probe"] = calibrate(probe, base, breaks=breaks)
    out = {v: f.settings for v, f in fits.items()}
    if "logs_endpoints" in out:
        s = out["logs_endpoints"]
        out["logs_endpoints"] = replace(s, provenance="logs at the checkpoint steps only; " + s.provenance)
    return out


def compare(
    logs: EnvelopeSeries,
    replay: EnvelopeSeries,
    constants: Mapping[str, EnvelopeSettings],
    *,
    breaks: Iterable[int] = (),
    probe: EnvelopeSeries | None = None,
) -> WindowComparison:
    """The per-window side-by-side comparison (the ``comparison`` field of the report).

    ``constants``: settings per view (:data:`VIEWS`, plus ``probe`` with a ``probe`` series).
    A window that a break (resume / regime change) falls in, ``t_a < b ≤ t_b``, is not
    compared and is listed under ``skipped``.
    """
    keys = [k for k in replay.values if k in logs.values]
    breaks = sorted(breaks)
    rows: list[ComparedWindow] = []
    skipped: list[NotCompared] = [
        {"series": k, "reason": f"only in the {name} series"}
        for name, a, b in (("replay", replay, logs), ("logs", logs, replay))
        for k in a.values
        if k not in b.values
    ]
    pairs = {k: _logged_pairs(logs, k, constants["logs"], breaks) for k in keys}
    for index, (t_a, t_b) in enumerate(zip(replay.steps, replay.steps[1:], strict=False)):
        cut = [b for b in breaks if t_a < b <= t_b]
        if cut:
            skipped.append(
                {
                    "window": index,
                    "start": t_a,
                    "end": t_b,
                    "reason": f"resume / regime change at step {cut[0]} in the window",
                }
            )
            continue
        for key in keys:
            row = _window(index, t_a, t_b, key, logs, replay, constants, pairs[key])
            if probe is not None:
                row["probe"] = _at_endpoints(t_a, t_b, probe, key, constants["probe"])
                row["agree_probe"] = _same(row["replay"]["compliant"], row["probe"]["compliant"])
            rows.append(row)
    views: ViewsConstants = {
        "replay": _constants(constants["replay"]),
        "logs": _constants(constants["logs"]),
        "logs_endpoints": _constants(constants["logs_endpoints"]),
    }
    if probe is not None:
        views["probe"] = _constants(constants["probe"])
    out: WindowComparison = {"windows": rows, "skipped": skipped, "agreement": agreement(rows), "constants": views}
    if probe is not None:
        out["probe_vs_replay"] = _value_agreement(probe, replay)
    return out


def _window(
    index: int,
    t_a: int,
    t_b: int,
    key: str,
    logs: EnvelopeSeries,
    replay: EnvelopeSeries,
    constants: Mapping[str, EnvelopeSettings],
    logged_pairs: list[PairCheck],
) -> ComparedWindow:
    j = replay.steps.index(t_a)
    r = _endpoint_check(t_a, t_b, replay.values[key][j], replay.values[key][j + 1], constants["replay"])
    e = _at_endpoints(t_a, t_b, logs, key, constants["logs_endpoints"])
    w = _logs_window([p for p in logged_pairs if t_a < p["to_step"] <= t_b], sum(t_a <= t <= t_b for t in logs.steps))
    return {
        "series": key,
        "window": index,
        "start": t_a,
        "end": t_b,
        "gap": t_b - t_a,
        "replay": r,
        "logs": w,
        "logs_endpoints": e,
        "agree": _same(r["compliant"], w["compliant"]),
        "agree_endpoints": _same(r["compliant"], e["compliant"]),
    }


def _at_endpoints(t_a: int, t_b: int, source: EnvelopeSeries, key: str, s: EnvelopeSettings) -> EndpointCheck:
    """The endpoint check on a logged source's samples at t_a and t_b (when it has both)."""
    at = dict(zip(source.steps, source.values.get(key, ()), strict=False))
    if t_a in at and t_b in at:
        return _endpoint_check(t_a, t_b, at[t_a], at[t_b], s)
    missing = [t for t in (t_a, t_b) if t not in at]
    return {
        "value_from": at.get(t_a),
        "value": at.get(t_b),
        "bound": None,
        "margin": None,
        "compliant": None,
        "reason": f"no logged sample at step {missing[0]}",
    }


def _value_agreement(probe: EnvelopeSeries, replay: EnvelopeSeries) -> ProbeAgreement:
    """How close the probe's V is to the replay's at the steps both have: the largest relative
    difference per series (a cross-check of the replay against the trainer's own autograd)."""
    steps = [t for t in replay.steps if t in probe.steps]
    worst: dict[str, float | None] = {}
    for key, r_values in replay.values.items():
        if key not in probe.values:
            continue
        p_at = dict(zip(probe.steps, probe.values[key], strict=True))
        r_at = dict(zip(replay.steps, r_values, strict=True))
        pairs = [(p, r) for t in steps if (p := p_at[t]) is not None and (r := r_at[t]) is not None]
        diffs = [abs(p - r) / max(abs(r), 1e-30) for p, r in pairs]
        worst[key] = max(diffs) if diffs else None
    known = [v for v in worst.values() if v is not None]
    return {"steps": steps, "max_rel_diff": max(known) if known else None, "by_series": worst}


def _endpoint_check(t_a: int, t_b: int, v_a: float | None, v_b: float | None, s: EnvelopeSettings) -> EndpointCheck:
    """The Δ-step composed condition between two samples (a one-pair ``discrete_checks``)."""
    row = discrete_checks([t_a, t_b], [v_a, v_b], s.delta, s.epsilon)[0]
    out: EndpointCheck = {
        "value_from": row["value_from"],
        "value": row["value"],
        "bound": row["bound"],
        "margin": row["margin"],
        "compliant": row["compliant"],
    }
    if "reason" in row:
        out["reason"] = row["reason"]
    return out


def _logged_pairs(logs: EnvelopeSeries, key: str, s: EnvelopeSettings, breaks: Sequence[int]) -> list[PairCheck]:
    """The logs' discrete pairs of one series, none across a break (as in ``evaluate``)."""
    out: list[PairCheck] = []
    for seg in segments(logs.steps, breaks):
        t = [logs.steps[j] for j in seg]
        out += discrete_checks(t, [logs.values[key][j] for j in seg], s.delta, s.epsilon)
    return out


def _logs_window(pairs: list[PairCheck], samples: int) -> LogsWindow:
    """The logs' verdict on one window: every logged pair ending in it must comply."""
    bad = [p for p in pairs if not p["compliant"]]
    finite = [(m, p) for p in pairs if (m := p["margin"]) is not None]
    worst = bad[0] if bad and bad[0]["margin"] is None else min(finite, key=lambda mp: mp[0], default=(0.0, None))[1]
    out: LogsWindow = {
        "samples": samples,
        "pairs": len(pairs),
        "violations": len(bad),
        "first_violation": bad[0]["to_step"] if bad else None,
        "min_margin": None if worst is None else worst["margin"],
        "worst": None
        if worst is None
        else {
            "from_step": worst["from_step"],
            "to_step": worst["to_step"],
            "value_from": worst["value_from"],
            "value": worst["value"],
            "bound": worst["bound"],
        },
        "compliant": (not bad) if pairs else None,
    }
    if not pairs:
        out["reason"] = "no logged pair ends in the window"
    return out


def _same(a: bool | None, b: bool | None) -> bool | None:
    return None if a is None or b is None else a == b


def agreement(rows: Sequence[ComparedWindow]) -> Agreement:
    """Agreement rates over every compared (window, series), overall and per series."""

    def rate(agrees: Iterable[bool | None]) -> AgreementRate:
        known = [a for a in agrees if a is not None]
        return {"compared": len(known), "agree": sum(known), "rate": sum(known) / len(known) if known else None}

    series = list(dict.fromkeys(r["series"] for r in rows))
    by = {k: [r for r in rows if r["series"] == k] for k in series}

    def both(subset: Sequence[ComparedWindow]) -> AgreementRates:
        out: AgreementRates = {
            "logs": rate(r["agree"] for r in subset),
            "logs_endpoints": rate(r["agree_endpoints"] for r in subset),
        }
        if any("agree_probe" in r for r in subset):
            out["probe"] = rate(r.get("agree_probe") for r in subset)
        return out

    return {**both(rows), "by_series": {k: both(v) for k, v in by.items()}}


def _constants(s: EnvelopeSettings) -> ViewConstants:
    return {
        "delta": s.delta,
        "epsilon": s.epsilon,
        "budget": budget(s.delta, s.epsilon),
        "calibrated": s.calibrated,
        "provenance": s.provenance,
    }
