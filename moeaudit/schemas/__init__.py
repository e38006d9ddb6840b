"""JSON Schemas (draft 2020-12) of the documents moeaudit publishes, generated from the record
types of :mod:`moeaudit.records`.

The schemas ship beside this module (``*.schema.json``); :func:`load` reads one. They are
regenerated with ``python -m moeaudit.schemas`` and ``tests/test_schemas.py`` fails when a
shipped file differs from what the types generate, so the two cannot drift apart.

* ``training-health-v2.predicate.schema.json`` — the signed predicate
  (``https://moeaudit.dev/training-health/v2``), field names as on the wire (lowerCamelCase);
* ``receipts-v1.schema.json`` — ``moeaudit.receipts/v1`` (``receipts --json``,
  ``receipts/checkpoint-<step>.json``);
* ``gate-v1.schema.json`` — ``moeaudit.gate/v1`` (``gate --json``);
* ``test-result-v0.1.statement.schema.json``, ``svr-v0.2.statement.schema.json`` — the in-toto
  statements ``gate --attest-test-result`` and ``verify --attest-verification`` sign
  (:mod:`moeaudit.attest.intoto`), as moeaudit writes them (a subset of what in-toto allows);
  ``svr-v0.1.statement.schema.json``, the Simple Verification Result earlier versions wrote.
* ``preregistration-v1.statement.schema.json`` — the statement ``moeaudit preregister`` signs
  (:mod:`moeaudit.attest.preregistration`).

Every number a computation gives may be ``null``: a value that was not finite (NaN, Inf) is
written ``null`` and listed under the document's ``nonfinite`` (never a NaN in JSON).

Torch-free; reading a schema needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from moeaudit import records
from moeaudit.records import OPEN, PUBLISHED

DRAFT = "https://json-schema.org/draft/2020-12/schema"
BASE_ID = "https://moeaudit.dev/schemas/"
_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}

from moeaudit.records import data_map_paths, fields, is_record, required  # noqa: E402


def generate(record: type, *, wire: bool, name: str) -> dict[str, Any]:
    """The JSON Schema of ``record``; ``wire``: field names in their lowerCamelCase wire form."""
    from moeaudit.attest.naming import camel

    rename: Callable[[str], str] = camel if wire else (lambda k: k)
    defs: dict[str, Any] = {}

    def schema(tp: Any) -> dict[str, Any]:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is Any:
            return {}
        if tp is float:  # a number that was not finite is written null (listed under nonfinite)
            return {"type": ["number", "null"]}
        if tp in _SIMPLE:
            return {"type": _SIMPLE[tp]}
        if origin is typing.Annotated:
            return schema(args[0])
        if origin is typing.Literal:
            return {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
        if origin is list:
            return {"type": "array", "items": schema(args[0])}
        if origin is dict:
            return {"type": "object", "additionalProperties": schema(args[1])}
        if origin in (typing.Union, types.UnionType):
            arms = [schema(a) for a in args]
            if all(set(a) == {"type"} for a in arms):
                kinds = [k for a in arms for k in (a["type"] if isinstance(a["type"], list) else [a["type"]])]
                return {"type": list(dict.fromkeys(kinds))}
            return {"anyOf": arms}
        if is_record(tp):
            ref = tp.__name__
            if ref not in defs:
                defs[ref] = {}  # recursion guard
                props = {rename(k): schema(v) for k, v in fields(tp).items()}
                body: dict[str, Any] = {"type": "object"}
                doc = (tp.__doc__ or "").strip()
                if doc and not doc.startswith(("dict(", "A simple typed namespace")):
                    body["description"] = " ".join(doc.split())
                body["properties"] = props
                body["required"] = sorted(rename(k) for k in required(tp))
                body["additionalProperties"] = tp in OPEN
                defs[ref] = body
            return {"$ref": f"#/$defs/{ref}"}
        raise TypeError(f"no JSON Schema for {tp!r}")

    root = schema(record)
    out: dict[str, Any] = {"$schema": DRAFT, "$id": BASE_ID + name, "title": f"moeaudit {record.__name__}"}
    out.update(defs[record.__name__])
    out["$defs"] = {k: v for k, v in sorted(defs.items()) if k != record.__name__}
    assert root == {"$ref": f"#/$defs/{record.__name__}"}
    return _self_refs(out, record.__name__)


def _self_refs(schema: dict[str, Any], root: str) -> dict[str, Any]:
    """References to the root record point at the document itself (``#``)."""
    text = json.dumps(schema).replace(f'"#/$defs/{root}"', '"#"')
    result: dict[str, Any] = json.loads(text)
    return result


def generated() -> dict[str, dict[str, Any]]:
    """File name → schema, as the record types give them today."""
    return {name: generate(rec, wire=wire, name=name) for name, (rec, wire) in PUBLISHED.items()}


def dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def load(name: str) -> dict[str, Any]:
    """A shipped schema, by file name."""
    text = resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    result: dict[str, Any] = json.loads(text)
    return result


def write(folder: Path | None = None) -> list[Path]:
    """Regenerate the shipped schemas (``python -m moeaudit.schemas``)."""
    folder = folder or Path(__file__).parent
    out = []
    for name, schema in generated().items():
        path = folder / name
        path.write_text(dumps(schema), encoding="utf-8")
        out.append(path)
    return out


__all__ = ["data_map_paths", "generate", "generated", "load", "records", "write"]
