"""Training-log metrics: a strict ``metrics.jsonl`` reader and per-step gradient variance.

``metrics.jsonl`` (SPEC §2.3) holds one JSON object per logged step, written by
:mod:`moeaudit.integrations.hooks`::

    {"step": 500, "loss": 2.31, "expert_grad_norms": {"<layer>": [g_0, ..., g_{E-1}]}, ...}

Every malformed line is an :class:`InputError` naming ``file:line``. Two things are findings,
not errors, because the hook writes them on purpose: a ``null`` norm or loss (a non-finite
number, SPEC §10; a literal beyond the float range such as ``1e999``, which JSON reads as Inf,
is the same finding), and an unterminated, unparseable last line (the write in progress when a
run was interrupted; the hook drops it when it reopens the file). Nothing is dropped silently.
The file is streamed, one line of at most 4 MiB at a time (``moeaudit.limits``).

Variance definitions follow `000` Def. 6.2 and SPEC §4 "Gradients": the population variance
over experts ``var_grad = (1/E) Σ (g_e − ḡ)²``, its scale-free form ``var_grad / ḡ²``, and the
pooled series over the concatenation of all layers' experts.

Torch-free (STYLE). Shape legend: S logged steps, E experts of one layer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeaudit.errors import InputError
from moeaudit.jsonio import no_duplicate_keys
from moeaudit.limits import iter_lines

POOLED = "pooled"
VARIANTS = ("raw", "normalized")

Norms = tuple[float | None, ...]  # one layer's E norms at one step; None = logged as null


@dataclass(frozen=True)
class Finding:
    """Something in the log a reader must know about that is not a reason to stop."""

    line: int
    step: int | None
    where: str
    what: str

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "step": self.step, "where": self.where, "what": self.what}


@dataclass(frozen=True)
class MetricsSeries:
    """The logged steps of one ``metrics.jsonl``: loss and per-layer expert norms."""

    path: str
    steps: tuple[int, ...]  # [S], strictly increasing
    loss: tuple[float | None, ...]  # [S]
    norms: dict[str, tuple[Norms, ...]]  # layer → [S] vectors of [E]
    lines: tuple[int, ...]  # [S] file line of each step
    findings: tuple[Finding, ...] = ()

    @property
    def layers(self) -> list[str]:
        return list(self.norms)

    @property
    def num_experts(self) -> dict[str, int]:
        return {layer: len(vectors[0]) for layer, vectors in self.norms.items()}


# --- reading -------------------------------------------------------------------------------------


def read_metrics(path: str | Path) -> MetricsSeries:
    """Stream ``path`` line by line (a regular file; each line at most MAX_JSONL_LINE_BYTES)."""
    path = Path(path)
    return _parse(iter_lines(path, "metrics log"), path)


def parse_metrics(text: str, path: str | Path = "metrics.jsonl") -> MetricsSeries:
    """Parse the text of a ``metrics.jsonl``; see the module docstring for what is refused."""
    raw_lines = text.split("\n")
    return _parse(((n, line, n < len(raw_lines)) for n, line in enumerate(raw_lines, 1)), path)


def _parse(numbered: Iterable[tuple[int, str | bytes, bool]], path: str | Path) -> MetricsSeries:
    """(line number, line, terminated by a newline) → the series; the file is never one string."""
    steps: list[int] = []
    loss: list[float | None] = []
    lines: list[int] = []
    norms: dict[str, list[Norms]] = {}
    findings: list[Finding] = []
    for n, line, terminated in numbered:
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            text = line.decode("utf-8") if isinstance(line, bytes) else line
            obj = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:  # _Refused, UnicodeDecodeError: ValueErrors
            if not terminated:  # no newline after it: a torn write, not a malformed log
                findings.append(
                    Finding(
                        n, None, "line", "unterminated last line ignored (a write in progress or an interrupted run)"
                    )
                )
                continue
            raise InputError(
                f"line is not valid JSON ({_why(exc)})",
                path=where,
                hint="one JSON object per line; write non-finite numbers as null",
            ) from exc
        step, line_loss, line_norms = _parse_line(obj, where, n, findings)
        if steps and step <= steps[-1]:
            kind = "duplicate" if step == steps[-1] else "out of order"
            raise InputError(
                f"step {step} is {kind} (previous logged step {steps[-1]}, line {lines[-1]})",
                path=where,
                hint="steps must strictly increase",
            )
        _check_layers(line_norms, norms, lines, where)
        steps.append(step)
        loss.append(line_loss)
        lines.append(n)
        for layer, vector in line_norms.items():
            norms.setdefault(layer, []).append(vector)
    if not steps:
        raise InputError("metrics log has no logged steps", path=path)
    ordered = {layer: tuple(norms[layer]) for layer in sorted(norms, key=_layer_key)}
    return MetricsSeries(str(path), tuple(steps), tuple(loss), ordered, tuple(lines), tuple(findings))


class _Refused(ValueError):
    pass


def _no_constant(token: str) -> Any:
    raise _Refused(f"{token} is not JSON; a non-finite number must be written as null")


def _why(exc: Exception) -> str:
    return exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)


def _parse_line(obj: Any, where: str, n: int, findings: list[Finding]) -> tuple[int, float | None, dict[str, Norms]]:
    if not isinstance(obj, dict):
        raise InputError("line is not a JSON object", path=where)
    step = obj.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        what = "has no 'step'" if "step" not in obj else f"has 'step' {step!r}"
        raise InputError(f"line {what}; it must be a non-negative integer", path=where)
    if "loss" not in obj:
        raise InputError("line has no 'loss' (a number, or null when non-finite)", path=where)
    line_loss = _number(obj["loss"], "loss", where)
    if line_loss is None:
        findings.append(Finding(n, step, "loss", _nonfinite("loss", obj["loss"])))
    table = obj.get("expert_grad_norms")
    if not isinstance(table, dict) or not table:
        raise InputError("line has no 'expert_grad_norms' object of {\"<layer>\": [norms]}", path=where)
    out: dict[str, Norms] = {}
    for layer, vector in table.items():
        label = f"expert_grad_norms[{layer!r}]"
        if not isinstance(vector, list) or not vector:
            raise InputError(f"{label} must be a non-empty list of norms", path=where)
        values = tuple(_number(v, f"{label}[{e}]", where) for e, v in enumerate(vector))
        for e, v in enumerate(values):
            if v is None:
                findings.append(Finding(n, step, f"{label}[{e}]", _nonfinite("expert gradient norm", vector[e])))
            elif v < 0:
                raise InputError(f"{label}[{e}] = {v!r} is negative; a norm is ≥ 0", path=where)
        out[str(layer)] = values
    return step, line_loss, out


def _number(value: Any, label: str, where: str) -> float | None:
    """A finite float, or None for null and for a literal beyond the float range (``1e999``
    parses to Inf): both are findings, never numbers that reach the envelope."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{label} must be a number or null, got {value!r}", path=where)
    try:
        as_float = float(value)
    except OverflowError:  # an integer literal beyond the float range
        return None
    return as_float if math.isfinite(as_float) else None


def _nonfinite(what: str, logged: Any) -> str:
    if logged is None:
        return f"non-finite {what} (logged as null)"
    return f"non-finite {what} (a number beyond the float range, read as Inf)"


def _check_layers(line_norms: dict[str, Norms], seen: dict[str, list[Norms]], lines: list[int], where: str) -> None:
    """Every step logs the same layers with the same number of experts as the first step."""
    if not seen:
        return
    if set(line_norms) != set(seen):
        raise InputError(
            f"layers {sorted(line_norms, key=_layer_key)} differ from "
            f"{sorted(seen, key=_layer_key)} logged at line {lines[0]}",
            path=where,
            hint="every line must log every routed layer",
        )
    for layer, vector in line_norms.items():
        first = len(seen[layer][0])
        if len(vector) != first:
            raise InputError(
                f"layer {layer!r} logs {len(vector)} experts here but {first} at line {lines[0]}",
                path=where,
                hint="the expert count of a layer cannot change within a run",
            )


def _layer_key(layer: str) -> tuple[int, int | str]:
    return (0, int(layer)) if layer.isdigit() else (1, layer)


# --- variance (`000` Eq. 9, SPEC §4) -------------------------------------------------------------


def var_grad(g_E: Sequence[float]) -> float:
    """Population variance over experts, ``(1/E) Σ (g_e − ḡ)²`` (`000` Eq. 9)."""
    mean = math.fsum(g_E) / len(g_E)
    return math.fsum((g - mean) ** 2 for g in g_E) / len(g_E)


def var_grad_norm(g_E: Sequence[float]) -> float | None:
    """Scale-free ``var_grad / ḡ²``; None when ḡ = 0 (no expert received any gradient).

    Computed as the variance of g_e/ḡ, which cannot underflow when ḡ is tiny.
    """
    mean = math.fsum(g_E) / len(g_E)
    return var_grad([g / mean for g in g_E]) if mean > 0 else None


def variance(g_E: Sequence[float | None], variant: str) -> tuple[float | None, str | None]:
    """V of one step in ``variant`` ("raw" | "normalized"), or (None, why it has no value)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    finite = [g for g in g_E if g is not None and math.isfinite(g)]
    if len(finite) != len(g_E):
        return None, "a gradient norm is non-finite (null in the log)"
    if variant == "raw":
        return var_grad(finite), None
    value = var_grad_norm(finite)
    return (value, None) if value is not None else (None, "mean gradient norm is 0")


def with_pooled(norms_by_layer: Mapping[str, Sequence[Sequence[float | None]]]) -> dict[str, list[list[float | None]]]:
    """``{"pooled": [S] concatenations of all layers' [E] vectors, layer: [S] vectors}``."""
    layers = list(norms_by_layer)
    count = {len(norms_by_layer[layer]) for layer in layers}
    if len(count) != 1:
        raise ValueError(f"layers have different numbers of steps: {sorted(count)}")
    pooled = [[g for layer in layers for g in norms_by_layer[layer][j]] for j in range(count.pop())]
    return {POOLED: pooled, **{layer: [list(v) for v in norms_by_layer[layer]] for layer in layers}}


def variance_series(
    norms_by_layer: Mapping[str, Sequence[Sequence[float | None]]], variant: str
) -> tuple[dict[str, list[float | None]], dict[str, dict[int, str]]]:
    """Per-step V for "pooled" and every layer, plus ``{series: {sample index: why None}}``."""
    values: dict[str, list[float | None]] = {}
    notes: dict[str, dict[int, str]] = {}
    for key, vectors in with_pooled(norms_by_layer).items():
        values[key] = []
        for j, g_E in enumerate(vectors):
            value, why = variance(g_E, variant)
            values[key].append(value)
            if why is not None:
                notes.setdefault(key, {})[j] = why
    return values, notes
