"""The signed predicate follows in-toto's naming (lowerCamelCase field names,
an RFC 3339 ``Z`` time that says what it dates, the version in the type URI), converts back to
moeaudit's own names losslessly, keeps data keys (layers, domains, series) as they are, and a
v1 certificate (snake_case on the wire) still verifies and reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.naming import LOWER_CAMEL, _field_names  # noqa: E402

from moeaudit.attest.certificate import (
    PREDICATE_TYPE,
    PREDICATE_TYPE_V1,
    internal,
    open_certificate,
    sign_statement,
    statement,
)
from moeaudit.attest.naming import camel, from_wire, snake, to_wire, wire_path
from moeaudit.attest.signing import generate_key, load_public_key
from moeaudit.cli import cli
from moeaudit.jsonio import dumps
from moeaudit.report.export import export

GOLDEN = Path(__file__).parent / "golden" / "healthy.statement.json"  # a real certificate, as signed
EXAMPLE = Path(__file__).parent / "fixtures" / "statement_example.json"  # moeaudit's names


def test_the_signed_predicate_is_lower_camel_case() -> None:
    stmt = json.loads(GOLDEN.read_text())
    assert stmt["predicateType"] == PREDICATE_TYPE == "https://moeaudit.dev/training-health/v2"
    names = _field_names(stmt["predicate"])
    assert len(names) > 300
    assert [n for n in names if not LOWER_CAMEL.fullmatch(n[1])] == []
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stmt["predicate"]["issuedAt"])
    assert {"verdictReason", "protectedLayers", "issuedAt"} <= set(stmt["predicate"])


def test_wire_names_convert_back_losslessly() -> None:
    signed = json.loads(GOLDEN.read_text())["predicate"]
    ours = internal({"predicateType": PREDICATE_TYPE, "predicate": signed})["predicate"]
    assert to_wire(ours) == signed and from_wire(to_wire(ours)) == ours
    assert "issued_at" in ours and ours["gates"][1]["receipts"]["per_layer"][0]["pi_min"] > 0
    example = json.loads(EXAMPLE.read_text())["predicate"]  # moeaudit's names, another run
    assert from_wire(to_wire(example)) == example
    for _, name in _field_names(example):
        assert snake(camel(name)) == name


def test_data_keys_are_kept() -> None:
    """Layer indices, series and domain names are data: a domain called ``web_text`` or
    ``codeBase`` keeps its name both ways."""
    domains = {"web_text": 1.5, "codeBase": 2.5}
    predicate = {
        "gates": [{"receipts": {"nll_by_domain": domains, "per_layer": [{"pi_min": 0.1}]}}],
        "heatmaps": {"domains": {"layers": {"0": domains}, "names": list(domains)}},
        "envelope": {"series": {"pooled": [{"min_margin": 0}], "1": []}},
    }
    wire = to_wire(predicate)
    assert wire["gates"][0]["receipts"]["nllByDomain"] == domains
    assert wire["heatmaps"]["domains"]["layers"] == {"0": domains}
    assert wire["envelope"]["series"]["pooled"] == [{"minMargin": 0}]
    assert from_wire(wire) == predicate


def test_export_names_fields_as_signed(tmp_path: Path) -> None:
    key = generate_key(tmp_path / "k")
    stmt = statement(
        [{"name": "checkpoint-1", "digest": {"sha256": "ab" * 32}}], json.loads(EXAMPLE.read_text())["predicate"]
    )
    (tmp_path / "c.json").write_text(dumps(sign_statement(stmt, key)))
    report = export(open_certificate(tmp_path / "c.json", key.public_key()), "eu-ai-act")
    fields = {e["field"] for item in report["items"] for e in item["evidence"] + item["context"]}
    assert fields and all("_" not in f for f in fields)
    assert wire_path("predicate.gates[].receipts.nll_by_domain") == "predicate.gates[].receipts.nllByDomain"


@pytest.mark.parametrize("predicate_type", [PREDICATE_TYPE, PREDICATE_TYPE_V1])
def test_v1_and_v2_certificates_verify_and_read_alike(tmp_path: Path, predicate_type: str) -> None:
    """A v1 certificate (issued before v2, snake_case on the wire) verifies and reads as it did."""
    key = generate_key(tmp_path / "k")
    stmt = statement(
        [{"name": "checkpoint-1", "digest": {"sha256": "ab" * 32}}], json.loads(EXAMPLE.read_text())["predicate"]
    )
    stmt["predicateType"] = predicate_type
    envelope = sign_statement(stmt, key, issued_at="2026-01-01T00:00:00Z")
    (tmp_path / "c.json").write_text(dumps(envelope))
    read = open_certificate(tmp_path / "c.json", key.public_key())
    want = {**stmt["predicate"], "issued_at": "2026-01-01T00:00:00Z"}
    assert read["predicate"] == want and read["predicateType"] == predicate_type
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "c.json"), "--pubkey", str(tmp_path / "k.pub")])
    assert result.exit_code == 0 and "issued 2026-01-01T00:00:00Z" in result.stdout


def test_another_predicate_type_is_refused(tmp_path: Path) -> None:
    key = generate_key(tmp_path / "k")
    stmt = statement([{"name": "checkpoint-1", "digest": {"sha256": "ab" * 32}}], {"verdict": "PASS", "gates": []})
    stmt["predicateType"] = "https://moeaudit.dev/training-health/v3"
    (tmp_path / "c.json").write_text(dumps(sign_statement(stmt, key)))
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "c.json"), "--pubkey", str(tmp_path / "k.pub")])
    assert result.exit_code == 4 and "training-health/v3" in result.stderr


def test_domain_names_survive_a_real_certificate(tmp_path: Path) -> None:
    """A canary whose domains look like field names (``web_text``, ``codeBase``): the signed
    predicate and what ``verify`` reads both keep them exactly."""
    import base64
    import shutil

    from moeaudit import canary as canary_mod

    samples = Path(__file__).resolve().parent.parent / "sample_checkpoints"
    lines = [
        json.dumps({"domain": ("web_text", "codeBase")[w % 2], "tokens": [(7 * w + t) % 97 for t in range(16)]})
        for w in range(8)
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(lines))
    canary_mod.save(canary_mod.build_from_jsonl(tmp_path / "c.jsonl"), tmp_path / "canary.safetensors")
    run = tmp_path / "run"
    for step in (1250, 1500):
        shutil.copytree(samples / "healthy" / f"checkpoint-{step}", run / f"checkpoint-{step}")
    env = {"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    runner = CliRunner(env=env)
    assert runner.invoke(cli, ["keygen", "--out", str(tmp_path / "k")]).exit_code == 0
    done = runner.invoke(
        cli,
        [
            "certify",
            str(run),
            "--key",
            str(tmp_path / "k"),
            "--out",
            str(tmp_path / "out"),
            "--canary",
            str(tmp_path / "canary.safetensors"),
        ],
    )
    assert done.exit_code == 0, done.stderr
    cert = tmp_path / "out" / "certificate.json"
    wire = json.loads(base64.b64decode(json.loads(cert.read_text())["payload"]))["predicate"]
    read = open_certificate(cert, load_public_key(tmp_path / "k.pub"))["predicate"]
    for predicate, by_domain in ((wire, "nllByDomain"), (read, "nll_by_domain")):
        assert set(predicate["gates"][1]["receipts"][by_domain]) == {"web_text", "codeBase"}
    assert set(wire["heatmaps"]["domains"]["layers"]["1"]) == {"web_text", "codeBase"}
    assert read["heatmaps"] == internal({"predicateType": PREDICATE_TYPE, "predicate": wire})["predicate"]["heatmaps"]
