"""A ``--reference`` opened before any replay (docs/policy.md, "[margins]"; docs/security.md, "One read per input").

A receipts file is read once, hashed from the bytes parsed, and checked — receipts JSON, of this
canary, holding every field the handoff margin reads — so a truncated, foreign or hand-edited
file is one error naming it before the run's checkpoints are replayed, not after. A checkpoint
directory is only named here: replaying it is the audit's work (:func:`moeaudit.receipts.pair.load_reference`).

Torch-free: a certify whose receipts all come from the cache does not load torch for its reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from moeaudit.canary import Canary
from moeaudit.checkpoint.safetensors import DuplicateKey, no_duplicate_keys
from moeaudit.errors import InputError
from moeaudit.limits import MAX_RECEIPTS_BYTES, read_hashed, read_regular
from moeaudit.margins import check_same_moe, handoff
from moeaudit.policy import Policy, protected_layers
from moeaudit.records import FileResource, Receipts, ReferenceInput

RECEIPTS_SCHEMA = "moeaudit.receipts/v1"  # moeaudit.receipts.state.SCHEMA (that module loads torch)


@dataclass(frozen=True)
class Reference:
    """A ``--reference``: a receipts file read and checked (``doc``, and ``read``, the
    ``predicate.inputs`` entry of the very bytes parsed), or a checkpoint directory (both None)."""

    path: Path
    doc: Receipts | None = None
    read: dict[str, Any] | None = None


def open_reference(path: str | Path, canary: Canary, policy: Policy) -> Reference:
    """``path`` as a reference: a checkpoint directory named for its replay, or a receipts file
    read once and checked now (:func:`read_receipts`)."""
    path = Path(path)
    if path.is_dir():
        return Reference(path)
    hashed: list[dict[str, Any]] = []
    return Reference(path, read_receipts(path, canary, policy, hashed), hashed[0])


def read_receipts(path: Path, canary: Canary, policy: Policy, hashed: list[dict[str, Any]] | None = None) -> Receipts:
    """A reference receipts file, checked against ``canary`` and the fields the handoff margin
    reads; ``hashed`` receives the ``predicate.inputs`` entry of the very bytes parsed."""
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
    _check_fields(doc, policy, path)
    return cast(Receipts, doc)  # a receipts document: its schema, canary and what the margin reads checked


def check_same_model(ref: Reference, name: str, spec: Any) -> None:
    """A receipts reference of another MoE structure than the run's (``spec``, its checkpoint
    ``name``) is refused now, as the handoff margin would refuse it after the replay."""
    if ref.doc is not None:
        layers = list(spec.routed_layers)
        ours = {"name": name, "family": spec.family, "routed_layers": layers, "experts": spec.num_experts}
        try:
            check_same_moe({"checkpoint": {**ours, "top_k": spec.top_k}}, ref.doc)
        except InputError as exc:  # named by the file it is in
            raise InputError(exc.what, path=ref.path, hint=exc.hint) from exc


def reference_input(ref: Reference, doc: Receipts) -> ReferenceInput:
    """The certificate's ``inputs.reference``: a receipts file's SHA-256 of the bytes parsed; a
    checkpoint's model-signing root digest and file list, as for the subjects — hashed again
    after its replay, and refused if that differs from the digest replayed."""
    if ref.read is not None:
        return cast(ReferenceInput, {**ref.read, "kind": "receipts"})  # {path, sha256, bytes}
    from moeaudit.checkpoint.digest import changed, snapshot

    digest = doc["checkpoint"]["digest"]
    root = digest["sha256"] if isinstance(digest, dict) else digest
    snap = snapshot(ref.path)  # hashed again: the list must be of the files that were replayed
    if snap.digest != root:
        raise changed(ref.path, "its files no longer hash to the root digest of the replayed reference")
    resources = cast(list[FileResource], snap.resources)
    return {"path": ref.path.name, "kind": "checkpoint", "root_sha256": root, "resources": resources}


def _field(doc: Any, *keys: str) -> Any:
    for key in keys:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def _check_fields(doc: dict[str, Any], policy: Policy, path: Path) -> None:
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
