"""The Gradient Starvation Envelope (`000` §6, §10; docs/envelope.md): checks, report, calibration, alerts.

A series ``V(t_j)`` — ``var_grad`` ("raw") or ``var_grad_norm`` ("normalized") per routed layer
and pooled, at training steps t_0 < t_1 < … from training logs or checkpoint replays — is held
to two conditions, and is compliant only if both hold everywhere:

* discrete, between consecutive samples Δ = t_{j+1} − t_j steps apart, the Δ-fold composition of
  `000` Eq. 11: ``V(t_{j+1}) ≤ (1−δ)^Δ V(t_j) + ε (1 − (1−δ)^Δ)/δ``;
* Grönwall (`000` Eq. 12), in compliance windows of length τ anchored at a sample a:
  ``B(t) = V(a) e^{−δ(t−a)} + ε/δ`` and margin ``B(t) − V(t) ≥ 0`` at every sample of the window.

Window rule: the first sample anchors window 0; a window holds its anchor and every later sample
at most τ steps after it (closed, as `000` Clause 1), and at least the next sample (a window
whose horizon holds none is *stretched* to it and marked so). Its last sample anchors the next
window, so every sample after the first is checked against a bound anchored strictly before it.

Everything here takes plain Python data (STYLE: torch stays out of the envelope algebra); the
per-step variances come from :mod:`moeaudit.metrics`. See ``docs/envelope.md``.

This module is the envelope's one import: it re-exports the parts, each in its own module —
the bounds and the checks of one series (:mod:`~moeaudit.judge.envelope_checks`), the series
and its sources (:mod:`~moeaudit.judge.envelope_series`), the rules on per-expert norms
(:mod:`~moeaudit.judge.envelope_rules`), the report (:mod:`~moeaudit.judge.envelope_report`)
and calibration (:mod:`~moeaudit.judge.envelope_calibrate`).
"""

from __future__ import annotations

from moeaudit.judge.envelope_calibrate import (
    C_RANGE,
    CALIBRATION_C,
    LEVEL_SAFETY,
    SHARE_QUANTILE,
    Calibration,
    calibrate,
    calibrate_tightest,
    falsifiability,
    half_dead,
    healthy_share,
    known_bad,
)
from moeaudit.judge.envelope_checks import (
    RTOL,
    SeriesCheck,
    budget,
    check_series,
    check_series_long,
    composed_bound,
    discrete_checks,
    gronwall,
    holds,
    segments,
    windows,
)
from moeaudit.judge.envelope_report import (
    SCHEMA,
    evaluate,
    first_violation,
    sampling,
)
from moeaudit.judge.envelope_rules import (
    alerts,
    dead_experts,
    starvation,
    starvation_evaluable,
    unevaluable_rules,
)
from moeaudit.judge.envelope_series import (
    SOURCES,
    EnvelopeSeries,
    Record,
    from_metrics,
    from_norms,
    from_records,
    median_gap,
    resample,
)
from moeaudit.policy import alert_rule_problem  # tests and callers import it from here

__all__ = [
    "RTOL",
    "composed_bound",
    "gronwall",
    "budget",
    "segments",
    "windows",
    "discrete_checks",
    "SeriesCheck",
    "check_series",
    "holds",
    "check_series_long",
    "SOURCES",
    "EnvelopeSeries",
    "from_norms",
    "from_metrics",
    "Record",
    "from_records",
    "median_gap",
    "resample",
    "alerts",
    "dead_experts",
    "starvation",
    "starvation_evaluable",
    "unevaluable_rules",
    "SCHEMA",
    "evaluate",
    "sampling",
    "first_violation",
    "CALIBRATION_C",
    "Calibration",
    "calibrate",
    "C_RANGE",
    "LEVEL_SAFETY",
    "calibrate_tightest",
    "SHARE_QUANTILE",
    "healthy_share",
    "half_dead",
    "known_bad",
    "falsifiability",
    "alert_rule_problem",
]
