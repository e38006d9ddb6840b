"""Every certificate, receipts and gate JSON moeaudit writes during the suite is validated
against its published JSON Schema (``moeaudit/schemas``) with the ``jsonschema`` library.

``tests/conftest.py`` wraps :func:`moeaudit.jsonio.atomic_write` — the one function moeaudit
writes its outputs with — for every test: a write made by moeaudit's own code (not a test
forging a document on purpose) is parsed and, when it is one of the published documents,
validated before the test goes on; a document that does not match fails the test that wrote
it. :data:`SEEN` counts what was validated, by schema.
"""

from __future__ import annotations

import base64
import json
import sys
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

from moeaudit.attest.certificate import PREDICATE_TYPE

SEEN: Counter[str] = Counter()
PREDICATE = "training-health-v2.predicate.schema.json"
RECEIPTS = "receipts-v1.schema.json"
GATE = "gate-v1.schema.json"
BY_SCHEMA_FIELD = {"moeaudit.receipts/v1": RECEIPTS, "moeaudit.gate/v1": GATE}
BY_PREDICATE_TYPE = {
    "https://in-toto.io/attestation/test-result/v0.1": "test-result-v0.1.statement.schema.json",
    "https://in-toto.io/attestation/svr/v0.1": "svr-v0.1.statement.schema.json",
    "https://in-toto.io/attestation/svr/v0.2": "svr-v0.2.statement.schema.json",
    "https://moeaudit.dev/preregistration/v1": "preregistration-v1.statement.schema.json",
}


@cache
def validator(name: str) -> Any:
    import jsonschema

    from moeaudit.schemas import load

    schema = load(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def validate(name: str, doc: Any, where: str) -> None:
    errors = sorted(validator(name).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        shown = "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}" for e in errors[:5])
        raise AssertionError(f"{where} does not match {name} ({len(errors)} error(s)): {shown}")
    SEEN[name] += 1


def _statement(envelope: dict[str, Any]) -> Any:
    return json.loads(base64.b64decode(envelope["payload"]))


def check_document(path: str | Path, data: str | bytes) -> str | None:
    """Validate ``data`` (written to ``path``) when it is a published document; the schema's
    name, or None for anything else (HTML, JUnit, a v1 or foreign statement)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    envelope = doc.get("dsseEnvelope") if "dsseEnvelope" in doc else doc
    if isinstance(envelope, dict) and envelope.get("payloadType") == "application/vnd.in-toto+json":
        stmt = _statement(envelope)
        if isinstance(stmt, dict) and stmt.get("predicateType") == PREDICATE_TYPE:
            validate(PREDICATE, stmt["predicate"], str(path))
            return PREDICATE
        statement_schema = BY_PREDICATE_TYPE.get(str(stmt.get("predicateType"))) if isinstance(stmt, dict) else None
        if statement_schema is not None:  # gate --attest-test-result, verify --attest-verification
            validate(statement_schema, stmt, str(path))
        return statement_schema
    name = BY_SCHEMA_FIELD.get(str(doc.get("schema")))
    if name is not None:
        validate(name, doc, str(path))
    return name


def note_subprocess(path: str | Path) -> None:
    """In a subprocess (``tests/schema_site``): append the validated file's path to the log the
    suite reads back (``MOEAUDIT_SCHEMA_LOG``), so a test can see the subprocess checked it."""
    import os

    log = os.environ.get("MOEAUDIT_SCHEMA_LOG")
    if log and SEEN:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {path}\n")


def wrap(real: Any) -> Any:
    """``atomic_write`` that validates what moeaudit's own code writes, then writes it."""

    def atomic_write(path: str | Path, data: str | bytes, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("moeaudit"):
            check_document(path, data)
        return real(path, data, *args, **kwargs)

    atomic_write.__wrapped__ = real  # type: ignore[attr-defined]
    return atomic_write
