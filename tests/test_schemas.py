"""The published JSON Schemas (moeaudit/schemas) against the record types and real documents.

The suite-wide check — every certificate, receipts and gate JSON moeaudit writes in any test is
validated — lives in ``tests/schema_check.py`` (wired by ``conftest.py``); here: the shipped
files are what the types generate, their field names are the types' (wire names for the
predicate), a real certificate and gate JSON validate, and a wrong document does not.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import schema_check
from click.testing import CliRunner

from moeaudit import records
from moeaudit.attest.naming import DATA_MAPS, camel
from moeaudit.cli import cli
from moeaudit.policy import Policy
from moeaudit.schemas import fields, generated, load, required

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "healthy.statement.json"
SAMPLES = ROOT / "sample_checkpoints"
KEY = ROOT / "tests" / "golden" / "test-signing-key.pem"


def _golden_predicate() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))["predicate"]


def test_the_shipped_schemas_are_what_the_types_generate() -> None:
    """Regenerate with ``python -m moeaudit.schemas`` after changing a record in moeaudit/records/."""
    for name, schema in generated().items():
        assert load(name) == schema, f"{name} is stale: run python -m moeaudit.schemas"
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize(
    ("name", "record", "wire"),
    [
        ("training-health-v2.predicate.schema.json", records.Predicate, True),
        ("receipts-v1.schema.json", records.Receipts, False),
        ("gate-v1.schema.json", records.GateDocument, False),
    ],
)
def test_schema_field_names_are_the_record_keys(name: str, record: type, wire: bool) -> None:
    """Property names and required keys of every record in the schema equal the TypedDict's keys
    (lowerCamelCase in the predicate's schema, as signed)."""
    schema = load(name)
    rename = camel if wire else (lambda k: k)
    defs = {**schema["$defs"], record.__name__: schema}
    checked = 0
    for rec in vars(records).values():
        if not (isinstance(rec, type) and rec.__name__ in defs and getattr(rec, "__annotations__", None)):
            continue
        body = defs[rec.__name__]
        assert set(body["properties"]) == {rename(k) for k in fields(rec)}, rec.__name__
        assert set(body["required"]) == {rename(k) for k in required(rec)}, rec.__name__
        assert body["additionalProperties"] is (rec in records.OPEN), rec.__name__
        checked += 1
    assert checked >= (20 if wire else 3)
    if wire:
        assert "verdictReason" in schema["properties"] and "issuedAt" in schema["properties"]
        assert "piMin" in schema["$defs"]["LayerSummary"]["properties"]


def test_the_policy_records_name_every_policy_setting() -> None:
    """The signed policy sections are ``Policy.to_json()``: the records name exactly its keys."""
    settings = Policy().to_json()
    for section, record in (
        ("receipts", records.ReceiptsPolicy),
        ("margins", records.MarginsPolicy),
        ("envelope", records.EnvelopePolicy),
        ("gates", records.GatesPolicy),
    ):
        assert set(settings[section]) == set(fields(record)), section
    assert set(settings) == set(fields(records.PolicySettings))


def test_the_wire_name_exceptions_come_from_the_types() -> None:
    assert DATA_MAPS == {
        "envelope.series",
        "envelope.shown",
        "envelope.comparison.agreement.by_series",  # never signed: certify does not compare
        "envelope.comparison.probe_vs_replay.by_series",
        "gates[].structural.c2_tolerance",
        "gates[].continuity.c2_tolerance",
        "gates[].structural.c2_deltas",
        "gates[].continuity.c2_deltas",
        "gates[].structural.c2_not_applicable",
        "gates[].continuity.c2_not_applicable",
        "gates[].structural.c2_excluded_tokens",
        "gates[].continuity.c2_excluded_tokens",
        "gates[].structural.below_floor",
        "gates[].continuity.below_floor",
        "gates[].receipts.nll_by_domain",
        "heatmaps.domains.layers",
        "heatmaps.domains.layers.*",
        "precision_agreement[].topk_flip_rate.layers",
        "precision_agreement[].resolution.layers",
        "monitors.layers[].megatron",  # the monitors' own metric names (docs/monitors.md)
        "monitors.layers[].nemo",
    }


def test_the_golden_predicate_validates_and_a_wrong_one_does_not() -> None:
    good = _golden_predicate()
    schema_check.validate(schema_check.PREDICATE, good, "golden")
    wrong: list[tuple[str, Any]] = [
        ("a misspelt field", lambda p: p["gates"][1].__setitem__("consecutiveBads", 0)),
        ("a snake_case name on the wire", lambda p: p.__setitem__("verdict_reason", p.pop("verdictReason"))),
        ("a missing field", lambda p: p["run"].pop("checkpoints")),
        ("a verdict outside PASS/FAIL/INCONCLUSIVE", lambda p: p.__setitem__("verdict", "OK")),
        ("a string where a number is", lambda p: p["gates"][0]["receipts"].__setitem__("nll", "0.9")),
        ("a gate status outside the four", lambda p: p["gates"][0].__setitem__("status", "AMBER")),
    ]
    for what, mutate in wrong:
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(AssertionError, match="does not match"):
            schema_check.validate(schema_check.PREDICATE, bad, what)


def test_certify_and_gate_outputs_are_validated_as_they_are_written(
    tmp_path: Path, samples_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real certify and gate --json through the CLI: the conftest hook validates each written
    document (counted), and the files on disk validate here too."""
    monkeypatch.setenv("MOEAUDIT_CACHE_DIR", str(samples_cache))
    run = tmp_path / "sft-refine"
    shutil.copytree(SAMPLES / "sft-refine", run, ignore=shutil.ignore_patterns("checkpoint-[2-7]*"))
    shutil.copy(SAMPLES / "canary.safetensors", tmp_path / "canary.safetensors")
    shutil.copy(SAMPLES / "policy.toml", tmp_path / "policy.toml")
    before = dict(schema_check.SEEN)
    out = tmp_path / "cert"
    done = CliRunner().invoke(cli, ["certify", str(run), "--key", str(KEY), "--out", str(out)])
    assert done.exit_code == 0, done.output
    gate_json = tmp_path / "gate.json"
    done = CliRunner().invoke(
        cli, ["gate", str(run / "checkpoint-0"), str(run / "checkpoint-1000"), "--json", str(gate_json)]
    )
    assert done.exit_code in (0, 1, 3), done.output
    seen = {k: v - before.get(k, 0) for k, v in schema_check.SEEN.items()}
    # certificate.json and the Sigstore bundle, two receipts, one gate document
    assert seen.get(schema_check.PREDICATE) == 2 and seen.get(schema_check.RECEIPTS) == 2
    assert seen.get(schema_check.GATE) == 1
    envelope = json.loads((out / "certificate.json").read_text(encoding="utf-8"))
    predicate = json.loads(base64.b64decode(envelope["payload"]))["predicate"]
    jsonschema.validate(
        predicate, load("training-health-v2.predicate.schema.json"), cls=jsonschema.Draft202012Validator
    )
    for receipts in sorted((out / "receipts").glob("checkpoint-*.json")):
        jsonschema.validate(
            json.loads(receipts.read_text(encoding="utf-8")),
            load("receipts-v1.schema.json"),
            cls=jsonschema.Draft202012Validator,
        )
    gate_doc = json.loads(gate_json.read_text(encoding="utf-8"))
    jsonschema.validate(gate_doc, load("gate-v1.schema.json"), cls=jsonschema.Draft202012Validator)
    gate_doc["decision"] = "SHIP IT"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(gate_doc, load("gate-v1.schema.json"), cls=jsonschema.Draft202012Validator)


def test_a_subprocess_validates_what_it_writes(tmp_path: Path, samples_cache: Path) -> None:
    """``python -m moeaudit`` started by a test validates its documents too (tests/schema_site):
    a gate --json written by a subprocess is logged as validated, and a subprocess whose
    document breaks its schema fails instead of writing it."""
    import os
    import subprocess
    import sys

    log = Path(os.environ["MOEAUDIT_SCHEMA_LOG"])
    run = SAMPLES / "sft-refine"
    out = tmp_path / "gate.json"
    env = {**os.environ, "MOEAUDIT_CACHE_DIR": str(samples_cache)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeaudit",
            "gate",
            str(run / "checkpoint-0"),
            str(run / "checkpoint-1000"),
            "--json",
            str(out),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode in (0, 1, 3), done.stderr
    assert f" {out}\n" in log.read_text(encoding="utf-8")
    # the same wrapper refuses a document that breaks its schema (exercised in a subprocess)
    code = (
        "import moeaudit.jsonio as j, sys; sys._getframe().f_globals['__name__'] = 'moeaudit.x'\n"
        f'j.atomic_write({str(tmp_path / "bad.json")!r}, \'{{"schema": "moeaudit.gate/v1"}}\')\n'
    )
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "does not match gate-v1.schema.json" in bad.stderr
    assert not (tmp_path / "bad.json").exists()
