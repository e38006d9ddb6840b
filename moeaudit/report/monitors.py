"""Roll-ups of the live monitors' per-layer metrics (docs/monitors.md): per metric, the p50 /
p90 / p95 over routed layers and the worst layer, and the scalars the dashboards themselves
show (Megatron-Core's ``global/…`` and ``worst-layer/…`` labels, NeMo's ``moe/…`` keys), from
the ``monitors`` receipts of :mod:`moeaudit.receipts.monitors`. Plain data in, plain data out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from moeaudit.records import MonitorLayer, MonitorsSection, Predicate, Receipts, ReceiptsLayer

# a receipts layer (its values under ``monitors``) or a monitor layer of the certificate
Layer = ReceiptsLayer | MonitorLayer

# (metric, whether the worst layer is the lowest value), in the dashboards' order.
MEGATRON: tuple[tuple[str, bool], ...] = (
    ("seq-loss", False),
    ("seq-assignment-imbalance", False),
    ("seq-score-imbalance", False),
    ("global-batch-loss", False),
    ("seq-global-loss-gap", False),
    ("global-aux-max-over-mean", False),
    ("global-actual-imbalance", False),
    ("global-actual-max-over-mean", False),
    ("topk-boundary-relative-margin", True),  # larger margins are healthier
    ("topk-overlap-mean", True),  # layer-router-routing-balance
)
# Megatron's "global/<op>" of a pooled ("global") operation is the mean of its layers' values;
# of a per-sequence ("mean") operation the mean over every layer's sequences — the same with
# equal windows per layer. Its health bundle has no topk-overlap (routing-balance does).
HEALTH = tuple(name for name, _ in MEGATRON if name != "topk-overlap-mean")
NEMO: tuple[tuple[str, bool], ...] = (
    ("cv", False),
    ("dead_expert_frac", False),
    ("expert_diversity", True),
    ("utilization_min", True),
    ("utilization_max", False),
)
QUANTILES = (0.5, 0.9, 0.95)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (``torch.quantile``'s default, what
    Megatron's ``percentiles`` use): position q·(n − 1) of the sorted values."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _series(layers: Sequence[Layer], source: str, name: str) -> list[tuple[int, float]]:
    out = []
    for entry in layers:
        either: Mapping[str, Any] = entry  # its monitors' values, wherever the layer holds them
        value = ((either.get("monitors") or either).get(source) or {}).get(name)
        if isinstance(value, int | float) and math.isfinite(value):
            out.append((int(entry["layer"]), float(value)))
    return out


def _metrics(layer: MonitorLayer, source: str) -> dict[str, float | None]:
    """One monitor's values of a layer (``megatron`` or ``nemo``; empty when it has none)."""
    return (layer.get("megatron") if source == "megatron" else layer.get("nemo")) or {}


def rollup(series: Sequence[tuple[int, float]], lowest_is_worst: bool) -> dict[str, Any] | None:
    """p50 / p90 / p95 over layers, and the worst layer and its value (None: no layer has it).
    pXX is the value XX % of the layers are no worse than: the (1 − XX %) quantile where the
    lowest value is the worst (a boundary margin), so p50 → p90 → p95 → worst always runs
    toward the worst layer."""
    if not series:
        return None
    values = [v for _, v in series]
    pick = min if lowest_is_worst else max
    layer, worst = pick(series, key=lambda lv: lv[1])
    return {
        **{f"p{round(q * 100)}": quantile(values, 1 - q if lowest_is_worst else q) for q in QUANTILES},
        "worst": worst,
        "worst_layer": layer,
        "worst_is": "lowest" if lowest_is_worst else "highest",
    }


def rollups(layers: Sequence[Layer]) -> list[dict[str, Any]]:
    """One row per metric present: ``source`` (megatron / nemo), ``metric`` and its roll-up.
    ``layers``: receipts layers (with ``monitors``) or the certificate's monitor layers."""
    rows = []
    for source, table in (("megatron", MEGATRON), ("nemo", NEMO)):
        for name, lowest in table:
            r = rollup(_series(layers, source, name), lowest)
            if r is not None:
                rows.append({"source": source, "metric": name, **r})
    return rows


# the tag Megatron's tensor-metrics observer writes each result under (TensorBoard and W&B)
HEALTH_TAG = "tensor-metrics/layer-router-health/"


def megatron_scalars(layers: Sequence[Layer]) -> dict[str, float]:
    """What ``--tensor-metrics layer-router-health`` logs, under its tags:
    ``…/global/<op>`` (mean over layers) and ``…/worst-layer/<op>`` (max over layers; min for
    the boundary margin)."""
    out: dict[str, float] = {}
    lowest = dict(MEGATRON)
    for name in HEALTH:
        values = [v for _, v in _series(layers, "megatron", name)]
        if values:
            out[f"{HEALTH_TAG}global/{name}"] = sum(values) / len(values)
            out[f"{HEALTH_TAG}worst-layer/{name}"] = min(values) if lowest[name] else max(values)
    return out


def nemo_scalars(layers: Sequence[Layer]) -> dict[str, float]:
    """NeMo AutoModel's brief keys that need only the per-layer values: ``moe/cv_{mean,median,
    min,max}``, ``moe/dead_expert_frac_mean``, ``moe/expert_diversity_{mean,min}``. Its layers
    are in the sorted order of the Gate modules' names; none of these depends on the order."""
    cv = [v for _, v in _series(layers, "nemo", "cv")]
    dead = [v for _, v in _series(layers, "nemo", "dead_expert_frac")]
    div = [v for _, v in _series(layers, "nemo", "expert_diversity")]
    if not cv:
        return {}
    return {
        "moe/cv_mean": sum(cv) / len(cv),
        "moe/cv_median": statistics.median(cv),
        "moe/cv_min": min(cv),
        "moe/cv_max": max(cv),
        "moe/dead_expert_frac_mean": sum(dead) / len(dead),
        "moe/expert_diversity_mean": sum(div) / len(div),
        "moe/expert_diversity_min": min(div),
    }


def nemo_utilization(loads: Sequence[Sequence[float]]) -> dict[str, float]:
    """NeMo's pooled ``moe/expert_utilization_{p25,median,p75,min,max}``: every layer's ratios
    ``load / (Σ load / E)`` in one list (any per-layer scale: counts or π), its p25 / p75 the
    sorted list's entries n//4 and 3n//4 (NeMo's own index rule, not an interpolation)."""
    ratios: list[float] = []
    for row in loads:
        total = sum(row)
        ratios += [x / (total / len(row)) if total > 0 else 0.0 for x in row]
    if not ratios:
        return {}
    s, n = sorted(ratios), len(ratios)
    return {
        "moe/expert_utilization_p25": s[n // 4] if n >= 4 else s[0],
        "moe/expert_utilization_median": statistics.median(ratios),
        "moe/expert_utilization_p75": s[3 * n // 4] if n >= 4 else s[-1],
        "moe/expert_utilization_min": s[0],
        "moe/expert_utilization_max": s[-1],
    }


def section(doc: Receipts) -> MonitorsSection | None:
    """The certificate's ``monitors``: one checkpoint's per-layer values (the receipts' own)."""
    layers: list[MonitorLayer] = [
        {"layer": e["layer"], "megatron": e["monitors"]["megatron"], "nemo": e["monitors"]["nemo"]}
        for e in doc["layers"]
        if "megatron" in (e.get("monitors") or {})
    ]
    return {"checkpoint": doc["checkpoint"]["name"], "layers": layers} if layers else None


def heatmap_loads(predicate: Predicate) -> list[list[float]] | None:
    """The certificate heatmap's π rows, when they are of the checkpoint its monitors are."""
    heatmaps, section = predicate.get("heatmaps"), predicate.get("monitors")
    occupancy = heatmaps.get("occupancy") if heatmaps else None
    pi = occupancy.get("pi") if occupancy else None
    if not heatmaps or heatmaps.get("checkpoint") != (section.get("checkpoint") if section else None):
        return None
    return [list(row) for row in pi] if isinstance(pi, list) else None


def view(section: MonitorsSection | None, loads: Sequence[Sequence[float]] | None = None) -> dict[str, Any] | None:
    """What the HTML certificate shows of its ``monitors``: the roll-up rows, the dashboards'
    own scalars and the per-layer values (metrics as columns, in the tables' order). ``loads``:
    the same checkpoint's per-layer expert loads (the heatmap's π) for NeMo's pooled
    utilisation keys."""
    layers = list(section.get("layers") or []) if section else []
    if not section or not layers:
        return None
    columns = [(src, name) for src, table in (("megatron", MEGATRON), ("nemo", NEMO)) for name, _ in table]
    return {
        "checkpoint": section.get("checkpoint"),
        "rollups": rollups(layers),
        "scalars": {**megatron_scalars(layers), **nemo_scalars(layers), **nemo_utilization(loads or [])},
        "columns": [f"{src}: {name}" for src, name in columns],
        "layers": [
            {"layer": e["layer"], "values": [_metrics(e, src).get(name) for src, name in columns]} for e in layers
        ],
    }
