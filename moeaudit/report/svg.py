"""SVG primitives for the certificate's charts: escaped tags, scales, ticks, colors, axes.

Every text node and attribute goes through :func:`tag`, so a checkpoint, layer or domain name
can never inject markup, and its control characters are shown escaped (:func:`visible`).
Coordinates and labels use fixed formats (one decimal for coordinates), so the same input gives
the same bytes. Pure Python; no scripts, no URLs.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from markupsafe import Markup, escape

W = 960  # viewBox width of a full-width chart
FONT = 12
INK, MUTED, GRID = "#1f2328", "#57606a", "#d0d7de"
POS, NEG_LO, NEG_HI = "#2f7d6d", "#f4d9a6", "#c2410c"  # C2 ≥ 0; cream → orange as `003` Fig. 5
LOSS, C2_LINE, VALUE, BOUND, BAD = "#1f4e99", "#b45309", "#1f4e99", "#57606a", "#b42318"
STATUS_INK = {"BASELINE": "#57606a", "GREEN": "#1a7f37", "YELLOW": "#9a6700", "RED": "#b42318"}
BLUES = ("#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b")


# --- primitives ----------------------------------------------------------------------------------

# Bidirectional embeddings, overrides and isolates: they reorder the text around them on screen.
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def visible(text: str, keep: str = "") -> str:
    """``text`` with each control character (ESC, BEL, NUL, …; bidi overrides) written as its
    Python escape (``\\x1b``), as the terminal and CI outputs write them (errors.short_line):
    a name taken from the audited party's files reaches the page as text, never as a control.
    ``keep``: control characters left as they are (line breaks of page prose)."""
    if text.isprintable():
        return text
    return "".join(
        repr(ch)[1:-1] if (unicodedata.category(ch) == "Cc" or ch in _BIDI) and ch not in keep else ch for ch in text
    )


def f1(x: float) -> str:
    """A coordinate: one decimal, no negative zero."""
    s = f"{x:.1f}"
    return "0.0" if s == "-0.0" else s


def page_text(value: Any) -> Any:
    """Jinja ``finalize`` for the HTML pages: every string a page prints has its control
    characters escaped (:func:`visible`, line breaks kept) before it is HTML-escaped; charts
    (Markup) are built from escaped parts already."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return visible(value, keep="\n\t")
    return value


def tag(name: str, attrs: Mapping[str, Any] | None = None, *children: str) -> Markup:
    """``<name a="v">children</name>``; attribute values and str children are escaped."""
    parts = [name]
    for key, value in (attrs or {}).items():
        if value is None:
            continue
        text = f1(value) if isinstance(value, float) else visible(str(value))
        parts.append(f'{key}="{escape(text)}"')
    inner = "".join(str(c) if isinstance(c, Markup) else str(escape(visible(c))) for c in children)
    head = " ".join(parts)
    return Markup(f"<{head}>{inner}</{name}>" if inner else f"<{head}/>")


def text(
    x: float, y: float, s: str, *, anchor: str = "start", size: int = FONT, fill: str = INK, weight: str | None = None
) -> Markup:
    return tag(
        "text", {"x": x, "y": y, "text-anchor": anchor, "font-size": size, "fill": fill, "font-weight": weight}, s
    )


def line(
    x1: float, y1: float, x2: float, y2: float, stroke: str = GRID, width: float = 1.0, dash: str | None = None
) -> Markup:
    return tag(
        "line",
        {"x1": x1, "y1": y1, "x2": x2, "y2": y2, "stroke": stroke, "stroke-width": width, "stroke-dasharray": dash},
    )


def polyline(points: Sequence[tuple[float, float]], stroke: str, width: float = 2.0, dash: str | None = None) -> Markup:
    pts = " ".join(f"{f1(x)},{f1(y)}" for x, y in points)
    return tag(
        "polyline",
        {
            "points": pts,
            "fill": "none",
            "stroke": stroke,
            "stroke-width": width,
            "stroke-dasharray": dash,
            "stroke-linejoin": "round",
        },
    )


def svg(height: float, label: str, body: Iterable[str], width: float = W) -> Markup:
    """A responsive SVG with an accessible name (``role="img"`` + ``<title>``); inline in HTML it
    needs no ``xmlns``, so the page holds no URL at all."""
    attrs = {
        "viewBox": f"0 0 {f1(width)} {f1(height)}",
        "role": "img",
        "aria-label": label,
        "class": "chart",
        "font-family": "system-ui, 'Segoe UI', 'DejaVu Sans', Arial, sans-serif",
    }
    return tag("svg", attrs, tag("title", None, label), *body)


# --- scales and ticks ----------------------------------------------------------------------------


def nice_step(span: float, n: int = 5) -> float:
    raw = span / max(n, 1)
    mag: float = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if span / (m * mag) <= n)


def linear_ticks(lo: float, hi: float, n: int = 5) -> tuple[float, float, list[float], int]:
    """A padded nice domain ``(lo, hi)``, its ticks, and the decimals that label them."""
    if hi - lo < 1e-12:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_step(hi - lo, n)
    lo, hi = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    count = round((hi - lo) / step)
    quarter = 1 if f"{step:.3g}".endswith("25") else 0  # 0.25 needs one more decimal than 0.2
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + quarter)
    return lo, hi, [lo + i * step for i in range(count + 1)], decimals


def step_axis(lo: float, hi: float, n: int = 6) -> tuple[float, float, list[float]]:
    """Training steps: the data range padded by 3 % each side, nice ticks inside the data range."""
    if hi - lo < 1e-12:
        return lo - 1, hi + 1, [lo]
    step = nice_step(hi - lo, n)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
    pad = 0.03 * (hi - lo)
    return lo - pad, hi + pad, ticks


def log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    b = b if b > a else a + 1
    return 10.0**a, 10.0**b, [10.0**e for e in range(a, b + 1)]


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def decade(x: float) -> str:
    return "10" + str(round(math.log10(x))).translate(SUPERSCRIPT)


def scale(lo: float, hi: float, r0: float, r1: float, log: bool = False) -> Callable[[float], float]:
    if log:
        a, b = math.log10(lo), math.log10(hi)
        return lambda v: r0 + (math.log10(v) - a) / (b - a) * (r1 - r0)
    return lambda v: r0 + (v - lo) / (hi - lo) * (r1 - r0)


def sci(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}e}".replace("-", "−")


FIXED_RANGE = (1e-3, 1e4)  # |x| in here reads best as a plain decimal: 2.30, not 2.3e+00


def sig(x: float | None, digits: int = 3) -> str:
    """``digits`` significant digits: a plain decimal for 0.001 ≤ |x| < 10 000 (values near 1,
    such as a normalized variance, read as 2.30 and never as ``2.3e+00``), scientific outside
    that range (1.2e−05); a true minus sign; 0 is ``0``."""
    if x is None:
        return "—"
    if x == 0:
        return "0"
    if not FIXED_RANGE[0] <= abs(x) < FIXED_RANGE[1]:
        return sci(x, digits - 1)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}".replace("-", "−")


def signed(x: float | None, decimals: int = 3) -> str:
    """``+0.083`` / ``−0.027`` (a true minus sign); a value that rounds to zero is ``+0.000``."""
    if x is None:
        return "—"
    if float(f"{x:.{decimals}f}") == 0:
        x = 0.0
    return f"{x:+.{decimals}f}".replace("-", "−")


def num(value: float | None, spec: str = ".3f") -> str:
    """A number in a fixed format; ``None`` → "—"; minus signs are true minus signs."""
    if value is None:
        return "—"
    return format(value, spec).replace("-", "−")


# --- color scale ---------------------------------------------------------------------------------


def blues(t: float) -> str:
    """Sequential scale on t ∈ [0, 1] (ColorBrewer Blues, linear between the 9 stops)."""
    t = min(1.0, max(0.0, t)) * (len(BLUES) - 1)
    i = min(int(t), len(BLUES) - 2)
    return mix(BLUES[i], BLUES[i + 1], t - i)


def mix(a: str, b: str, t: float) -> str:
    """The color a fraction t of the way from ``#rrggbb`` a to b."""
    c = [round(int(a[k : k + 2], 16) * (1 - t) + int(b[k : k + 2], 16) * t) for k in (1, 3, 5)]
    return "#" + "".join(f"{v:02x}" for v in c)


def ink_on(t: float) -> str:
    return "#ffffff" if t > 0.55 else INK


# --- axes ----------------------------------------------------------------------------------------


def y_axis(
    ticks: Sequence[float], y: Callable[[float], float], x0: float, x1: float, label: Callable[[float], str]
) -> list[Markup]:
    out = []
    for t in ticks:
        out.append(line(x0, y(t), x1, y(t)))
        out.append(text(x0 - 6, y(t) + 4, label(t), anchor="end", size=11, fill=MUTED))
    return out


def x_axis(
    ticks: Sequence[float], x: Callable[[float], float], y0: float, y1: float, label: Callable[[float], str]
) -> list[Markup]:
    out = []
    for t in ticks:
        out.append(line(x(t), y0, x(t), y1, stroke="#eef1f4"))
        out.append(text(x(t), y1 + 16, label(t), anchor="middle", size=11, fill=MUTED))
    return out


def legend(x: float, y: float, items: Sequence[tuple[str, Markup]]) -> list[Markup]:
    """Swatches left to right; each item is a label and a swatch drawn at the origin."""
    out = []
    for label, swatch in items:
        out.append(tag("g", {"transform": f"translate({f1(x)},{f1(y)})"}, swatch))
        out.append(text(x + 26, y + 4, label, size=11))
        x += 40 + 6.6 * len(label)
    return out
