"""The refinement and handoff margins (:mod:`moeaudit.margins`; :mod:`moeaudit.records`)."""

import sys

from moeaudit.records.common import Interval

if sys.version_info >= (3, 11):
    from typing import TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import TypedDict


# --- margins -----------------------------------------------------------------------------------------


class MarginLayer(TypedDict, total=False):
    layer: int
    exact: float | None
    smooth: float | None
    ci95: Interval | None
    load_exact: float | None
    load_smooth: float | None
    load_ci95: Interval | None


class AlsoAgainst(TypedDict):
    against_step: int
    exact: float | None


class Margin(TypedDict, total=False):
    """A refinement (r_ex) or handoff (h_ex) margin; ``exact`` None when undefined (``reason``)."""

    exact: float | None
    smooth: float | None
    ci95: Interval | None
    ci_method: str
    smooth_note: str
    tau: float
    betas: dict[str, float]
    per_layer: list[MarginLayer]
    reason: str
    notes: list[str]
    reference: str
    against_step: int
    also_against: list[AlsoAgainst]
    stage: str  # refinement: the stage in force at its base step, which decides whether it is gated


class Margins(TypedDict):
    refinement: Margin | None
    handoff: Margin | None
