"""Training-log metrics: a strict ``metrics.jsonl`` reader and per-step gradient variance.

``metrics.jsonl`` (docs/envelope.md, "Reading `metrics.jsonl`") holds one JSON object per logged step, written by
:mod:`moeaudit.integrations.hooks`::

    {"step": 500, "loss": 2.31, "expert_grad_norms": {"<layer>": [g_0, ..., g_{E-1}]}, ...}

Every malformed line is an :class:`InputError` naming ``file:line``. Two things are findings,
not errors, because the hook writes them on purpose: a ``null`` norm or loss (a non-finite
number, README.md, "Schemas"; a literal beyond the float range such as ``1e999``, which JSON reads as Inf,
is the same finding), and an unterminated, unparseable last line (the write in progress when a
run was interrupted; the hook drops it when it reopens the file). Nothing is dropped silently.
The file is streamed, one line of at most 4 MiB at a time (``moeaudit.limits``), hashed as it is
read, and kept as typed arrays (:class:`Column`, :class:`Rows`), not as parsed lines.

Variance definitions follow `000` Def. 6.2 (docs/glossary.md, "Gradient norms / var_grad"): the population variance
over experts ``var_grad = (1/E) Σ (g_e − ḡ)²``, its scale-free form ``var_grad / ḡ²``, and the
pooled series over the concatenation of all layers' experts.

Torch-free (STYLE). Shape legend: S logged steps, E experts of one layer.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, overload

from moeaudit.errors import InputError
from moeaudit.jsonio import no_duplicate_keys
from moeaudit.limits import Hashed, iter_lines
from moeaudit.records import LogFinding

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

    def to_json(self) -> LogFinding:
        return {"line": self.line, "step": self.step, "where": self.where, "what": self.what}


class Column(Sequence[Any]):
    """One value per logged step, kept in a typed array (4 or 8 bytes a step, not a Python
    object): ints, or floats with NaN standing for a missing value, read back as None. Equal to
    any sequence with the same items, so it reads like the tuple it replaces."""

    __slots__ = ("_a",)

    def __init__(self, a: array[Any]):
        self._a = a

    def __len__(self) -> int:
        return len(self._a)

    @overload
    def __getitem__(self, j: int) -> Any: ...
    @overload
    def __getitem__(self, j: slice) -> Column: ...
    def __getitem__(self, j: int | slice) -> Any:
        if isinstance(j, slice):
            return Column(self._a[j])  # a typed copy, not a million Python objects
        return self._out(self._a[j])

    def _out(self, v: Any) -> Any:
        return None if v != v else v  # NaN (floats only): missing

    def __iter__(self) -> Iterator[Any]:
        if self._a.typecode in "qI":
            return iter(self._a)
        return (None if v != v else v for v in self._a)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Column({list(self)!r})"


class RowSequence(Sequence[Norms]):
    """A sequence of per-step norm vectors read one step at a time: indexing (negative indices
    and slices too) is here, a subclass says how step ``j`` (0 <= j < len) is read (``_row``)."""

    __slots__ = ()

    def _row(self, j: int) -> Norms:
        raise NotImplementedError

    @overload
    def __getitem__(self, j: int) -> Norms: ...
    @overload
    def __getitem__(self, j: slice) -> tuple[Norms, ...]: ...
    def __getitem__(self, j: int | slice) -> Norms | tuple[Norms, ...]:
        if isinstance(j, slice):
            return tuple(self._row(i) for i in range(*j.indices(len(self))))
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError("step index out of range")
        return self._row(j)


class Rows(RowSequence):
    """One layer's [S] vectors of [E] norms in one flat typed array (NaN = null), read back a
    step at a time as a tuple. Single precision when every norm of the layer is exactly a float32
    — what the training hook logs (``Tensor.item()`` of float32 norms) — else double, so no value
    is ever rounded (docs/benchmarks.md §10)."""

    __slots__ = ("_a", "width")

    def __init__(self, width: int):
        self._a: array[float] = array("f")
        self.width = width

    def append(self, vector: Norms) -> None:
        self._a = _extend(self._a, [math.nan if v is None else v for v in vector])

    def __len__(self) -> int:
        return len(self._a) // self.width

    def _row(self, j: int) -> Norms:
        w = self.width
        return tuple(None if v != v else v for v in self._a[j * w : (j + 1) * w])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    @property
    def itemsize(self) -> int:
        return self._a.itemsize

    def __repr__(self) -> str:
        return f"Rows({list(self)!r})"


def _extend(a: array[float], values: list[float]) -> array[float]:
    """``a`` (single precision while every value so far was exactly a float32) extended by
    ``values``; promoted to double, once, by the first value a float32 would round. NaN (a null,
    or nothing logged) is exact in either."""
    if a.typecode == "f":
        single = array("f", values)
        got = single.tolist()
        if got == values or all(x == y or (x != x and y != y) for x, y in zip(got, values, strict=True)):
            a.extend(single)
            return a
        a = array("d", a)
    a.extend(values)
    return a


@dataclass(frozen=True)
class MetricsSeries:
    """The logged steps of one ``metrics.jsonl``: loss and per-layer expert norms.

    Kept compact (typed arrays, :class:`Column` and :class:`Rows`) so a log of millions of
    lines fits in memory; ``sha256`` and ``size`` are of exactly the bytes parsed (empty for
    :func:`parse_metrics` of a string)."""

    path: str
    steps: Sequence[int]  # [S], strictly increasing
    loss: Sequence[float | None]  # [S]
    norms: dict[str, Sequence[Norms]]  # layer → [S] vectors of [E]
    lines: Sequence[int]  # [S] file line of each step
    findings: tuple[Finding, ...] = ()
    lm_loss: Sequence[float | None] = ()  # [S] where logged: the objective without auxiliary terms
    sha256: str = ""
    size: int = 0
    precisions: tuple[str, ...] = ()  # a probe's "precision" fields: computed in its bf16/fp16 weights

    @property
    def layers(self) -> list[str]:
        return list(self.norms)

    @property
    def num_experts(self) -> dict[str, int]:
        return {layer: len(vectors[0]) for layer, vectors in self.norms.items()}

    def record(self) -> dict[str, Any]:
        """The ``predicate.inputs`` entry of the bytes this series was parsed from."""
        return {"path": Path(self.path).name, "sha256": self.sha256, "bytes": self.size}


# --- reading -------------------------------------------------------------------------------------


def read_metrics(
    path: str | Path, what: str = "metrics log", tap: Callable[[bytes], None] | None = None
) -> MetricsSeries:
    """Stream ``path`` line by line (a regular file; each line at most MAX_JSONL_LINE_BYTES),
    hashing exactly the bytes parsed: one read of the file (docs/security.md). ``tap`` sees each
    raw line of that same read (the canary digests a probe log names, ``Run.read_logs_once``)."""
    path = Path(path)
    hashed = Hashed()
    lines = iter_lines(path, what, hashed=hashed)
    if tap is not None:
        lines = _tapped(lines, tap)
    series = _parse(lines, path)
    return replace(series, sha256=hashed.sha256, size=hashed.size)


def _tapped(
    lines: Iterator[tuple[int, bytes, bool]], tap: Callable[[bytes], None]
) -> Iterator[tuple[int, bytes, bool]]:
    for item in lines:
        tap(item[1])
        yield item


def parse_metrics(text: str, path: str | Path = "metrics.jsonl") -> MetricsSeries:
    """Parse the text of a ``metrics.jsonl``; see the module docstring for what is refused."""
    raw_lines = text.split("\n")
    return _parse(((n, line, n < len(raw_lines)) for n, line in enumerate(raw_lines, 1)), path)


def _parse(numbered: Iterable[tuple[int, str | bytes, bool]], path: str | Path) -> MetricsSeries:
    """(line number, line, terminated by a newline) → the series; the file is never one string,
    and no parsed line is kept (a line's dict costs ~100× its numbers)."""
    steps: array[int] = array("I")  # 4 bytes a step; promoted past 2³² − 1
    loss: array[float] = array("f")  # single precision while exact (as the norms, Rows)
    lm_loss: array[float] = array("f")
    lines: array[int] = array("I")  # 4 bytes a step; promoted past 2³² − 1 lines
    norms: dict[str, Rows] = {}
    precisions: set[str] = set()
    first_line = 0
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
        if isinstance(obj.get("precision"), str):
            precisions.add(obj["precision"])
        if steps and step <= steps[-1]:
            kind = "duplicate" if step == steps[-1] else "out of order"
            raise InputError(
                f"step {step} is {kind} (previous logged step {steps[-1]}, line {lines[-1]})",
                path=where,
                hint="steps must strictly increase",
            )
        _check_layers(line_norms, norms, first_line, where)
        first_line = first_line or n
        if step > 0xFFFFFFFF and steps.typecode == "I":
            steps = array("q", steps)
        steps.append(step)
        loss = _extend(loss, [math.nan if line_loss is None else line_loss])
        lm_loss = _extend(lm_loss, [_lm_loss(obj)])
        if n > 0xFFFFFFFF and lines.typecode == "I":
            lines = array("q", lines)
        lines.append(n)
        for layer, vector in line_norms.items():
            norms.setdefault(layer, Rows(len(vector))).append(vector)
    if not steps:
        raise InputError("metrics log has no logged steps", path=path)
    ordered: dict[str, Sequence[Norms]] = {layer: norms[layer] for layer in sorted(norms, key=_layer_key)}
    series = MetricsSeries(
        str(path), Column(steps), Column(loss), ordered, Column(lines), tuple(findings), Column(lm_loss)
    )
    return replace(series, precisions=tuple(sorted(precisions))) if precisions else series


def _lm_loss(obj: dict[str, Any]) -> float:
    """``lm_loss`` where the hook logged a finite one (the language-model part of the objective,
    without auxiliary balancing terms), else NaN (not logged)."""
    value = obj.get("lm_loss")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        return float(value) if math.isfinite(value) else math.nan
    except OverflowError:
        return math.nan


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


def _check_layers(line_norms: dict[str, Norms], seen: dict[str, Rows], first_line: int, where: str) -> None:
    """Every step logs the same layers with the same number of experts as the first step."""
    if not seen:
        return
    if set(line_norms) != set(seen):
        raise InputError(
            f"layers {sorted(line_norms, key=_layer_key)} differ from "
            f"{sorted(seen, key=_layer_key)} logged at line {first_line}",
            path=where,
            hint="every line must log every routed layer",
        )
    for layer, vector in line_norms.items():
        first = seen[layer].width
        if len(vector) != first:
            raise InputError(
                f"layer {layer!r} logs {len(vector)} experts here but {first} at line {first_line}",
                path=where,
                hint="the expert count of a layer cannot change within a run",
            )


def _layer_key(layer: str) -> tuple[int, int | str]:
    return (0, int(layer)) if layer.isdigit() else (1, layer)


# --- variance (`000` Eq. 9) -------------------------------------------------------------------


def layer_total(g_E: Sequence[float]) -> float:
    """Σ_e g_e added left to right from 0.0: the same bits on every Python (3.12's ``sum``
    compensates, 3.11's does not) and in the array form of the level rule."""
    total = 0.0
    for g in g_E:
        total += g
    return total


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
