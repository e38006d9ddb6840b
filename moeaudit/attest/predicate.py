"""The signed v2 predicate (``https://moeaudit.dev/training-health/v2``), built as its record.

``certify`` gathers the evidence (receipts, gates, envelope, margins, the decision) and hands the
parts to :func:`predicate`, which constructs :class:`moeaudit.records.Predicate`; the parts that
are made from a canary, a policy or a run are records built here too, so ``mypy`` checks every
key of the predicate where it is made. At runtime a record is the plain ``dict`` it always was:
:func:`moeaudit.attest.certificate.statement` wraps it and
:func:`moeaudit.attest.certificate.sign_statement` puts it on the wire (lowerCamelCase,
canonical JSON), so the signed bytes do not depend on how the dict was built.

Torch-free: the canary, policy and run are read through their attributes, never imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from moeaudit import __version__
from moeaudit.attest.certificate import table4
from moeaudit.records import (
    Abandoned,
    CanaryMismatch,
    CanaryRecord,
    Check,
    Decision,
    EnvelopeReport,
    EnvironmentRecord,
    GateEntry,
    Heatmaps,
    Inputs,
    Margins,
    PolicyRecord,
    Predicate,
    Receipts,
    RunEvent,
    RunRecord,
    ToolRecord,
)

if TYPE_CHECKING:
    from moeaudit.canary import Canary
    from moeaudit.policy import Policy


def tool_record() -> ToolRecord:
    return {"name": "moeaudit", "version": __version__}


def canary_record(canary: Canary, *, origin: str = "", mismatches: Sequence[Mapping[str, str]] = ()) -> CanaryRecord:
    """The audited canary: its content digest and shape; where it came from (``origin``); a
    canary built from text, its tokenizer's and text's digests; what the run recorded instead
    (``mismatches``, signed only when certify was told to accept them)."""
    record: CanaryRecord = {
        "digest": {"sha256": canary.digest},
        "windows": canary.num_windows,
        "window_len": canary.window_len,
        "domains": list(canary.domains),
    }
    if origin:
        record["origin"] = origin
    if canary.built_from:  # both digests or neither (moeaudit.canary.BUILT_FROM)
        record["tokenizer_sha256"] = canary.built_from["tokenizer_sha256"]
        record["text_sha256"] = canary.built_from["text_sha256"]
    if mismatches:
        record["mismatches"] = [_mismatch(m) for m in mismatches]
    return record


def _mismatch(found: Mapping[str, str]) -> CanaryMismatch:
    """One of :func:`moeaudit.canary.run_mismatches`' findings ({source, recorded, given})."""
    return {"source": found["source"], "recorded": found["recorded"], "given": found["given"]}


def policy_record(policy: Policy) -> PolicyRecord:
    """The policy as signed: where it came from, its digest, and every setting
    (:meth:`moeaudit.policy.Policy.to_json`)."""
    settings = policy.to_json()
    record: PolicyRecord = {
        "source": policy.source,
        "digest": policy.digest,
        "calibrated": policy.envelope.calibrated,
        "receipts": settings["receipts"],
        "margins": settings["margins"],
        "envelope": settings["envelope"],
        "gates": settings["gates"],
    }
    if policy.origin:
        record["origin"] = policy.origin
    return record


def run_record(
    *,
    name: str,
    path: str,
    stage: str,
    stage_source: str,
    checkpoints: Sequence[int],
    skipped: Sequence[str],
    events: Sequence[RunEvent],
    abandoned: Sequence[Abandoned] = (),
) -> RunRecord:
    """The audited run; ``abandoned``: :meth:`moeaudit.lineage.Abandoned.to_json` of each branch
    it abandoned (an open record: it carries the steps too)."""
    record: RunRecord = {
        "name": name,
        "path": path,
        "stage": stage,
        "stage_source": stage_source,
        "checkpoints": list(checkpoints),
        "skipped": list(skipped),
        "events": list(events),
    }
    if abandoned:
        record["abandoned"] = [{**a} for a in abandoned]
    return record


def heatmaps(doc: Receipts) -> Heatmaps:
    """Occupancy and per-domain routing of one receipts document (the last checkpoint's)."""
    layers = doc["layers"]
    return {
        "checkpoint": doc["checkpoint"]["name"],
        "occupancy": {"layers": [e["layer"] for e in layers], "pi": [e["occupancy"]["pi"] for e in layers]},
        "domains": {
            "names": layers[0]["domains"]["domains"] if layers else [],
            "layers": {str(e["layer"]): e["domains"]["pi"] for e in layers},
        },
    }


def predicate(
    decision: Decision,
    *,
    run: RunRecord,
    inputs: Inputs,
    canary: CanaryRecord,
    policy: PolicyRecord,
    environment: EnvironmentRecord,
    protected_layers: Sequence[int],
    gates: list[GateEntry],
    envelope: EnvelopeReport | None,
    margins: Margins,
    heatmaps: Heatmaps,
) -> Predicate:
    """The predicate's required fields; the optional ones (precision, router, cache use, the
    checkpoints' files …) are set on the record by the caller where they apply."""
    checks: list[Check] = decision["checks"]
    return {
        "verdict": decision["verdict"],
        "verdict_reason": decision["verdict_reason"],
        "run": run,
        "inputs": inputs,
        "canary": canary,
        "policy": policy,
        "tool": tool_record(),
        "environment": environment,
        "protected_layers": list(protected_layers),
        "gates": gates,
        "checks": checks,
        "envelope": envelope,
        "margins": margins,
        "heatmaps": heatmaps,
        "claims": table4(),
    }


__all__ = ["canary_record", "heatmaps", "policy_record", "predicate", "run_record", "tool_record"]
