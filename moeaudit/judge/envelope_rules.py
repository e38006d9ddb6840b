"""The envelope's rules on per-expert gradient norms: the alert rule (`000` Eq. 21), dead experts
(§10.3) and starvation (the level side of §8.1 / Eq. 13), and which gated rule a series is too
short to evaluate. The long-series forms are in :mod:`moeaudit.judge.envelope_columns`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from moeaudit.metrics import layer_total
from moeaudit.records import AlertRun, DeadRun, StarvedWindow, Unevaluable

if TYPE_CHECKING:
    from moeaudit.judge.envelope_series import EnvelopeSeries
    from moeaudit.policy import EnvelopeSettings


# --- alert rule (`000` Eq. 21) and dead experts (§10.3) ------------------------------------------


class AlertStream:
    """Eq. 21 on one series fed a sample at a time, in step order (:func:`alerts` is this over a
    whole series): a long log's V is computed once per sample, for the checks and this rule alike
    (:class:`moeaudit.judge.envelope_columns.VarianceColumn`, ``feed``)."""

    __slots__ = ("steps", "a", "b", "n", "out", "_since", "_count")

    def __init__(self, steps: Sequence[int], a: float, b: float, n: int):
        self.steps, self.a, self.b, self.n = steps, a, b, n
        self.out: list[AlertRun] = []
        self._since, self._count = 0, 0  # the current run of samples meeting the condition

    def add(self, j: int, g_E: Sequence[float | None], v: float | None) -> None:
        """Sample ``j`` (the one after the last added): its norms and its V."""
        known = [g for g in g_E if g is not None]
        if v is not None and len(known) == len(g_E) and max(known) < self.a and v > self.b:
            if not self._count:
                self._since = j
            self._count += 1
            if self._count == self.n:
                self.out.append(
                    {
                        "step": self.steps[j],
                        "since": self.steps[self._since],
                        "until": self.steps[j],
                        "samples": self.n,
                        "max_grad": max(known),
                        "value": v,
                    }
                )
            elif self._count > self.n:
                self.out[-1]["until"], self.out[-1]["samples"] = self.steps[j], self._count
        else:
            self._count = 0


def alerts(
    steps: Sequence[int],
    norms: Sequence[Sequence[float | None]],
    values: Sequence[float | None],
    a: float,
    b: float,
    n: int,
) -> list[AlertRun]:
    """Eq. 21 on one series: ``max_e g_e < a ∧ V > b`` for n consecutive samples.

    One alert per run of consecutive samples meeting the condition, firing at the n-th; a
    sample with a non-finite norm or value ends a run (it is already a finding).
    """
    stream = AlertStream(steps, a, b, n)
    for j, (g_E, v) in enumerate(zip(norms, values, strict=True)):
        stream.add(j, g_E, v)
    return stream.out


def dead_experts(
    steps: Sequence[int], norms: Sequence[Sequence[float | None]], dead_grad: float, dead_steps: int
) -> list[DeadRun]:
    """§10.3: expert e is dead once ``g_e < dead_grad`` for more than ``dead_steps`` steps.

    Counted in training steps, not samples (logs may be every K steps): a run of consecutive
    below-threshold samples from t_i to t_j spans t_j − t_i + 1 steps, assuming the unlogged
    steps between them were below too. A null norm ends a run.
    """
    out: list[DeadRun] = []
    for e in range(len(norms[0]) if norms else 0):
        since: int | None = None
        entry: DeadRun | None = None
        for j, g_E in enumerate(norms):
            g = g_E[e]
            if g is not None and g < dead_grad:
                since = steps[j] if since is None else since
                if steps[j] - since + 1 > dead_steps:
                    if entry is None:
                        entry = {
                            "expert": e,
                            "since": since,
                            "step": steps[j],
                            "until": steps[j],
                            "steps": steps[j] - since + 1,
                            "recovered": False,
                        }
                        out.append(entry)
                    else:
                        entry["until"], entry["steps"] = steps[j], steps[j] - since + 1
            else:
                if entry is not None and g is not None:
                    entry["recovered"] = True
                since, entry = None, None
    return out


def starvation(
    steps: Sequence[int], norms: Sequence[Sequence[float | None]], share: float, max_steps: int, fraction: float = 0.5
) -> list[StarvedWindow]:
    """The level side of `000` §8.1 / Eq. 13: expert e is starved when, in some window of
    ``max_steps`` consecutive training steps, at least ``fraction`` of the logged samples give it
    a share of the layer's gradient signal g_e / mean_e g below ``share``. Counting the fraction
    (not one unbroken stretch) catches starvation that comes and goes (docs/decisions.md, "Starvation is a fraction
    of a window").

    Only windows the series covers whole are judged (see :func:`starvation_evaluable`); a
    sample with a null norm or an all-zero layer is not counted either way. One entry per
    expert: the first window that meets the rule, with its worst share and starved fraction.
    """
    out: list[StarvedWindow] = []
    if not steps:
        return out
    start = steps[0]
    shares: list[list[float | None]] = []
    for g_E in norms:
        total = layer_total(g_E) if all(g is not None for g in g_E) else 0.0  # type: ignore[arg-type]
        known = total > 0
        shares.append([g * len(g_E) / total if known else None for g in g_E])  # type: ignore[operator]
    for e in range(len(norms[0]) if norms else 0):
        lo = 0
        for j, t in enumerate(steps):
            while steps[lo] <= t - max_steps:
                lo += 1
            if t - start + 1 < max_steps:
                continue  # the window (t − max_steps, t] reaches before the series
            seen: list[float] = [x for i in range(lo, j + 1) if (x := shares[i][e]) is not None]
            low = [x for x in seen if x < share]
            if seen and len(low) >= fraction * len(seen):
                out.append(
                    {
                        "expert": e,
                        "since": steps[lo],
                        "step": t,
                        "until": t,
                        "steps": max_steps,
                        "share": min(low),
                        "fraction": len(low) / len(seen),
                        "samples": len(seen),
                    }
                )
                break
    return out


def starvation_evaluable(steps: Sequence[int], max_steps: int) -> bool:
    """Can :func:`starvation` fire on this series at all: does it cover one whole window?"""
    return bool(steps) and steps[-1] - steps[0] + 1 >= max_steps


def unevaluable_rules(series: EnvelopeSeries, settings: EnvelopeSettings) -> list[Unevaluable]:
    """Gated rules that could not fire on this series (too few samples or too short a span):
    such a rule is not evaluated — never "compliant" (docs/decisions.md, "Illustrative envelope
    constants are reported, not gated")."""
    out: list[Unevaluable] = []
    span = series.steps[-1] - series.steps[0] + 1 if series.steps else 0
    if series.norms is None:
        out.append({"check": "starvation", "reason": "no per-expert gradient norms in the series"})
    elif not starvation_evaluable(series.steps, settings.starve_steps):
        out.append(
            {
                "check": "starvation",
                "reason": f"the series spans {span} step(s) (steps {series.steps[0]}–"
                f"{series.steps[-1]}); the level rule judges windows of "
                f"envelope.starve_steps = {settings.starve_steps} steps",
            }
        )
    return out
