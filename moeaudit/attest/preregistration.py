"""Criteria fixed before the evidence: a signed preregistration of the policy and canary a run
will be certified under, and what ``certify`` signs about it (docs/security.md,
"Preregistered criteria").

``moeaudit preregister`` signs an in-toto Statement v1 (predicate type
``https://moeaudit.dev/preregistration/v1``) whose subjects are the policy file and the canary
file (each the SHA-256 of its bytes), and whose predicate names the run, the policy's settings
digest (what certificates sign as ``predicate.policy.digest``), the canary's content
digest (docs/glossary.md, "Canary": what certify compares) and the time of signing. ``certify``
verifies it, compares it with what it audits under, and signs the outcome as
``predicate.preregistration`` (:func:`assess`):

* ``status``: ``matched`` (the settings digest, the canary digest and the run's name are the
  preregistered ones), ``mismatch`` (``mismatches`` names which differ; signed as a finding, the
  verdict is unchanged) or ``absent``;
* ``ordering``: whether the preregistration was signed ``before`` or ``after`` the first audited
  checkpoint was written, by the preregistration's signed time against the earliest modification
  time of that checkpoint's files (``first_checkpoint.evidence``) — ``unknown`` without both;
* ``calibration``: a policy ``moeaudit calibrate`` fitted is ``preregistered`` only when it is the
  matched policy and ordering is ``before``; ``fitted after the evidence`` when it matched but was
  preregistered after; otherwise ``not shown to predate the evidence``.

Both times are claims, not proofs: the preregistration's time is its signer's clock (no
timestamp authority), a file's modification time is whatever the run directory's owner (or a
copy without ``-p``) left. The record says which evidence was used so a reader can weigh it.

Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal, TypedDict

from moeaudit.attest.certificate import canonical_json
from moeaudit.attest.signing import PrivateKey, PublicKey, SignatureInvalid, sign_envelope, verify_signed
from moeaudit.errors import InputError
from moeaudit.jsonio import DuplicateKey, no_duplicate_keys
from moeaudit.limits import read_regular
from moeaudit.records import (
    FirstCheckpoint,
    InputFile,
    PreregisteredDigests,
    PreregistrationRecord,
    PreregistrationStatement,
)

PREDICATE_TYPE: Literal["https://moeaudit.dev/preregistration/v1"] = "https://moeaudit.dev/preregistration/v1"
STATEMENT_TYPE: Literal["https://in-toto.io/Statement/v1"] = "https://in-toto.io/Statement/v1"
FILE_NAME = "preregistration.json"  # what certify looks for in the run directory
MAX_PREREGISTRATION_BYTES = 1 << 20
TIME_EVIDENCE = "earliest modification time of the checkpoint's files"
NO_TIME_EVIDENCE = "not read: no preregistration to order against"


def statement(
    *,
    run: str,
    policy_name: str,
    policy_sha256: str,
    settings_digest: str,
    calibrated: bool,
    canary_name: str,
    canary_digest: str,
    canary_sha256: str,
    created_at: str | None = None,
    tool_version: str = "",
) -> PreregistrationStatement:
    """The preregistration statement (unsigned). Each subject is named after a file and digests
    that file's bytes (``canary_sha256``); the canary's content digest, which certify compares,
    is the predicate's (``canary_digest``)."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [
            {"name": policy_name, "digest": {"sha256": policy_sha256}},
            {"name": canary_name, "digest": {"sha256": canary_sha256}},
        ],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "run": run,
            "createdAt": created_at or _now_precise(),
            "policy": {
                "file": policy_name,
                "sha256": policy_sha256,
                "settingsDigest": settings_digest,
                "calibrated": calibrated,
            },
            "canary": {"file": canary_name, "digest": {"sha256": canary_digest}},
            "tool": {"name": "moeaudit", "version": tool_version},
        },
    }


def _now_precise() -> str:
    """RFC 3339 UTC with microseconds: a time truncated to the second would read up to a second
    earlier than the signing, in the preregistration's favour."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def sign(stmt: PreregistrationStatement, key: PrivateKey) -> bytes:
    from moeaudit.jsonio import dumps

    return dumps(sign_envelope(key, canonical_json(stmt))).encode("utf-8")


@dataclass(frozen=True)
class Preregistration:
    path: Path
    sha256: str
    size: int
    keyid: str
    predicate: dict[str, Any]


def open_preregistration(path: Path, keys: Sequence[PublicKey]) -> Preregistration:
    """Verify (with any of ``keys``), then parse. A signature that holds under none of them is
    exit 1; a file that is not a preregistration, exit 4."""
    import hashlib

    raw = read_regular(path, "preregistration", MAX_PREREGISTRATION_BYTES)
    failure: SignatureInvalid | None = None
    for key in keys:
        try:
            verified = verify_signed(raw, key, path)
            break
        except SignatureInvalid as exc:
            failure = exc
        except InputError as exc:  # not signed JSON at all: name what was expected here
            exc.what = exc.what.replace("not a certificate", "not a signed preregistration", 1)
            exc.hint = "give the preregistration.json `moeaudit preregister` wrote"
            raise
    else:
        assert failure is not None
        failure.hint = "pass --preregistration-pubkey with the key that signed it (default: the certifying key's)"
        raise failure
    try:
        stmt = json.loads(verified.body.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (DuplicateKey, ValueError, RecursionError) as exc:
        raise InputError(f"signed payload is not strict JSON ({exc})", path=path) from exc
    pred = stmt.get("predicate") if isinstance(stmt, dict) else None
    if (
        not isinstance(stmt, dict)
        or stmt.get("predicateType") != PREDICATE_TYPE
        or not isinstance(pred, dict)
        or not all(isinstance(pred.get(k), str) for k in ("run", "createdAt"))
        or not isinstance(pred.get("policy"), dict)
        or not isinstance(pred.get("canary"), dict)
        or _parse_time(pred["createdAt"]) is None
    ):
        raise InputError(
            f"not a moeaudit preregistration (predicateType {PREDICATE_TYPE} with run, createdAt, policy, canary)",
            path=path,
            hint="write one with `moeaudit preregister --policy P --canary C --run NAME`",
        )
    return Preregistration(path, hashlib.sha256(raw).hexdigest(), len(raw), verified.keyid, pred)


def _parse_time(text: str) -> datetime | None:
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def _rfc3339(ns: int) -> str:
    when = datetime.fromtimestamp(ns // 1000 / 1e6, timezone.utc)
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


def written_at(directory: Path, names: Sequence[str]) -> int | None:
    """The earliest modification time (ns) of the named files of a checkpoint directory."""
    times = []
    for name in names:
        try:
            times.append(os.lstat(directory / name).st_mtime_ns)
        except OSError:
            continue
    return min(times) if times else None


class _Found(TypedDict, total=False):
    """The fields of a :class:`~moeaudit.records.PreregistrationRecord` only a found one has."""

    file: InputFile
    keyid: str
    created_at: str
    run: str
    mismatches: list[Literal["policy", "canary", "run"]]
    preregistered: PreregisteredDigests


def assess(
    found: Preregistration | None,
    *,
    run: str,
    settings_digest: str,
    canary_digest: str,
    calibrated: bool,
    first_checkpoint: tuple[str, int, int | None],
) -> PreregistrationRecord:
    """``predicate.preregistration``: what the found preregistration (or its absence) says of the
    criteria this audit used. ``first_checkpoint``: (name, step, written at in ns or None)."""
    name, step, written_ns = first_checkpoint
    # nothing to order against without one: the files' times are not signed (a copy would change them)
    first: FirstCheckpoint = {
        "name": name,
        "step": step,
        "written_at": _rfc3339(written_ns) if written_ns is not None and found is not None else None,
        "evidence": TIME_EVIDENCE if found is not None else NO_TIME_EVIDENCE,
    }
    found_parts: _Found = {}
    mismatch_parts: _Found = {}
    status: Literal["matched", "mismatch", "absent"] = "absent"
    ordering: Literal["before", "after", "unknown"] = "unknown"
    if found is not None:
        pred = found.predicate
        mismatches: list[Literal["policy", "canary", "run"]] = []
        if pred["policy"].get("settingsDigest") != settings_digest:
            mismatches.append("policy")
        if (pred["canary"].get("digest") or {}).get("sha256") != canary_digest:
            mismatches.append("canary")
        if pred["run"] != run:
            mismatches.append("run")
        created = _parse_time(pred["createdAt"])
        if created is not None and written_ns is not None:  # microseconds, as both are written
            created_us = (created - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1)
            ordering = "before" if created_us < written_ns // 1000 else "after"
        status = "mismatch" if mismatches else "matched"
        found_parts = {
            "file": {"path": found.path.name, "sha256": found.sha256, "bytes": found.size},
            "keyid": found.keyid,
            "created_at": pred["createdAt"],
            "run": pred["run"],
        }
        if mismatches:
            mismatch_parts = {
                "mismatches": mismatches,
                "preregistered": {
                    "settings_digest": str(pred["policy"].get("settingsDigest")),
                    "canary_sha256": str((pred["canary"].get("digest") or {}).get("sha256")),
                },
            }
    out: PreregistrationRecord = {
        "status": status,
        "ordering": ordering,
        **found_parts,
        "first_checkpoint": first,
        **mismatch_parts,
        "calibration": (
            "not calibrated"
            if not calibrated
            else "preregistered"
            if status == "matched" and ordering == "before"
            else "fitted after the evidence"
            if status == "matched" and ordering == "after"
            else "not shown to predate the evidence"
        ),
        "summary": "",
    }
    out["summary"] = summary(out)
    return out


def summary(rec: PreregistrationRecord) -> str:
    """The one line the terminal and the HTML show."""
    first = rec.get("first_checkpoint") or {}
    ckpt = f"{first.get('name')} (files written {first.get('written_at') or 'at an unknown time'})"
    calibration = {
        "not calibrated": "",
        "preregistered": "; the calibrated policy was fixed before the evidence",
        "fitted after the evidence": "; the calibrated policy was fitted after the evidence",
        "not shown to predate the evidence": "; a calibrated policy, not shown to predate the evidence",
    }[rec["calibration"]]
    if rec["status"] == "absent":
        return f"not preregistered (no {FILE_NAME} in the run, none given){calibration}"
    when = rec.get("created_at")
    if rec["status"] == "mismatch":
        return (
            f"preregistration of {when} does NOT match: {', '.join(rec.get('mismatches') or [])} differ(s) from "
            f"what was preregistered{calibration}"
        )
    order = {
        "before": "before the first audited checkpoint",
        "after": "AFTER the first audited checkpoint",
        "unknown": "at a time that cannot be compared with the first audited checkpoint",
    }[rec["ordering"]]
    return f"preregistered {when}, {order} {ckpt}; policy and canary digests match{calibration}"
