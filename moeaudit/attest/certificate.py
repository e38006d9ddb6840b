"""The training-health certificate: an in-toto Statement v1 in a signed DSSE envelope (docs/security.md,
"What the signature binds").

Torch-free. The statement's bytes are canonical JSON (sorted keys, no whitespace, no NaN), so
the same inputs give the same payload except ``predicate.issuedAt``.

Predicate (``https://moeaudit.dev/training-health/v2``), named here as moeaudit uses it; on
the wire every field name is its lowerCamelCase form (``issued_at`` → ``issuedAt``,
:mod:`moeaudit.attest.naming`), and reading a certificate converts back. v1 certificates
(snake_case on the wire) still verify and read::

    verdict            PASS | FAIL | INCONCLUSIVE
    run                {name, stage, checkpoints: [step...], skipped: [...], events: [...]}
    canary             {digest: {sha256}, windows, window_len, domains}
    policy             {source, digest, calibrated, receipts, margins, envelope, gates}
    tool               {name, version};  environment {torch, python, device, dtype}
    protected_layers   [layer...]
    gates[]            {step, status, baseline, scalar, structural?, receipts{...}, claims{licensed, not_licensed}}
    checks[]           {name: envelope|refinement|handoff, evaluated, status, value?, reason}
    envelope           the moeaudit.envelope/v1 summary (series vs Grönwall bound) or null
    margins            {refinement, handoff} of the last gate against its baseline / reference
    heatmaps           {occupancy: {layers, pi[layer][expert]}, domains: {names, layers: {layer: {domain: pi[]}}}}
    claims             the 003 Table 4 rows (receipt, measures, licenses, does_not_license)
    issued_at          RFC 3339 UTC time of signing (the only non-deterministic field)
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

from moeaudit import __version__
from moeaudit.attest.claims import TABLE4
from moeaudit.attest.naming import from_wire, to_wire
from moeaudit.attest.signing import PrivateKey, PublicKey, sign_envelope, verify_signed
from moeaudit.errors import InputError
from moeaudit.jsonio import DuplicateKey, no_duplicate_keys
from moeaudit.limits import MAX_CERTIFICATE_BYTES, read_regular
from moeaudit.records import ClaimRow, Predicate, Statement, Subject, VerifiedStatement

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://moeaudit.dev/training-health/v2"  # lowerCamelCase field names
PREDICATE_TYPE_V1 = "https://moeaudit.dev/training-health/v1"  # snake_case; read, no longer written
_FAMILY = "https://moeaudit.dev/training-health/"  # every version's predicateType starts so
_EXPORT = "https://moeaudit.dev/compliance-export/v1"  # verify --certificate checks one
_OTHER_STATEMENTS = {  # the other statements moeaudit signs, which an auditor may hand to verify
    _EXPORT: "an export report (export --sign)",
    "https://in-toto.io/attestation/svr/v0.2": "a verification result (verify --attest-verification)",
    "https://in-toto.io/attestation/svr/v0.1": "a verification result (verify --attest-verification)",
    "https://in-toto.io/attestation/test-result/v0.1": "a promotion check's result (gate --attest-test-result)",
    "https://moeaudit.dev/preregistration/v1": "a preregistration (moeaudit preregister)",
}
VERDICTS = ("PASS", "FAIL", "INCONCLUSIVE")  # predicate.verdict (README.md, "Schemas")


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def statement(subjects: list[Subject], predicate: Predicate) -> Statement:
    return {"_type": STATEMENT_TYPE, "subject": subjects, "predicateType": PREDICATE_TYPE, "predicate": predicate}


def table4() -> list[ClaimRow]:
    return [
        {"receipt": c.receipt, "measures": c.measures, "licenses": c.licenses, "does_not_license": c.does_not_license}
        for c in TABLE4
    ]


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def sign_statement(stmt: Statement, key: PrivateKey, issued_at: str | None = None) -> dict[str, Any]:
    """The DSSE envelope of ``stmt`` (moeaudit's names) with its predicate in wire names."""
    copy: dict[str, Any] = json.loads(json.dumps(stmt))  # a copy; also proves it is plain JSON
    copy["predicate"]["issued_at"] = issued_at or now_rfc3339()
    if copy.get("predicateType") == PREDICATE_TYPE:
        copy["predicate"] = to_wire(copy["predicate"])
    return sign_envelope(key, canonical_json(copy))


def internal(stmt: dict[str, Any]) -> dict[str, Any]:
    """A signed statement with moeaudit's own field names (a v2 predicate converted back; v1 as
    it is): what the renderers, the export and ``verify`` read."""
    if stmt.get("predicateType") == PREDICATE_TYPE and isinstance(stmt.get("predicate"), dict):
        return {**stmt, "predicate": from_wire(stmt["predicate"])}
    return stmt


def open_certificate(path: Path, public_key: PublicKey) -> VerifiedStatement:
    """Verify the signature of the DSSE envelope or Sigstore bundle (``certificate.json`` or
    ``certificate.sigstore.json``), then (and only then) parse the statement."""
    raw = read_regular(path, "certificate", MAX_CERTIFICATE_BYTES)  # no FIFO, device, or 10 GB
    verified = verify_signed(raw, public_key, path)
    try:
        stmt = json.loads(verified.body.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:  # readers would disagree on which value was signed
        raise InputError(
            f"signed payload names a key twice ({exc})",
            path=path,
            hint="moeaudit never writes one; do not trust this certificate",
        ) from exc
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, huge ints
        raise InputError(f"signed payload is not JSON ({exc})", path=path) from exc
    _check_statement(stmt, path)
    stmt = internal(stmt)
    stmt["_keyid"] = verified.keyid
    stmt["_sha256"] = hashlib.sha256(raw).hexdigest()  # of the file whose signature was checked
    return cast(VerifiedStatement, stmt)  # the fields verify reads checked (_check_statement)


def _check_statement(stmt: Any, path: Path) -> None:
    """The fields ``verify`` reads; a correctly signed but malformed statement is still refused."""

    def fail(what: str) -> InputError:
        return InputError(f"signed payload is not a moeaudit training-health statement ({what})", path=path)

    if not isinstance(stmt, dict):
        raise fail("not a JSON object")
    kind = stmt.get("predicateType")
    if (
        stmt.get("_type") == STATEMENT_TYPE
        and isinstance(kind, str)
        and kind.startswith(_FAMILY)
        and kind not in (PREDICATE_TYPE, PREDICATE_TYPE_V1)
    ):
        raise InputError(
            f"the signature is valid, but its predicateType {kind[:80]!r} is a training-health version "
            f"this moeaudit ({__version__}) does not read (it reads v1 and v2)",
            path=path,
            hint="verify it with the moeaudit version that wrote it, or a newer one",
        )
    if stmt.get("_type") == STATEMENT_TYPE and kind in _OTHER_STATEMENTS:
        raise InputError(
            f"the signature is valid, but this is {_OTHER_STATEMENTS[kind]}, not a training-health certificate",
            path=path,
            hint="check an export with verify FILE --certificate CERT (the certificate it was made from)"
            if kind == _EXPORT
            else "give verify certificate.json or certificate.sigstore.json as certify wrote it",
        )
    if stmt.get("_type") != STATEMENT_TYPE or stmt.get("predicateType") not in (PREDICATE_TYPE, PREDICATE_TYPE_V1):
        raise fail(f"_type {stmt.get('_type')!r}, predicateType {stmt.get('predicateType')!r}")
    predicate = stmt.get("predicate")
    if not isinstance(predicate, dict) or not isinstance(predicate.get("verdict"), str):
        raise fail("no predicate.verdict")
    subjects = stmt.get("subject")
    if not isinstance(subjects, list) or not all(_is_subject(s) for s in subjects):
        raise fail("subject must list {name, digest: {sha256}}")


def _is_subject(subject: Any) -> bool:
    if not isinstance(subject, dict) or not isinstance(subject.get("digest"), dict):
        return False
    return isinstance(subject.get("name"), str) and isinstance(subject["digest"].get("sha256"), str)
