"""``moeaudit compare``: both checkpoints' state receipts, pair receipts on base-anchored
states, and the lifecycle margins (SPEC §5–§6). Cost: one forward + backward per checkpoint,
then one layer-local pass holding one layer of each checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final, Literal, cast

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint
from moeaudit.checkpoint.checkpoint import ARCH_FIELDS, check_compatible  # noqa: F401 (re-export)
from moeaudit.checkpoint.safetensors import DuplicateKey, no_duplicate_keys
from moeaudit.errors import InputError
from moeaudit.jsonio import finite_document
from moeaudit.limits import MAX_RECEIPTS_BYTES, read_hashed, read_regular
from moeaudit.margins import handoff, refinement
from moeaudit.policy import Policy, protected_layers
from moeaudit.receipts.drift import bootstrap_for, pair_layer
from moeaudit.receipts.state import SCHEMA as RECEIPTS_SCHEMA
from moeaudit.receipts.state import run_state
from moeaudit.records import CompareDocument, Margins, PairLayer, Receipts
from moeaudit.replay.result import Progress

SCHEMA: Final[Literal["moeaudit.compare/v1"]] = "moeaudit.compare/v1"


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


def compare(
    base: Checkpoint,
    cand: Checkpoint,
    canary: Canary,
    policy: Policy,
    *,
    reference: str | Path | None = None,
    progress: Progress | None = None,
) -> CompareDocument:
    check_compatible(base, cand)
    # A bad reference (wrong canary, not receipts) should fail before the replays, not after.
    ref_doc = None if reference is None else load_reference(reference, canary, policy, progress)
    base_doc, base_obs = run_state(base, canary, policy, keep_states=True, progress=progress)
    cand_doc, cand_obs = run_state(cand, canary, policy, keep_states=True, progress=progress)
    routed = base.spec.routed_layers
    layers: list[PairLayer] = []
    drift = {}
    for layer in routed:
        lw0, lw1 = base.layer_weights(layer), cand.layer_weights(layer)
        boot = bootstrap_for(policy.receipts, canary.num_windows, layer)
        entry = pair_layer(base.spec, lw0, lw1, base_obs.states[layer], cand_obs.states[layer], boot)
        layers.append(cast(PairLayer, {"layer": layer, **entry}))  # open: the drift sections
        drift[layer] = entry["drift"]
        del lw0, lw1
    protected = protected_layers(policy, routed, str(base.path))
    margins: Margins = {
        "refinement": refinement(base_doc, cand_doc, drift, protected, policy.margins),
        "handoff": None,
    }
    if ref_doc is not None:
        margins["handoff"] = handoff(cand_doc, ref_doc, protected, policy.margins)
    base.verify_unchanged()  # the pass above read both again
    cand.verify_unchanged()
    settings = policy.to_json()
    doc: CompareDocument = {
        "schema": SCHEMA,
        "base": base_doc,
        "candidate": cand_doc,
        "protected_layers": protected,
        "policy": {
            "source": policy.source,
            "digest": policy.digest,
            "receipts": settings["receipts"],
            "margins": settings["margins"],
            "envelope": settings["envelope"],
            "gates": settings["gates"],
        },
        "layers": layers,
        "margins": margins,
    }
    return finite_document(doc)
