"""metrics.jsonl: strict reading (every malformed line named), variance definitions."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeaudit.errors import EXIT_INPUT, InputError
from moeaudit.metrics import (
    parse_metrics,
    read_metrics,
    var_grad,
    var_grad_norm,
    variance,
    variance_series,
    with_pooled,
)


def line(
    step: int, norms: dict[str, list[float | None]] | None = None, loss: float | None = 2.0, **extra: object
) -> str:
    norms = {"0": [1.0, 2.0], "1": [0.5, 0.5, 1.5]} if norms is None else norms
    return json.dumps({"step": step, "loss": loss, "expert_grad_norms": norms, **extra})


def text(*lines: str) -> str:
    return "".join(ln + "\n" for ln in lines)


def test_reads_a_log() -> None:
    ms = parse_metrics(text(line(0), line(10, {"1": [1, 1, 1], "0": [0, 3]}, loss=1.5, router_grad_norms={"0": 0.1})))
    assert ms.steps == (0, 10)
    assert ms.loss == (2.0, 1.5)
    assert ms.layers == ["0", "1"]
    assert ms.num_experts == {"0": 2, "1": 3}
    assert ms.norms["0"] == ((1.0, 2.0), (0.0, 3.0))
    assert ms.lines == (1, 2)
    assert ms.findings == ()


def test_layers_are_ordered_numerically() -> None:
    ms = parse_metrics(text(line(0, {"10": [1.0], "2": [1.0], "x": [1.0]})))
    assert ms.layers == ["2", "10", "x"]


def test_read_metrics_from_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(text(line(0), line(1)), encoding="utf-8")
    assert read_metrics(path).steps == (0, 1)
    with pytest.raises(InputError, match="not found"):
        read_metrics(tmp_path / "missing.jsonl")


BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"loss": 1.0, "expert_grad_norms": {"0": [1.0]}}), "no 'step'"),
    (json.dumps({"step": "5", "loss": 1.0, "expert_grad_norms": {"0": [1.0]}}), "'step' '5'"),
    (json.dumps({"step": True, "loss": 1.0, "expert_grad_norms": {"0": [1.0]}}), "'step' True"),
    (json.dumps({"step": -1, "loss": 1.0, "expert_grad_norms": {"0": [1.0]}}), "non-negative"),
    (json.dumps({"step": 5, "expert_grad_norms": {"0": [1.0, 2.0]}}), "no 'loss'"),
    (json.dumps({"step": 5, "loss": "x", "expert_grad_norms": {"0": [1.0, 2.0]}}), "loss must be"),
    (json.dumps({"step": 5, "loss": 1.0}), "expert_grad_norms"),
    (json.dumps({"step": 5, "loss": 1.0, "expert_grad_norms": {}}), "expert_grad_norms"),
    (json.dumps({"step": 5, "loss": 1.0, "expert_grad_norms": {"0": []}}), "non-empty list"),
    (line(5, {"0": [1.0, "big"], "1": [1.0, 1.0, 1.0]}), "must be a number or null"),
    (line(5, {"0": [1.0, True], "1": [1.0, 1.0, 1.0]}), "must be a number or null"),
    (line(5, {"0": [1.0, -0.5], "1": [1.0, 1.0, 1.0]}), "negative"),
    ('{"step": 5, "loss": 1.0, "expert_grad_norms": {"0": [NaN, 1.0], "1": [1, 1, 1]}}', "NaN is not JSON"),
    ('{"step": 5, "loss": Infinity, "expert_grad_norms": {"0": [1, 1], "1": [1, 1, 1]}}', "Infinity is not JSON"),
    ('{"step": 5, "step": 6, "loss": 1.0, "expert_grad_norms": {"0": [1, 1], "1": [1, 1, 1]}}', "duplicate key"),
    (line(1), "duplicate"),  # same step as line 2
    (line(0), "out of order"),
    (line(5, {"0": [1.0, 2.0, 3.0], "1": [1.0, 1.0, 1.0]}), "3 experts here but 2 at line 1"),
    (line(5, {"0": [1.0, 2.0]}), "differ from"),
]


@pytest.mark.parametrize(("bad", "why"), BAD)
def test_a_malformed_line_is_an_error_naming_the_line(bad: str, why: str) -> None:
    doc = text(line(0), line(1), bad, line(99))
    with pytest.raises(InputError, match=why) as info:
        parse_metrics(doc, "run/metrics.jsonl")
    assert "run/metrics.jsonl:3" in str(info.value)
    assert info.value.exit_code == EXIT_INPUT


def test_an_empty_log_is_an_error() -> None:
    with pytest.raises(InputError, match="no logged steps"):
        parse_metrics("\n\n", "m.jsonl")


def test_null_norms_and_loss_are_findings_not_errors() -> None:
    ms = parse_metrics(text(line(0), line(10, {"0": [None, 2.0], "1": [1, 1, 1]}, loss=None)))
    found = [(f.line, f.step, f.where) for f in ms.findings]
    assert found == [(2, 10, "loss"), (2, 10, "expert_grad_norms['0'][0]")]
    assert ms.norms["0"][1] == (None, 2.0)
    values, notes = variance_series(ms.norms, "raw")
    assert values["0"][1] is None and values["pooled"][1] is None and values["1"][1] == 0.0
    assert "non-finite" in notes["0"][1] and "non-finite" in notes["pooled"][1]


def test_a_torn_last_line_is_a_finding() -> None:
    ms = parse_metrics(text(line(0), line(1)) + '{"step": 2, "lo')
    assert ms.steps == (0, 1)
    assert ms.findings[0].line == 3 and "unterminated" in ms.findings[0].what
    # the same bytes followed by a newline are a malformed line, not a torn write
    with pytest.raises(InputError, match="m.jsonl:3"):
        parse_metrics(text(line(0), line(1), '{"step": 2, "lo'), "m.jsonl")


def test_a_complete_last_line_without_newline_is_read() -> None:
    assert parse_metrics(text(line(0)) + line(1)).steps == (0, 1)


# --- variance -------------------------------------------------------------------------------------

norms_lists = st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=40)


@given(norms_lists)
def test_var_grad_is_the_population_variance(g: list[float]) -> None:
    assert var_grad(g) == pytest.approx(statistics.pvariance(g), rel=1e-9, abs=1e-12)
    assert var_grad(g) >= 0


@given(norms_lists)
def test_normalized_variance_is_at_most_E_minus_1(g: list[float]) -> None:
    v = var_grad_norm(g)
    if sum(g) == 0:
        assert v is None
    else:
        assert v is not None and 0 <= v <= (len(g) - 1) * (1 + 1e-9)


def test_one_live_expert_reaches_the_normalized_bound() -> None:
    assert var_grad_norm([0.0, 0.0, 0.0, 5.0]) == pytest.approx(3.0)


def test_normalized_variance_of_silent_experts_has_no_value() -> None:
    assert variance([0.0, 0.0], "normalized") == (None, "mean gradient norm is 0")
    assert variance([0.0, 0.0], "raw") == (0.0, None)


def test_pooled_is_over_the_concatenation_of_all_layers() -> None:
    norms = {"0": [[1.0, 2.0], [1.0, 1.0]], "3": [[4.0, 0.0, 1.0], [2.0, 2.0, 2.0]]}
    assert with_pooled(norms)["pooled"] == [[1.0, 2.0, 4.0, 0.0, 1.0], [1.0, 1.0, 2.0, 2.0, 2.0]]
    values, _ = variance_series(norms, "normalized")
    g = [1.0, 2.0, 4.0, 0.0, 1.0]
    assert values["pooled"][0] == pytest.approx(statistics.pvariance(g) / statistics.mean(g) ** 2)
    assert list(values) == ["pooled", "0", "3"]
    assert math.isclose(values["0"][0], 0.25 / 2.25)  # type: ignore[arg-type]


def test_reads_what_the_training_hook_writes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from moeaudit.integrations.hooks import ExpertGradLogger
    from moeaudit.replay.model import rope_tables
    from moeaudit.samples.train import Arch, forward_loss, init_model

    arch = Arch(hidden=16, layers=2, heads=2, kv_heads=1, experts=4, expert_dim=8)
    model = init_model(arch, seed=0)
    tokens = torch.randint(0, arch.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ce, _ = forward_loss(model, tokens, rope_tables(model.spec, 8))
    ce.backward()
    path = tmp_path / "metrics.jsonl"
    with ExpertGradLogger(path, model.layers, every=5) as logger:
        written = [logger.log(step, ce) for step in (5, 10)]
        next(iter(model.layers[1].experts[2].values())).grad[0, 0] = float("nan")
        written.append(logger.log(15, ce))
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 20, "lo')  # interrupted mid-write
    ms = read_metrics(path)
    assert ms.steps == (5, 10, 15)
    assert ms.num_experts == {"0": 4, "1": 4}
    assert list(ms.norms["0"][0]) == written[0]["expert_grad_norms"]["0"]
    assert [(f.step, f.where) for f in ms.findings] == [(15, "expert_grad_norms['1'][2]"), (None, "line")]


# --- memory: the log is kept as typed arrays, not parsed lines (docs/benchmarks.md §9) -----------


def _hook_log(path: Path, lines: int, layers: int = 8, experts: int = 8) -> None:
    """What the training hook writes: float32 norms and losses (``Tensor.item()``)."""
    import random
    from array import array

    rng = random.Random(0)
    with path.open("w") as f:
        for step in range(1, lines + 1):
            norms = {
                str(i): array("f", [rng.uniform(1e-3, 3e-3) for _ in range(experts)]).tolist() for i in range(layers)
            }
            loss = array("f", [rng.uniform(2, 4)])[0]
            f.write(json.dumps({"step": step, "loss": loss, "lm_loss": loss, "expert_grad_norms": norms}) + "\n")


def test_a_long_log_costs_its_numbers_not_its_lines(tmp_path: Path) -> None:
    """8 layers × 8 experts: 64 float32 norms (256 bytes) and the step, losses and line number
    (16 bytes) a line. Parsed lines kept as dicts or tuples cost over 3 KB a line."""
    import tracemalloc

    path = tmp_path / "metrics.jsonl"
    _hook_log(path, 4000)
    read_metrics(path)  # imports and caches warmed
    tracemalloc.start()
    try:
        series = read_metrics(path)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(series.steps) == 4000 and series.size == path.stat().st_size
    assert kept / 4000 < 320 and peak / 4000 < 400, (kept / 4000, peak / 4000)


def test_compact_storage_keeps_every_value_exactly(tmp_path: Path) -> None:
    """Single precision only while every value is exactly a float32; the first value it would
    round promotes the layer to double, and the values read back are the values logged."""
    logged = [
        line(10, {"0": [0.5, 0.25], "1": [0.1, None]}, loss=2.5),
        line(20, {"0": [0.75, 1.0], "1": [0.2, 0.3]}, loss=None, lm_loss=1.25),
    ]
    series = parse_metrics(text(*logged))
    assert series.norms["0"] == ((0.5, 0.25), (0.75, 1.0))
    assert series.norms["0"].itemsize == 4  # type: ignore[attr-defined]
    assert series.norms["1"] == ((0.1, None), (0.2, 0.3))  # 0.1 is no float32: kept as double
    assert series.norms["1"].itemsize == 8  # type: ignore[attr-defined]
    assert series.loss == (2.5, None) and series.lm_loss == (None, 1.25)
    assert list(series.steps[1:]) == [20] and series.steps[-1] == 20
