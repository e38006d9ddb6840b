"""``moeaudit compare``: both checkpoints' state receipts, pair receipts on base-anchored states,
and the lifecycle margins (`003` §5; docs/policy.md, "[margins]"). Cost: one forward + backward per checkpoint, then one
layer-local pass holding one layer of each checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from moeaudit.commands.common import (
    QUIET,
    Hooks,
    Tick,
    check_output,
    check_reference,
    load_policy,
    one_checkpoint,
    open_checkpoint,
    ranks,
    refuse_inside,
)
from moeaudit.records import CompareDocument, Margins, PairLayer

if TYPE_CHECKING:
    from moeaudit.canary import Canary
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.policy import Policy

SCHEMA: Final[Literal["moeaudit.compare/v1"]] = "moeaudit.compare/v1"


@dataclass(frozen=True)
class Compared:
    """The ``moeaudit.compare/v1`` document and the policy it was judged by."""

    doc: CompareDocument
    policy: Policy


def compare(
    base: Path,
    candidate: Path,
    *,
    canary_path: Path | None = None,
    reference: Path | None = None,
    policy_path: Path | None = None,
    json_out: Path | None = None,
    force: bool = False,
    nproc: int | None = None,
    hooks: Hooks = QUIET,
) -> Compared:
    """Drift of ``candidate`` from ``base`` and the lifecycle margins (``reference``: a healthy
    checkpoint or its receipts JSON, for the handoff margin). ``json_out`` is only checked here,
    before any work: the caller writes it."""
    from moeaudit import canary as canary_mod
    from moeaudit.locate import require_canary

    refuse_inside("--json", json_out, base, candidate, reference)
    check_output(json_out, force, stdout=True)
    check_reference(reference)
    one_checkpoint(base, "moeaudit compare {ckpt} CANDIDATE")
    one_checkpoint(candidate, "moeaudit compare BASE {ckpt}")
    b, c = open_checkpoint(base, hooks), open_checkpoint(candidate, hooks)
    probe = canary_mod.load(require_canary(canary_path and str(canary_path), base))
    policy = load_policy(policy_path, base, hooks)
    with ranks(nproc), hooks.progress() as tick:
        doc = compare_checkpoints(b, c, probe, policy, reference=reference, progress=tick)
    return Compared(doc, policy)


def compare_checkpoints(
    base: Checkpoint,
    cand: Checkpoint,
    canary: Canary,
    policy: Policy,
    *,
    reference: str | Path | None = None,
    progress: Tick | None = None,
) -> CompareDocument:
    """The ``moeaudit.compare/v1`` document of two opened checkpoints of one architecture."""
    from moeaudit.checkpoint.checkpoint import check_compatible
    from moeaudit.jsonio import finite_document
    from moeaudit.margins import handoff, refinement
    from moeaudit.policy import protected_layers
    from moeaudit.receipts.drift import bootstrap_for, pair_layer
    from moeaudit.receipts.pair import load_reference
    from moeaudit.receipts.reference import Reference, check_same_model
    from moeaudit.receipts.state import run_state

    check_compatible(base, cand)
    # A bad reference (wrong canary, not receipts, another model) should fail before the replays, not after.
    ref_doc = None
    if reference is not None:
        ref_doc = load_reference(reference, canary, policy, progress)
        check_same_model(Reference(Path(reference), ref_doc), cand.path.name, cand.spec)
    base_doc, base_obs = run_state(base, canary, policy, keep_states=True, progress=progress)
    cand_doc, cand_obs = run_state(cand, canary, policy, keep_states=True, progress=progress)
    routed = base.spec.routed_layers
    layers: list[PairLayer] = []
    drift = {}
    for layer in routed:
        lw0, lw1 = base.layer_weights(layer), cand.layer_weights(layer)
        boot = bootstrap_for(policy.receipts, canary.num_windows, layer)
        entry = pair_layer(base.spec, lw0, lw1, base_obs.states[layer], cand_obs.states[layer], boot)
        layers.append({"layer": layer, **entry})
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
