"""``moeaudit claims add|list|verify``: signed statements in ``claims.jsonl`` beside a model
(:mod:`moeaudit.attest.claims_file`; docs/security.md, "Claims beside the model")."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeaudit.commands.common import QUIET, Hooks, signing_key
from moeaudit.errors import PolicyFailed


def public_keys(paths: Sequence[Path], hooks: Hooks = QUIET) -> list[Any]:
    """The public keys named (default: your moeaudit key's ``.pub``)."""
    from moeaudit.attest.signing import default_public_key, load_public_key

    if not paths:
        mine = default_public_key()
        hooks.warn(f"verifying with your key {mine} (pass --pubkey KEY.pub to verify another signer's)")
        paths = [mine]
    return [load_public_key(p) for p in paths]


def _read_json(path: Path) -> Any:
    from moeaudit.errors import InputError
    from moeaudit.jsonio import DuplicateKey, no_duplicate_keys
    from moeaudit.limits import MAX_CERTIFICATE_BYTES, read_regular

    raw = read_regular(path, "claim", MAX_CERTIFICATE_BYTES)
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:
        raise InputError(f"names a key twice ({exc})", path=path) from exc
    except (ValueError, RecursionError) as exc:
        raise InputError(f"not JSON ({exc})", path=path) from exc


def claim_bundle(
    source: Path, directory: Path, digest: str, pubkeys: tuple[Path, ...], key: Path | None, hooks: Hooks = QUIET
) -> Any:
    """The bundle to append for ``source``: a signed certificate (DSSE envelope or Sigstore
    bundle) is verified and kept as its signer signed it; an unsigned in-toto statement is signed
    with ``key``. Either must name ``digest`` among its subjects (an unsigned statement without
    subjects is given the directory as its one subject)."""
    from moeaudit.attest.certificate import canonical_json
    from moeaudit.attest.claims_file import names_digest
    from moeaudit.attest.signing import sign_envelope, to_bundle, verify_signed
    from moeaudit.errors import InputError, PolicyFailed

    doc = _read_json(source)
    if isinstance(doc, dict) and ("mediaType" in doc or "payload" in doc):
        if key is not None:
            raise InputError(
                "the claim is signed already: --key signs only an unsigned statement", path=source, hint="drop --key"
            )
        raw = canonical_json(doc)
        verified, pub = None, None
        failure: Exception | None = None
        for candidate in public_keys(pubkeys, hooks):
            try:
                verified, pub = verify_signed(raw, candidate, source), candidate
                break
            except PolicyFailed as exc:
                failure = exc
        if verified is None or pub is None:
            assert failure is not None
            raise failure
        stmt = json.loads(verified.body)
        bundle = doc if "mediaType" in doc else to_bundle(doc, pub)
    elif isinstance(doc, dict) and doc.get("_type") == "https://in-toto.io/Statement/v1" and "predicate" in doc:
        if pubkeys:
            raise InputError("an unsigned statement is signed with --key, not verified with --pubkey", path=source)
        stmt = dict(doc)
        if not stmt.get("subject"):
            stmt["subject"] = [{"name": directory.name, "digest": {"sha256": digest}}]
        signer = signing_key(key, hooks)
        bundle = to_bundle(sign_envelope(signer, canonical_json(stmt)), signer.public_key())
    else:
        raise InputError(
            "not a claim: neither a signed certificate / Sigstore bundle nor an in-toto Statement v1",
            path=source,
            hint="give certificate.json, certificate.sigstore.json or an unsigned in-toto statement",
        )
    if not names_digest(stmt, digest):
        raise PolicyFailed(
            f"the claim does not name this directory (sha256:{digest[:16]}…) among its subjects",
            path=source,
            hint="the checkpoint's files changed since it was signed, or the claim is about another checkpoint",
        )
    return bundle


@dataclass(frozen=True)
class Added:
    path: Path  # the claims file
    line: int  # the claim's line in it
    added: bool  # False: the file held this claim already (nothing written)
    digest: str  # the directory's root digest


def add(
    directory: Path, claim: Path, pubkeys: tuple[Path, ...] = (), key: Path | None = None, hooks: Hooks = QUIET
) -> Added:
    """Append ``claim`` to ``directory/claims.jsonl``, verified (or signed) first; the whole file
    is written anew and renamed into place, never half a line."""
    from moeaudit.attest.claims_file import append, subject_digest

    digest = subject_digest(directory)
    bundle = claim_bundle(claim, directory, digest, pubkeys, key, hooks)
    path, number, added = append(directory, bundle)
    return Added(path, number, added, digest)


def listing(directory: Path) -> tuple[str, list[dict[str, Any]]]:
    """The directory's root digest and one row per line of its claims file, as the lines read
    (signatures NOT checked)."""
    from moeaudit.attest.claims_file import names_digest, read_claims, subject_digest

    digest = subject_digest(directory)
    _, lines = read_claims(directory, missing_ok=True)
    rows = []
    for line in lines:
        stmt = line.unverified_statement() or {}
        pred: dict[str, Any] = stmt["predicate"] if isinstance(stmt.get("predicate"), dict) else {}
        rows.append(
            {
                "line": line.number,
                "predicate_type": stmt.get("predicateType"),
                "names_this_directory": names_digest(stmt, digest),
                "key_hint": line.hint,
                "issued": pred.get("issuedAt") or pred.get("timeCreated") or pred.get("created_at"),
                "verdict": pred.get("verdict"),
            }
        )
    return digest, rows


def verify(
    directory: Path, pubkeys: tuple[Path, ...] = (), hooks: Hooks = QUIET
) -> tuple[str, list[Any], PolicyFailed | None]:
    """Each line by a given key verified and checked to name the directory's digest: the
    digest, the per-line results and the failure to raise (None: valid)."""
    from moeaudit.attest.claims_file import failed, verify_claims

    digest, results = verify_claims(directory, public_keys(pubkeys, hooks))
    error = failed(results)
    if error is not None:
        error.path = str(directory / "claims.jsonl")
    return digest, results, error
