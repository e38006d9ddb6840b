"""The envelope's rules evaluated online, one logged step at a time (docs/decisions.md, "Live monitoring").

:class:`OnlineEnvelope` takes each logged step's per-expert gradient norms as the hook writes
them and says, at that step, what ``moeaudit envelope`` will later report on the written
``metrics.jsonl`` (:func:`moeaudit.judge.envelope.evaluate`, no breaks):

* ``alert`` — `000` Eq. 21 on a series (a layer or pooled): ``max_e g_e < a ∧ V > b`` for
  ``alert_n`` consecutive samples, at the n-th;
* ``dead_expert`` — §10.3: ``g_e < dead_grad`` for more than ``dead_steps`` steps;
* ``starvation`` — the level side of §8.1: in a window of ``starve_steps`` steps, at least
  ``starve_fraction`` of the samples give expert e a share ``g_e / mean g`` under
  ``starve_share`` (first window per expert);
* ``variance_bound`` — a sample over its Grönwall bound (Eq. 12) or a pair over the Δ-step
  composed Eq. 11, on block means of ``sampling_interval`` steps when the constants are
  calibrated. Under uncalibrated constants the variance bound is not gated (as in ``certify``):
  its margins are tracked, no event is raised.

Each rule keeps O(E) state (starvation: the samples of one window), so a step costs the same
at step 10 as at step 10⁶. The same formulas as the batch code are called where they exist
(``variance``, ``composed_bound``, ``gronwall``); ``tests/test_online_envelope.py`` checks the
events against the report on the written log. Not seen online: resume / regime-change breaks
from ``events.jsonl`` (the batch report re-anchors at them), and a first block of the
resampled series shorter than half a block (left out by the batch code; here its mean is
judged), nor the last block of a run until a sample of the next block arrives.

Torch-free, like the rest of the envelope.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moeaudit.judge.envelope import RTOL, composed_bound, gronwall
from moeaudit.metrics import POOLED, variance
from moeaudit.policy import EnvelopeSettings

Norms = Sequence[float | None]


@dataclass(frozen=True)
class EnvelopeEvent:
    """One rule that fired, at the logged step where it fired."""

    kind: str  # "alert" | "dead_expert" | "starvation" | "variance_bound"
    series: str  # a layer ("3") or "pooled"
    step: int
    expert: int | None = None
    check: str | None = None  # variance_bound: "gronwall" | "discrete"
    value: float | None = None
    bound: float | None = None

    def message(self) -> str:
        where = f"layer {self.series}" if self.series != POOLED else "pooled"
        if self.kind == "variance_bound":
            return (
                f"moeaudit: step {self.step}: {where} left the envelope ({self.check} bound "
                f"{_fmt(self.bound)}, V {_fmt(self.value)})"
            )
        what = {"alert": "starvation alert (000 Eq. 21)", "dead_expert": "expert dead", "starvation": "expert starved"}[
            self.kind
        ]
        expert = f", expert {self.expert}" if self.expert is not None else ""
        return f"moeaudit: step {self.step}: {what} in {where}{expert} (value {_fmt(self.value)})"


def _fmt(x: float | None) -> str:
    return "null" if x is None else f"{x:.4g}"


def _holds(value: float, bound: float) -> bool:
    return bound - value >= -RTOL * abs(bound)  # as moeaudit.judge.envelope


class OnlineEnvelope:
    """Feed :meth:`push` every logged step in order; it returns the events that fire there."""

    def __init__(self, settings: EnvelopeSettings, *, every: int = 1):
        self.settings = settings
        interval = settings.sampling_interval
        self._block = interval if settings.calibrated and interval > 1 and every < interval else 0
        self._full = interval / every if self._block else 0.0
        self._pending: list[tuple[int, dict[str, float | None]]] = []  # the open block
        self._blocks = 0
        self._variance: dict[str, _Variance] = {}
        self._alert: dict[str, int] = {}
        self._dead: dict[tuple[str, int], list[Any]] = {}  # (layer, e) → [since, fired]
        self._starve: dict[str, _Starvation] = {}
        self._start: int | None = None
        self.events: list[EnvelopeEvent] = []
        self.margins: dict[str, float | None] = {}  # latest Grönwall margin per series

    def push(self, step: int, norms: Mapping[str, Norms]) -> list[EnvelopeEvent]:
        s = self.settings
        if step < s.warmup_steps:
            return []
        if self._start is None:
            self._start = step
        layers = sorted(norms, key=lambda k: (0, int(k)) if k.isdigit() else (1, k))
        series = {POOLED: [g for k in layers for g in norms[k]], **{k: list(norms[k]) for k in layers}}
        values = {k: variance(g, s.variant)[0] for k, g in series.items()}
        new = [
            *self._alerts(step, series, values),
            *self._deads(step, norms, layers),
            *self._starvations(step, norms, layers),
            *self._variance_step(step, values),
        ]
        self.events.extend(new)
        return new

    # --- the level rules, on every logged sample --------------------------------------------------

    def _alerts(
        self, step: int, series: Mapping[str, Norms], values: Mapping[str, float | None]
    ) -> list[EnvelopeEvent]:
        s, out = self.settings, []
        for key, g_E in series.items():
            v = values[key]
            known = v is not None and all(g is not None for g in g_E)
            if known and max(g_E) < s.alert_a and v > s.alert_b:  # type: ignore[operator, type-var]
                self._alert[key] = self._alert.get(key, 0) + 1
                if self._alert[key] == s.alert_n:
                    out.append(EnvelopeEvent("alert", key, step, value=v))
            else:
                self._alert[key] = 0
        return out

    def _deads(self, step: int, norms: Mapping[str, Norms], layers: list[str]) -> list[EnvelopeEvent]:
        s, out = self.settings, []
        for layer in layers:
            for e, g in enumerate(norms[layer]):
                state = self._dead.setdefault((layer, e), [None, False])
                if g is not None and g < s.dead_grad:
                    state[0] = step if state[0] is None else state[0]
                    if step - state[0] + 1 > s.dead_steps and not state[1]:
                        state[1] = True
                        out.append(EnvelopeEvent("dead_expert", layer, step, expert=e, value=g))
                else:
                    state[0], state[1] = None, False
        return out

    def _starvations(self, step: int, norms: Mapping[str, Norms], layers: list[str]) -> list[EnvelopeEvent]:
        out: list[EnvelopeEvent] = []
        for layer in layers:
            st = self._starve.setdefault(layer, _Starvation(len(norms[layer])))
            assert self._start is not None
            out.extend(
                EnvelopeEvent("starvation", layer, step, expert=e, value=share)
                for e, share in st.push(step, norms[layer], self.settings, self._start)
            )
        return out

    # --- the variance bound, on block means when calibrated ---------------------------------------

    def _variance_step(self, step: int, values: dict[str, float | None]) -> list[EnvelopeEvent]:
        if not self._block:
            return self._judge(step, values)
        out: list[EnvelopeEvent] = []
        if self._pending and -(-step // self._block) != -(-self._pending[-1][0] // self._block):
            out = self._close_block()  # this sample opens the next block: judge the last one
        self._pending.append((step, values))
        return out

    def _close_block(self) -> list[EnvelopeEvent]:
        block, self._pending = self._pending, []
        self._blocks += 1
        if self._blocks == 1 and 2 * len(block) < self._full:
            return []  # a partial first block (as moeaudit.judge.envelope.resample)
        keys = block[0][1].keys()
        means = {k: _mean([v[k] for _, v in block]) for k in keys}
        return self._judge(block[-1][0], means)

    def _judge(self, step: int, values: Mapping[str, float | None]) -> list[EnvelopeEvent]:
        s, out = self.settings, []
        for key, v in values.items():
            st = self._variance.setdefault(key, _Variance())
            for check, value, bound in st.push(step, v, s):
                if s.calibrated:
                    out.append(EnvelopeEvent("variance_bound", key, step, check=check, value=value, bound=bound))
            self.margins[key] = st.margin
        return out


@dataclass
class _Variance:
    """One series' Grönwall window (anchor, members so far) and last sample (discrete pair)."""

    anchor: tuple[int, float | None] | None = None
    last: tuple[int, float | None] | None = None
    members: int = 0
    margin: float | None = None

    def push(self, t: int, v: float | None, s: EnvelopeSettings) -> list[tuple[str, float | None, float | None]]:
        d, e = s.delta, s.epsilon
        if self.last is None:  # the first sample: Eq. 12 at t = t_0
            self.anchor = self.last = (t, v)
            self.margin = None if v is None else e / d
            return [] if v is not None else [("gronwall", v, None)]
        out: list[tuple[str, float | None, float | None]] = []
        t0, v0 = self.last
        if v0 is None or v is None:
            out.append(("discrete", v, None))
        elif not _holds(v, bound := composed_bound(v0, d, e, t - t0)):
            out.append(("discrete", v, bound))
        assert self.anchor is not None
        if self.members and t - self.anchor[0] > s.window:
            self.anchor, self.members = self.last, 0
        self.members += 1
        ta, va = self.anchor
        if va is None or v is None:
            out.insert(0, ("gronwall", v, None))
            self.margin = None
        else:
            bound = gronwall(va, ta, t, d, e)
            self.margin = bound - v
            if not _holds(v, bound):
                out.insert(0, ("gronwall", v, bound))
        self.last = (t, v)
        return out


@dataclass
class _Starvation:
    """The samples of the last ``starve_steps`` steps of one layer, as shares g_e·E/Σg."""

    E: int
    window: deque[tuple[int, list[float | None]]] = field(default_factory=deque)
    fired: set[int] = field(default_factory=set)

    def push(self, t: int, g_E: Norms, s: EnvelopeSettings, start: int) -> list[tuple[int, float]]:
        known = all(g is not None for g in g_E) and sum(g_E) > 0  # type: ignore[arg-type]
        total = sum(g_E) if known else 0.0  # type: ignore[arg-type]
        self.window.append(
            (
                t,
                [
                    g * len(g_E) / total if known else None  # type: ignore[operator]
                    for g in g_E
                ],
            )
        )
        while self.window[0][0] <= t - s.starve_steps:
            self.window.popleft()
        if t - start + 1 < s.starve_steps:
            return []
        out = []
        for e in range(self.E):
            if e in self.fired:
                continue
            seen = [x for _, shares in self.window if (x := shares[e]) is not None]
            low = [x for x in seen if x < s.starve_share]
            if seen and len(low) >= s.starve_fraction * len(seen):
                self.fired.add(e)
                out.append((e, min(low)))
        return out


def _mean(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return sum(known) / len(known) if known else None  # as moeaudit.judge.envelope.resample


def events_of_report(report: Mapping[str, Any], *, calibrated: bool = True) -> list[EnvelopeEvent]:
    """The events an ``moeaudit.envelope/v1`` report holds, as :class:`EnvelopeEvent` s (the
    variance bound only when ``calibrated``), in the order :class:`OnlineEnvelope` raises them."""
    out = [EnvelopeEvent("alert", a["series"], a["step"], value=a["value"]) for a in report["alerts"]]
    out += [EnvelopeEvent("dead_expert", d["layer"], d["step"], expert=d["expert"]) for d in report["dead_experts"]]
    out += [
        EnvelopeEvent("starvation", r["layer"], r["step"], expert=r["expert"], value=r["share"])
        for r in report["starvation"]
    ]
    if calibrated:
        out += [
            EnvelopeEvent("variance_bound", key, r["step"], check="gronwall", value=r["value"], bound=r["bound"])
            for key, rows in report["series"].items()
            for r in rows
            if not r["compliant"]
        ]
        out += [
            EnvelopeEvent(
                "variance_bound", r["series"], r["to_step"], check="discrete", value=r["value"], bound=r["bound"]
            )
            for r in report["discrete"]
            if not r["compliant"]
        ]
    return sorted(out, key=lambda e: e.step)
