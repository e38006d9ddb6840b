"""The producers and renderers of the envelope report, the gate entries, the checks, the
ablation receipt, the precision agreement and the preregistration record build and read the
typed records of :mod:`moeaudit.records`, not ``dict[str, Any]`` (docs/architecture.md,
"Documents as types").

Three checks, each able to fail on its own:

* the annotations of every function in the converted modules, and of the converted functions
  elsewhere (read from the source with ``ast``, as ``tests/test_layering.py`` reads imports),
  name no untyped document — no ``dict[str, Any]``, ``Mapping[str, Any]`` or bare ``dict`` —
  and no ``cast`` hides one;
* the per-series rows the checks produce are the report's rows less the field the report adds
  (``series`` / ``layer``), field for field, so the two types cannot drift apart;
* real reports — short and long series, breaks, starvation, resampling, ``--compare`` with a
  probe — validate against the JSON Schema generated from :class:`~moeaudit.records.EnvelopeReport`
  (closed records: a key the type does not name fails), the runtime check mypy cannot make.
"""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

import jsonschema
import pytest

import moeaudit
from moeaudit import records
from moeaudit.jsonio import finite_document
from moeaudit.judge import envelope as env
from moeaudit.judge import envelope_compare as cmp
from moeaudit.metrics import read_metrics
from moeaudit.policy import EnvelopeSettings
from moeaudit.records import fields, required
from moeaudit.schemas import generate

ROOT = Path(moeaudit.__file__).resolve().parent

# Modules whose every function is typed: the envelope report's producer (moeaudit envelope,
# receipts/envelope.json, the predicate's envelope) and its renderer.
TYPED_MODULES = [
    "judge/envelope_checks.py",
    "judge/envelope_columns.py",
    "judge/envelope_compare.py",
    "judge/envelope_report.py",
    "judge/envelope_rules.py",
    "judge/envelope_series.py",
    # and of the checks, the ablation receipt and the preregistration record
    "judge/decide.py",
    "judge/ablation.py",
    "attest/preregistration.py",
    "attest/predicate.py",
    "report/gate_table.py",
]
# Functions elsewhere that produce or render the envelope report.
TYPED_FUNCTIONS = {
    "series.py": ["evaluate_run", "envelope_evidence", "norms_from_receipts"],
    "commands/envelope.py": ["envelope", "exit_code"],
    "report/terminal.py": ["print_envelope", "print_comparison", "print_monitors", "print_nonfinite"],
    "report/charts.py": ["envelope_chart", "_bound_curves", "c2_bars", "_c2_row"],
    "metrics.py": ["to_json"],  # a log finding (LogFinding)
    # the gate entries (GateEntry) and the readers of a receipts document they are built from
    "judge/gates.py": [
        "baselines",
        "evaluate_gates",
        "_combine",
        "structural",
        "nll_change",
        "gate_summary",
        "_layer_summary",
        "drift_summary",
        "nonfinite_findings",
        "c2_status",
    ],
    # the health floors of one checkpoint and what its canary resolves of them
    "judge/health.py": [
        "health",
        "silent_experts",
        "dead_experts",
        "counted_dead",
        "floor_resolution",
        "canary_tokens",
    ],
    # the measured ablation, the precision agreement, the monitors section and the abandoned branches
    "receipts/ablation.py": ["ablation_receipt"],
    "receipts/agreement.py": ["compare_results", "resolution", "measure"],
    "report/monitors.py": ["section", "heatmap_loads", "megatron_scalars", "nemo_scalars"],
    "lineage.py": ["to_json"],
    # a pair layer's sections (the pair document)
    "receipts/drift.py": ["pair_layer"],
    # the policy's settings and file (predicate.policy, predicate.inputs), the preregistration statement
    "policy.py": ["to_json", "file_input"],
    "attest/intoto.py": ["_canonical_settings", "policy_configuration"],
    "commands/preregister.py": ["preregister"],
}
# Renderers and signers whose inputs are records; what they return is no document of moeaudit's
# (a page's view, a DSSE envelope), so only their parameters are checked.
TYPED_INPUTS = {
    "report/monitors.py": ["view", "rollups"],
    "attest/certificate.py": ["sign_statement"],
    "report/html.py": ["page", "margin_rows", "gate_row", "figures", "_allowed_drops", "envelope_view", "digests"],
    "report/readings.py": ["gate_note", "_floor"],
    "report/ablation.py": ["ablation_view"],
    # the readers of a verified statement (any version, read defensively: only their inputs typed)
    "report/export.py": ["assess", "certificate_summary", "export", "_charts"],  # (the export itself: no record)
    "attest/recheck.py": [
        "recheck",
        "run_root",
        "_subjects",
        "_checkpoint_files",
        "_inputs",
        "_policy",
        "_canary",
        "_origin_path",
        "_added",
    ],
    "attest/intoto.py": ["certified_criteria", "criteria_preregistered", "policy_configuration"],
}
# built as records, never cast to one (the typed modules: checked with them)
NO_CAST = ["judge/gates.py", "judge/health.py"]
UNTYPED = ("dict[str, Any]", "Dict[", "Mapping[str, Any]", "MutableMapping[str, Any]", "dict[str, object]")
ALIASES = re.compile(r"\bDoc\b")  # the report's alias of Mapping[str, Any]


def untyped_annotations(source: str, only: list[str] | None = None, *, inputs_only: bool = False) -> list[str]:
    """``name: annotation`` of every parameter or return that is an untyped document, and every
    ``cast(`` call, in ``source`` (of the functions named ``only``, else all; ``inputs_only``:
    their parameters alone)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cast" and only is None:
            found.append(f"cast at line {node.lineno}")
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
            only is not None and node.name not in only
        ):
            continue
        args = node.args
        for name, ann in [
            ("return", None if inputs_only else node.returns),
            *((a.arg, a.annotation) for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)),
        ]:
            if ann is None:
                continue
            text = ast.unparse(ann)
            if (
                any(u in text for u in UNTYPED)
                or ALIASES.search(text)
                or text.strip("'\"") in ("dict", "Dict", "Mapping")
            ):
                found.append(f"{node.name}: {name}: {text}")
        for sub in () if inputs_only else ast.walk(node):  # annotated locals: `x: dict[str, Any] = {...}`
            if isinstance(sub, ast.AnnAssign) and any(u in ast.unparse(sub.annotation) for u in UNTYPED):
                found.append(f"{node.name}: local {ast.unparse(sub.target)}: {ast.unparse(sub.annotation)}")
    return found


def test_the_checker_finds_untyped_documents() -> None:
    """The check below cannot pass vacuously."""
    src = (
        "from typing import Any, cast\n"
        "def a(x: dict[str, Any]) -> int: ...\n"
        "def b() -> 'dict': ...\n"
        "def c(m: Mapping[str, Any] | None) -> None: ...\n"
        "def d() -> None:\n    r: dict[str, Any] = {}\n    return cast(int, r)\n"
        "def e(x: EnvelopeReport) -> list[Alert]: ...\n"
        "def f(rules: Doc | None) -> str: ...\n"
    )
    assert sorted(untyped_annotations(src)) == [
        "a: x: dict[str, Any]",
        "b: return: 'dict'",
        "c: m: Mapping[str, Any] | None",
        "cast at line 7",
        "d: local r: dict[str, Any]",
        "f: rules: Doc | None",
    ]
    assert untyped_annotations(src, only=["e", "c"]) == ["c: m: Mapping[str, Any] | None"]
    assert untyped_annotations(src, only=["a", "b", "d"], inputs_only=True) == ["a: x: dict[str, Any]"]


@pytest.mark.parametrize("module", TYPED_MODULES)
def test_the_envelope_producer_modules_are_typed(module: str) -> None:
    source = (ROOT / module).read_text(encoding="utf-8")
    assert untyped_annotations(source) == [], f"{module}: build the records of moeaudit.records"


@pytest.mark.parametrize("module", sorted(TYPED_FUNCTIONS))
def test_the_envelope_functions_elsewhere_are_typed(module: str) -> None:
    source = (ROOT / module).read_text(encoding="utf-8")
    names = TYPED_FUNCTIONS[module]
    defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
    assert set(names) <= defined, f"{module}: renamed? {set(names) - defined}"
    assert untyped_annotations(source, only=names) == []


@pytest.mark.parametrize("module", sorted(TYPED_INPUTS))
def test_the_renderers_take_records(module: str) -> None:
    source = (ROOT / module).read_text(encoding="utf-8")
    assert untyped_annotations(source, only=TYPED_INPUTS[module], inputs_only=True) == []


def test_every_evidence_selector_takes_a_verified_statement() -> None:
    """The compliance export's selectors (report/evidence.py) read one verified statement each."""
    tree = ast.parse((ROOT / "report/evidence.py").read_text(encoding="utf-8"))
    params = [
        (f.name, ast.unparse(a.annotation) if a.annotation else None)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for a in f.args.args
        if a.arg == "stmt"
    ]
    assert len(params) >= 25
    assert [p for p in params if p[1] != "VerifiedStatement"] == []


@pytest.mark.parametrize("module", NO_CAST)
def test_the_producers_cast_nothing(module: str) -> None:
    found = [f for f in untyped_annotations((ROOT / module).read_text(encoding="utf-8")) if f.startswith("cast")]
    assert found == [], f"{module}: build the record rather than cast a dict to it"


@pytest.mark.parametrize(
    ("row", "report_row", "added", "kind"),
    [
        (records.WindowCheck, records.EnvelopeWindow, "series", str),
        (records.PairCheck, records.DiscreteRow, "series", str),
        (records.AlertRun, records.Alert, "series", str),
        (records.DeadRun, records.DeadExpert, "layer", str),
        (records.StarvedWindow, records.Starvation, "layer", str),
        (records.PairSections, records.PairLayer, "layer", int),
    ],
)
def test_a_series_row_is_the_report_row_less_its_name(row: type, report_row: type, added: str, kind: type) -> None:
    assert fields(report_row) == {added: kind, **fields(row)}
    assert list(fields(report_row)) == [added, *fields(row)]  # the order the report writes
    assert required(report_row) == required(row) | {added}


def test_the_comparison_record_is_the_compared_windows_and_the_reports() -> None:
    both = fields(records.EnvelopeComparison)
    for name, tp in fields(records.WindowComparison).items():
        assert both[name] == tp, name
    assert required(records.WindowComparison) <= required(records.EnvelopeComparison)


# --- the runtime documents against the types ---------------------------------------------------------


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = generate(records.EnvelopeReport, wire=False, name="envelope-test.schema.json")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _valid(validator: jsonschema.Draft202012Validator, report: object) -> None:
    doc = finite_document(report)  # type: ignore[type-var]
    doc.pop("nonfinite", None)  # finite_document's own list, not the producer's
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator.iter_errors(doc)]
    assert errors == []


def _series(
    seed: int, *, steps: int = 40, gap: int = 25, starve: bool = False, nulls: bool = False
) -> env.EnvelopeSeries:
    rng = random.Random(seed)
    t = [gap * (i + 1) for i in range(steps)]
    norms: dict[str, list[list[float | None]]] = {}
    for layer in ("0", "1"):
        rows: list[list[float | None]] = []
        for i in range(steps):
            g: list[float | None] = [rng.uniform(0.5, 1.5) for _ in range(4)]
            if starve and i > steps // 3:
                g[0] = 1e-5
            if nulls and i in (7, 8):
                g[2] = None
            rows.append(g)
        norms[layer] = rows
    return env.from_norms("replay", t, norms, "normalized", origin=f"seed {seed}")


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        ("plain", EnvelopeSettings(variant="normalized", starve_steps=50, dead_steps=20)),
        ("tight", EnvelopeSettings(variant="normalized", delta=0.5, epsilon=1e-9, window=60)),
        ("calibrated", EnvelopeSettings(variant="normalized", calibrated=True, sampling_interval=50, starve_steps=75)),
    ],
)
@pytest.mark.parametrize("shape", ["short", "starved", "nulls", "long"])
def test_reports_validate_against_the_record(
    validator: jsonschema.Draft202012Validator, kind: str, settings: EnvelopeSettings, shape: str
) -> None:
    series = {
        "short": lambda: _series(1),
        "starved": lambda: _series(2, starve=True),
        "nulls": lambda: _series(3, nulls=True),
        "long": lambda: _series(4, steps=700, gap=3, starve=True, nulls=True),
    }[shape]()
    steps = list(series.steps)
    # a break before the last sample leaves it alone in its segment: its window is null
    report = env.evaluate(series, settings, breaks=(steps[len(steps) // 2], steps[-1]))
    assert report["series"]["pooled"][-1]["window"] is None
    _valid(validator, report)


def test_a_log_report_with_findings_validates(validator: jsonschema.Draft202012Validator, tmp_path: Path) -> None:
    lines = [
        f'{{"step": {10 * (i + 1)}, "loss": 1.0, "expert_grad_norms": {{"0": [1.0, {"1e999" if i == 3 else 0.5}]}}}}'
        for i in range(30)
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    report = env.evaluate(env.from_metrics(read_metrics(path), "raw"), EnvelopeSettings(variant="raw"))
    assert report["findings"] and report["findings"][0]["step"] == 40
    _valid(validator, report)


def test_a_comparison_validates(validator: jsonschema.Draft202012Validator) -> None:
    logs = _series(5, nulls=True)
    replay = logs.at(list(logs.steps)[::5])
    settings = EnvelopeSettings(variant="normalized")
    constants = {view: settings for view in (*cmp.VIEWS, "probe")}
    report = env.evaluate(logs, settings)
    other = env.evaluate(replay, settings)
    comparison = cmp.compare(logs, replay, constants, breaks=(list(logs.steps)[12],), probe=replay)
    assert comparison["skipped"] and "probe" in comparison["constants"] and "probe_vs_replay" in comparison
    report["comparison"] = {"calibrated_on": None, "note": "n", **comparison, "report": other, "probe_report": other}
    _valid(validator, report)
    report["comparison"]["windows"][0]["logs"]["misspelt"] = 1  # type: ignore[typeddict-unknown-key]
    with pytest.raises(AssertionError, match="misspelt"):
        _valid(validator, report)
