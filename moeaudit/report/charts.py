"""The certificate's charts (docs/security.md, "What the signature binds") as inline SVG, from plain numbers of a
verified statement.

* :func:`c2_bars` — per-layer C2 at a gate, signed bars around zero coloured by the drop from
  the baseline (not by C2's sign), baseline ticks, protected layers marked (`003` Fig. 5);
* :func:`loss_c2` — canary NLL and mean C2 over the gates, two panels on one step axis (Fig. 4);
* :func:`envelope_chart` — V(t) against its Grönwall bound B(t) (`000` Eq. 12) and the budget
  ε/δ, log-scaled when the values span decades, samples outside the bound marked ×;
* :func:`heatmap` / :func:`heat_legend` — π (layer × expert, domain × expert).

Status is never carried by color alone: the bars print their values, gates their status names,
non-compliant samples a distinct shape, dead experts a ×.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from markupsafe import Markup

from moeaudit.records import EnvelopeSample, EnvelopeWindow, LayerSummary
from moeaudit.report.svg import (
    BAD,
    BOUND,
    C2_LINE,
    FIXED_RANGE,
    GRID,
    INK,
    LOSS,
    MUTED,
    NEG_HI,
    NEG_LO,
    POS,
    STATUS_INK,
    VALUE,
    W,
    blues,
    decade,
    f1,
    ink_on,
    legend,
    line,
    linear_ticks,
    log_ticks,
    mix,
    polyline,
    scale,
    sci,
    sig,
    signed,
    step_axis,
    svg,
    tag,
    text,
    x_axis,
    y_axis,
)

Scale = Callable[[float], float]
Label = Callable[[float], str]
Sample = EnvelopeSample
LOG_SPAN = 30.0  # max/min above this → log y (the envelope decays over decades, `000` §6)


def _fixed(decimals: int) -> Label:
    return lambda v: signed(v, decimals) if decimals else f"{v:.0f}"


def _plain(decimals: int) -> Label:
    return lambda v: f"{v:.{decimals}f}"


def _steps(v: float) -> str:
    return f"{v:.0f}"


# --- per-layer C2 (`003` Fig. 5) -----------------------------------------------------------------


def c2_bars(
    per_layer: Sequence[LayerSummary],
    baseline: Mapping[int, float | None],
    protected: Sequence[int],
    label: str,
    tolerance: Mapping[int, float] | None = None,
) -> Markup:
    """Signed horizontal bars of C2 per layer. The colour is the drop from the baseline, not
    C2's sign (docs/decisions.md, "The certificate page is written for the operator who reads it"): green where C2 held
    or rose, cream → orange as the drop nears the layer's allowed drop (``tolerance``), darkest and outlined beyond it;
    grey without a baseline."""
    values = [e.get("c2") for e in per_layer] + list(baseline.values())
    m = max([abs(v) for v in values if v is not None] or [0.1])
    lo, hi, ticks, dec = linear_ticks(-m, m, 6)
    row, top, x0, x1 = 28, 34, 170, W - 90
    x = scale(lo, hi, x0, x1)
    height = top + row * len(per_layer) + 36
    body: list[Markup] = [
        tag("rect", {"x": 4, "y": top + i * row, "width": W - 8, "height": row, "fill": "#eef3f9"})
        for i, e in enumerate(per_layer)
        if e["layer"] in protected
    ]
    body += x_axis(ticks, x, top - 4, height - 30, _fixed(dec))
    body.append(line(x0, height - 30, x1, height - 30, stroke=MUTED))
    for i, e in enumerate(per_layer):
        body += _c2_row(
            e,
            baseline.get(e["layer"]),
            (tolerance or {}).get(e["layer"]),
            e["layer"] in protected,
            top + i * row,
            row,
            x,
            x1,
        )
    body.append(line(x(0), top - 4, x(0), height - 30, stroke=INK, width=1.2))
    swatch = {"x": 0, "y": -6, "width": 20, "height": 12}
    items = [
        ("held or rose", tag("rect", {**swatch, "fill": POS})),
        ("dropped (darker = closer to fallen)", tag("rect", {**swatch, "fill": mix(NEG_LO, NEG_HI, 0.5)})),
        ("fallen", tag("rect", {**swatch, "fill": NEG_HI, "stroke": FALLEN, "stroke-width": 1.5})),
    ]
    if baseline:
        items.append(("baseline value", line(10, -8, 10, 8, stroke=INK, width=2.5)))
    else:
        items = [("no baseline to compare with", tag("rect", {**swatch, "fill": NO_BASE}))]
    body += legend(x0, 14, items)
    return svg(height, label, body)


FALLEN, NO_BASE = "#7c2d12", "#afb8c1"


def drop_fill(c2: float, base: float | None, tol: float | None, gated: bool = True) -> tuple[str, bool]:
    """(fill, fallen) of a C2 bar from its drop against the baseline: green when it held or
    rose; cream → orange as the drop nears ``tol``; darkest beyond it — "fallen" only on a
    ``gated`` (protected) layer; grey without a baseline. Without a tolerance, a drop is
    measured against 0.1 of the baseline's |C2|."""
    if base is None:
        return NO_BASE, False
    drop = base - c2
    if drop <= 0:
        return POS, False
    allowed = tol if tol is not None and tol > 0 else max(0.1 * abs(base), 1e-9)
    return mix(NEG_LO, NEG_HI, min(1.0, drop / allowed)), gated and drop > allowed


def _c2_row(
    e: LayerSummary,
    base: float | None,
    tol: float | None,
    is_protected: bool,
    y: float,
    row: float,
    x: Scale,
    x1: float,
) -> list[Markup]:
    mid = y + row / 2 + 4
    name = f"layer {e['layer']}" + (" · protected" if is_protected else "")
    out = [text(160, mid, name, anchor="end", weight="bold" if is_protected else None)]
    c2 = e.get("c2")
    if c2 is None:
        return out + [text(x(0) + 6, mid, "— no co-active pairs (top-1 routing)", fill=MUTED)]
    fill, fallen = drop_fill(c2, base, tol, gated=is_protected)
    a, b = sorted((x(0), x(c2)))
    out.append(
        tag(
            "rect",
            {
                "x": a,
                "y": y + 6,
                "width": max(b - a, 1.0),
                "height": row - 12,
                "fill": fill,
                "stroke": FALLEN if fallen else None,
                "stroke-width": 1.5 if fallen else None,
            },
        )
    )
    if base is not None:
        out.append(line(x(base), y + 3, x(base), y + row - 3, stroke=INK, width=2.5))
    ends = [b, x(base)] if base is not None else [b]  # the label clears the baseline tick
    lx = max(ends) + 6 if c2 >= 0 else min([a, *ends[1:]]) - 6
    delta = "" if base is None else f" (Δ {signed(c2 - base)}{', fallen' if fallen else ''})"
    out.append(
        text(min(lx, x1 + 60), mid, signed(c2) + delta, anchor="start" if c2 >= 0 else "end", size=11, weight="bold")
    )
    return out


# --- loss and C2 over the gates (`003` Fig. 4) ---------------------------------------------------


def loss_c2(points: Sequence[Mapping[str, Any]], label: str) -> Markup:
    """Two panels on one step axis: NLL on top, mean C2 below (zero line bold); statuses under."""
    steps = [p["step"] for p in points]
    lo, hi, xt = step_axis(min(steps), max(steps), 8)
    x = scale(lo, hi, 80, W - 30)
    body: list[Markup] = x_axis(xt, x, 40, 380, _steps)
    body.append(line(80, 380, W - 30, 380, stroke=MUTED))
    panels = (
        ("Canary NLL (loss) — lower is better", "nll", LOSS, 40),
        ("Mean C2 over routed layers — judged by its change against the baseline", "c2", C2_LINE, 240),
    )
    for title, key, color, top in panels:
        body += _panel(points, key, color, title, x, top, 140)
    body.append(text(W / 2, 414, "training step", anchor="middle", size=11, fill=MUTED))
    for p in points:
        status = p["status"]
        body.append(
            text(x(p["step"]), 432, status, anchor="middle", size=10, weight="bold", fill=STATUS_INK.get(status, INK))
        )
    return svg(440, label, body)


def _panel(
    points: Sequence[Mapping[str, Any]], key: str, color: str, title: str, x: Scale, top: float, height: float
) -> list[Markup]:
    """One panel under its title; 15 % headroom keeps the top point's label inside it."""
    known = [(p["step"], p[key]) for p in points if p.get(key) is not None]
    body = [text(80, top - 14, title, weight="bold")]
    if not known:
        return body + [text(W / 2, top + height / 2, "— not measured at any gate", anchor="middle", fill=MUTED)]
    vals = [v for _, v in known] + ([0.0] if key == "c2" else [])
    lo, hi, yt, ydec = linear_ticks(min(vals), max(vals), 4)
    y = scale(lo, hi + 0.15 * (hi - lo), top + height, top)
    body[:0] = y_axis(yt, y, 80, W - 30, _plain(ydec) if key == "nll" else _fixed(ydec))
    if key == "c2" and lo < 0 < hi:
        body.append(line(80, y(0), W - 30, y(0), stroke=INK, width=1.2))
    body.append(polyline([(x(s), y(v)) for s, v in known], color, 2.5))
    for s, v in known:
        body.append(
            tag("circle", {"cx": x(s), "cy": y(v), "r": 4.5, "fill": color, "stroke": "#ffffff", "stroke-width": 1.5})
        )
        fmt = f"{v:.3f}" if key == "nll" else signed(v, 3)
        body.append(text(x(s), y(v) - 10, fmt, anchor="middle", size=11, fill=INK))
    return body


# --- envelope series against the Grönwall bound (`000` Eq. 12) -----------------------------------


def envelope_chart(
    samples: Sequence[Sample],
    windows: Sequence[EnvelopeWindow],
    budget: float | None,
    label: str,
    *,
    width: float = W,
    height: float = 300,
    show_legend: bool = True,
    gated: bool = True,
) -> Markup:
    """V(t) (solid), the bound of each compliance window (dashed, re-anchored per window) and
    the budget ε/δ (dotted); a sample outside its bound is a red ×, or a grey one where the
    bound is only reported (illustrative constants, not gated)."""
    curves = _bound_curves(samples, windows, budget)
    pts = [(r["step"], v) for r in samples if (v := r.get("value")) is not None]
    ys = [v for _, v in pts] + [v for c in curves for _, v in c] + ([budget] if budget else [])
    steps = [r["step"] for r in samples]
    top, bottom, left, right = (44 if show_legend else 16), height - 28, 76, width - 16
    if not pts or not steps:
        return svg(
            height,
            label,
            [text(width / 2, height / 2, "— no finite value in this series", anchor="middle", fill=MUTED)],
            width,
        )
    lo, hi, xt = step_axis(min(steps), max(steps), 6 if width >= W else 4)
    x = scale(lo, hi, left, right)
    y, body = _value_axis(ys, top, bottom, left, right)
    body += x_axis(xt, x, top, bottom, _steps)
    body.append(line(left, bottom, right, bottom, stroke=MUTED))
    if budget:
        body.append(line(left, y(budget), right, y(budget), stroke=MUTED, width=1.2, dash="2 3"))
    body += [polyline([(x(s), y(v)) for s, v in c], BOUND, 1.6, "6 4") for c in curves]
    body += [polyline([(x(s), y(v)) for s, v in seg], VALUE, 2.0) for seg in _segments(samples)]
    body += _sample_marks(samples, x, y, many=len(samples) > 80, colour=BAD if gated else MUTED)
    body += [_no_value(x(r["step"]), bottom) for r in samples if r.get("value") is None]
    if show_legend:
        body += legend(left, 18, _envelope_legend(budget, len(pts) < len(samples), gated))
    return svg(height, label, body, width)


def _value_axis(
    ys: Sequence[float], top: float, bottom: float, left: float, right: float
) -> tuple[Scale, list[Markup]]:
    positive = [v for v in ys if v > 0]
    if positive and len(positive) == len(ys) and max(ys) / min(ys) > LOG_SPAN:
        lo, hi, ticks = log_ticks(min(ys), max(ys))
        y = scale(lo, hi, bottom, top, log=True)
        return y, y_axis(ticks, y, left, right, decade)
    lo, hi, ticks, dec = linear_ticks(min(0.0, min(ys)), max(ys), 4)
    y = scale(lo, hi, bottom, top)
    fixed = FIXED_RANGE[0] <= max(abs(t) for t in ticks) < FIXED_RANGE[1]  # 2.5, not 2.5e+00

    def label(v: float) -> str:
        return "0" if not v else f"{v:.{dec}f}" if fixed else sci(v, 1)

    return y, y_axis(ticks, y, left, right, label)


def _bound_curves(
    samples: Sequence[Sample], windows: Sequence[EnvelopeWindow], budget: float | None
) -> list[list[tuple[float, float]]]:
    """One polyline per compliance window, from its anchor a: B(a) = V(a) + ε/δ (Eq. 12)."""
    anchors = {w["index"]: (w["start"], v) for w in windows if (v := w.get("anchor_value")) is not None}
    curves: dict[int | None, list[tuple[float, float]]] = {}
    for r in samples:
        bound = r.get("bound")
        if bound is None:
            continue
        w = r.get("window")
        if w not in curves:
            curves[w] = []
            a = None if w is None else anchors.get(w)
            if a is not None and budget is not None and a[0] != r["step"]:
                curves[w].append((a[0], a[1] + budget))
        curves[w].append((r["step"], bound))
    return list(curves.values())


def _segments(samples: Sequence[Sample]) -> list[list[tuple[float, float]]]:
    out: list[list[tuple[float, float]]] = [[]]
    for r in samples:
        v = r.get("value")
        if v is None:
            out.append([])
        else:
            out[-1].append((r["step"], v))
    return [s for s in out if s]


def _sample_marks(samples: Sequence[Sample], x: Scale, y: Scale, many: bool, colour: str = BAD) -> list[Markup]:
    out = []
    for r in samples:
        v = r.get("value")
        if v is None:
            continue
        cx, cy = x(r["step"]), y(v)
        if not r.get("compliant", True):
            out.append(_cross(cx, cy, 6, colour))
        elif not many:
            out.append(tag("circle", {"cx": cx, "cy": cy, "r": 3, "fill": VALUE}))
    return out


def _cross(cx: float, cy: float, r: float, colour: str = BAD) -> Markup:
    a, b, c, d = f1(cx - r), f1(cx + r), f1(cy - r), f1(cy + r)
    return tag("path", {"d": f"M{a},{c}L{b},{d}M{a},{d}L{b},{c}", "stroke": colour, "stroke-width": 3, "fill": "none"})


def _no_value(cx: float, bottom: float) -> Markup:
    """A sample without a finite value: a hollow marker on the axis (its reason is in the text)."""
    return tag("circle", {"cx": cx, "cy": bottom - 6, "r": 4, "fill": "#ffffff", "stroke": BAD, "stroke-width": 1.5})


def _envelope_legend(budget: float | None, gaps: bool, gated: bool = True) -> list[tuple[str, Markup]]:
    items = [
        ("V(t), gradient variance", line(0, 0, 20, 0, stroke=VALUE, width=2.0)),
        ("Grönwall bound B(t)", line(0, 0, 20, 0, stroke=BOUND, width=1.6, dash="6 4")),
    ]
    if budget:
        dotted = line(0, 0, 20, 0, stroke=MUTED, width=1.2, dash="2 3")
        items.append((f"budget ε/δ = {sig(budget, 2)}", dotted))
    if gated:
        items.append(("outside its bound", _cross(10, 0, 5)))
    else:
        items.append(("above the bound (reported, not gated)", _cross(10, 0, 5, MUTED)))
    if gaps:
        items.append(("no value", _no_value(10, 6)))
    return items


# --- π heatmaps ----------------------------------------------------------------------------------


def heatmap(
    rows: Sequence[tuple[str, Sequence[float | None]]],
    vmax: float,
    label: str,
    *,
    width: float = W,
    left: float = 90,
    cell_h: float = 30,
    title: str | None = None,
) -> Markup:
    """Rows × experts, colored on [0, vmax]; a dead expert (π = 0) is a red ×, a missing one —."""
    n = max((len(r) for _, r in rows), default=0)
    cell = min((width - left - 10) / max(n, 1), 72.0)
    top = 40 if title else 24
    body: list[Markup] = [text(left, 14, title, weight="bold")] if title else []
    show = cell >= 30
    every = 1 if show else max(1, round(24 / cell))  # expert numbers that fit above the cells
    body += [
        text(left + (j + 0.5) * cell, top - 6, str(j), anchor="middle", size=10, fill=MUTED) for j in range(0, n, every)
    ]
    for i, (name, values) in enumerate(rows):
        y = top + i * cell_h
        body.append(text(left - 8, y + cell_h / 2 + 4, name, anchor="end", size=11))
        for j, v in enumerate(values):
            body += _cell(left + j * cell, y, cell, cell_h, v, vmax, show)
    height = top + cell_h * len(rows) + 8
    return svg(height, label, body, width)


def _cell(x: float, y: float, w: float, h: float, v: float | None, vmax: float, show: bool) -> list[Markup]:
    t = 0.0 if v is None else min(1.0, v / vmax) if vmax > 0 else 0.0  # above vmax: saturated
    fill = "#ffffff" if v is None or v == 0 else blues(t)
    out = [tag("rect", {"x": x, "y": y, "width": w, "height": h, "fill": fill, "stroke": "#ffffff", "stroke-width": 1})]
    if v is None or v == 0:
        mark = "—" if v is None else "×"
        out.append(
            text(
                x + w / 2,
                y + h / 2 + 5,
                mark,
                anchor="middle",
                size=14 if show else 9,
                fill=BAD if v == 0 else MUTED,
                weight="bold",
            )
        )
    elif show:
        out.append(text(x + w / 2, y + h / 2 + 4, f"{v:.2f}", anchor="middle", size=10, fill=ink_on(t)))
    return out


def heat_legend(
    vmax: float,
    mean: float | None,
    label: str,
    width: float = W,
    *,
    caption: str = "π: share of canary tokens routed to the expert",
    mean_label: str = "mean π",
    zero_label: str = "dead expert (π = 0)",
) -> Markup:
    """The color scale with its ticks, the mean π (uniform load) marked, and what × means
    (``zero_label``: a dead expert on the occupancy map; no tokens of that domain on a domain map)."""
    x0, x1, steps = 90, 90 + 360, 36
    x, dx = scale(0, vmax, x0, x1), (x1 - x0) / steps
    body = [text(x0, 12, caption, size=11, fill=MUTED)]
    body += [
        tag("rect", {"x": x0 + k * dx, "y": 18, "width": dx + 0.5, "height": 14, "fill": blues((k + 0.5) / steps)})
        for k in range(steps)
    ]
    _, _, ticks, dec = linear_ticks(0, vmax, 6)
    for t in [t for t in ticks if t <= vmax * (1 + 1e-9)]:
        body += [
            line(x(t), 32, x(t), 37, stroke=MUTED),
            text(x(t), 49, f"{t:.{dec}f}", anchor="middle", size=10, fill=MUTED),
        ]
    if mean is not None and 0 < mean <= vmax:
        body += [
            line(x(mean), 15, x(mean), 35, stroke=INK, width=2),
            text(x(mean), 62, f"{mean_label} = {mean:.3f}", anchor="middle", size=10),
        ]
    body += [
        tag("rect", {"x": x1 + 40, "y": 18, "width": 22, "height": 14, "fill": "#ffffff", "stroke": GRID}),
        text(x1 + 51, 30, "×", anchor="middle", size=13, fill=BAD, weight="bold"),
        text(x1 + 70, 30, zero_label, size=11),
    ]
    return svg(68, label, body, width)
