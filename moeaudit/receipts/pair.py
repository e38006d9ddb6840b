"""The healthy reference of the handoff margin (docs/policy.md, "[margins]"): a checkpoint replayed, or its receipts
JSON checked against the canary and the fields the margin reads. ``moeaudit compare`` itself is
:mod:`moeaudit.commands.compare`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint
from moeaudit.checkpoint.safetensors import DuplicateKey, no_duplicate_keys
from moeaudit.errors import InputError
from moeaudit.limits import MAX_RECEIPTS_BYTES, read_hashed, read_regular
from moeaudit.margins import handoff
from moeaudit.policy import Policy, protected_layers
from moeaudit.receipts.state import SCHEMA as RECEIPTS_SCHEMA
from moeaudit.receipts.state import run_state
from moeaudit.records import Receipts
from moeaudit.replay.result import Progress


def load_reference(
    path: str | Path,
    canary: Canary,
    policy: Policy,
    progress: Progress | None = None,
    device: str | None = None,
    hashed: list[dict[str, Any]] | None = None,
) -> Receipts:
    """A reference is a healthy checkpoint directory (replayed on ``device``) or its receipts
    JSON on the same canary. For a receipts file, ``hashed`` receives the ``predicate.inputs``
    entry of the very bytes parsed (one read, docs/security.md)."""
    path = Path(path)
    if path.is_dir():
        return run_state(Checkpoint(path), canary, policy, progress=progress, device=device)[0]
    raw = read_regular(path, "reference receipts", MAX_RECEIPTS_BYTES)
    if hashed is not None:
        hashed.append(read_hashed(raw, path.name))
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:  # readers would disagree on which value counts
        raise InputError(f"reference receipts JSON repeats the key {exc.key!r}", path=path) from exc
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 or JSON
        raise InputError(f"reference is neither a checkpoint directory nor receipts JSON ({exc})", path=path) from exc
    if not isinstance(doc, dict) or doc.get("schema") != RECEIPTS_SCHEMA:
        raise InputError(f"reference JSON is not a {RECEIPTS_SCHEMA} document", path=path)
    digest = _field(doc, "canary", "digest", "sha256")
    if digest != canary.digest:
        raise InputError(
            "reference receipts were computed on another canary"
            if isinstance(digest, str)
            else "reference receipts name no canary digest",
            path=path,
            hint="recompute them with `moeaudit receipts REF --canary ...`",
        )
    _check_reference(doc, policy, path)
    return cast(Receipts, doc)  # a receipts document: its schema, canary and what the margin reads checked


def _field(doc: Any, *keys: str) -> Any:
    for key in keys:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def _check_reference(doc: dict[str, Any], policy: Policy, path: Path) -> None:
    """Fail now, naming the file, if the receipts lack what the handoff margin reads: the
    margin of the reference against itself reads every field it will read later."""
    try:
        routed = [int(entry["layer"]) for entry in doc["layers"]]
        handoff(doc, doc, protected_layers(policy, routed, str(path)), policy.margins)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        raise InputError(
            f"reference receipts JSON lacks or garbles a field the handoff margin reads ({type(exc).__name__}: {exc})",
            path=path,
            hint="use receipts written by `moeaudit receipts REF --json OUT`",
        ) from exc
