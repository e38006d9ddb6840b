"""``claims.jsonl`` beside a model: signed statements about a checkpoint directory, one Sigstore
bundle per line (the "unified bundle layout" proposed for OpenSSF model signing,
sigstore/model-transparency #587 and ossf/model-signing-spec #5).

Each line is a Sigstore bundle v0.3 holding a DSSE-signed in-toto Statement v1 one of whose
subjects is the directory's OpenSSF model-signing root digest (:mod:`moeaudit.checkpoint.digest`,
which leaves ``claims.jsonl`` itself out: its claims name that digest). Lines are appended, never
edited: :func:`append` writes the whole file again — the old bytes, unchanged, then the new line —
to a temporary file beside it and renames it into place, under an exclusive lock on the
directory, so a reader sees the file before or after, never half a line.

moeaudit verifies key-based bundles only (:func:`moeaudit.attest.signing.verify_bundle`): a line
signed by a key that was not given, or keyless (a Fulcio certificate and a transparency-log
entry), is reported as not verified here rather than as invalid — the file is shared with other
signers (the model's own OMS signature, SLSA provenance, …).

Torch-free.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moeaudit.attest.certificate import canonical_json
from moeaudit.attest.signing import (
    BUNDLE_MEDIA_TYPES,
    PublicKey,
    SignatureInvalid,
    key_hint,
    legacy_key_hint,
    verify_bundle,
)
from moeaudit.errors import InputError, PolicyFailed
from moeaudit.jsonio import DuplicateKey, atomic_write, no_duplicate_keys
from moeaudit.limits import MAX_CERTIFICATE_BYTES, read_regular

CLAIMS_FILE = "claims.jsonl"
# a line holds one bundle, at most a certificate's (256 MiB, the certificate cap); a file, a few
MAX_CLAIMS_BYTES = 4 * MAX_CERTIFICATE_BYTES


def claims_path(directory: Path) -> Path:
    return directory / CLAIMS_FILE


def subject_digest(directory: Path) -> str:
    """The directory's OpenSSF model-signing root digest, ``claims.jsonl`` left out."""
    from moeaudit.checkpoint.digest import root_digest

    if not directory.is_dir():
        raise InputError("not a model directory", path=directory, hint="give the checkpoint directory")
    # Shared with readers, exclusive with an append: a writer's temporary file lies in the
    # directory until its rename, and a digest taken meanwhile would cover it.
    with _directory_lock(directory, shared=True):
        return root_digest(directory)[0]


@dataclass(frozen=True)
class ClaimLine:
    number: int  # 1-based line number
    raw: bytes  # the line's bytes, without its newline
    bundle: dict[str, Any]

    def unverified_statement(self) -> dict[str, Any] | None:
        """The statement as the line carries it, signature NOT checked (for listing only)."""
        env = self.bundle.get("dsseEnvelope")
        if not isinstance(env, dict):
            return None
        try:
            stmt = json.loads(base64.b64decode(env.get("payload", ""), validate=True))
        except (binascii.Error, ValueError, TypeError, RecursionError):
            return None
        return stmt if isinstance(stmt, dict) else None

    @property
    def hint(self) -> str | None:
        material = self.bundle.get("verificationMaterial")
        pub = material.get("publicKey") if isinstance(material, dict) else None
        hint = pub.get("hint") if isinstance(pub, dict) else None
        return hint if isinstance(hint, str) else None


def read_claims(directory: Path, *, missing_ok: bool = False) -> tuple[bytes, list[ClaimLine]]:
    """(the file's bytes, its lines). Every line must be a JSON object with a Sigstore bundle's
    ``mediaType``; anything else is an input error naming the line (a file moeaudit would not
    append to)."""
    path = claims_path(directory)
    if missing_ok and not os.path.lexists(path):
        return b"", []
    if path.is_symlink():  # the file is the directory's own: a link would let its target decide
        raise InputError("claims.jsonl is a symbolic link", path=path, hint="replace it with the file itself")
    raw = read_regular(path, "claims file", MAX_CLAIMS_BYTES)
    lines: list[ClaimLine] = []
    parts = raw.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()  # the final newline
    for number, line in enumerate(parts, 1):
        try:
            doc = json.loads(line.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except DuplicateKey as exc:
            raise InputError(f"line {number} names a key twice ({exc})", path=path) from exc
        except (ValueError, RecursionError) as exc:
            raise InputError(
                f"line {number} is not JSON ({exc})",
                path=path,
                hint="each line of claims.jsonl is one Sigstore bundle; a line cut short is not a claim",
            ) from exc
        if not isinstance(doc, dict) or doc.get("mediaType") not in BUNDLE_MEDIA_TYPES:
            raise InputError(f"line {number} is not a Sigstore bundle v0.3 (no bundle mediaType)", path=path)
        lines.append(ClaimLine(number, line, doc))
    return raw, lines


def names_digest(stmt: dict[str, Any], digest: str) -> bool:
    subjects = stmt.get("subject")
    return isinstance(subjects, list) and any(
        isinstance(s, dict) and isinstance(s.get("digest"), dict) and s["digest"].get("sha256") == digest
        for s in subjects
    )


def bundle_line(bundle: dict[str, Any]) -> bytes:
    """One line of claims.jsonl: the bundle as compact JSON (a JSON string never holds a raw
    newline, so the line is whole)."""
    return canonical_json(bundle)


@contextmanager
def _directory_lock(directory: Path, *, shared: bool = False) -> Iterator[None]:
    """An exclusive flock on the directory itself: no lock file inside it (the digest would
    cover one), and two appends to the same claims.jsonl take turns; ``shared`` for the root
    digest, which must not see an append's temporary file."""
    import fcntl

    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(directory)) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def append(directory: Path, bundle: dict[str, Any]) -> tuple[Path, int, bool]:
    """Append one bundle to ``directory/claims.jsonl``: (path, its line number, whether it was
    added — False when the same line is already there). The existing lines are checked first
    (moeaudit does not append to a file it cannot read line by line) and kept byte for byte."""
    path = claims_path(directory)
    line = bundle_line(bundle)
    with _directory_lock(directory):
        raw, lines = read_claims(directory, missing_ok=True)
        for old in lines:
            if old.raw == line:
                return path, old.number, False
        if raw and not raw.endswith(b"\n"):
            raw += b"\n"  # a last line written without its newline (JSON Lines allows it)
        atomic_write(path, raw + line + b"\n", force=True)
    return path, len(lines) + 1, True


@dataclass
class LineResult:
    number: int
    status: str  # verified | invalid | other-subject | not-verified
    detail: str
    keyid: str = ""
    statement: dict[str, Any] = field(default_factory=dict)
    hint: str | None = None  # the bundle's key hint, as ``claims list`` shows it

    def text(self) -> str:
        return f"line {self.number}: {self.status}: {self.detail}"

    def key_names(self) -> str:
        """The signer's two names: the keyid (SHA-256 of the DER SubjectPublicKeyInfo, as ``verify``
        and ``keygen`` print it) once the signature held, and the bundle's key hint (SHA-256 of the
        PEM, as ``claims list`` shows it); empty when the line has neither."""
        names = [f"keyid {self.keyid[:16]}…"] if self.keyid else []
        names += [f"key hint {self.hint[:16]}…"] if self.hint else []
        return f" ({'; '.join(names)})" if names else ""


def verify_claims(directory: Path, keys: Sequence[PublicKey]) -> tuple[str, list[LineResult]]:
    """(root digest, one result per line). A line whose key hint names one of ``keys`` (or that
    has no hint) is verified with it: its signature must hold and one of its subjects must be the
    directory's root digest. Lines by other signers are ``not-verified``."""
    digest = subject_digest(directory)
    _, lines = read_claims(directory)
    path = claims_path(directory)
    results: list[LineResult] = []
    for line in lines:
        why = _not_ours(line)
        hint = line.hint
        candidates = [k for k in keys if hint is None or hint in (key_hint(k), legacy_key_hint(k))]
        if why is None and not candidates:
            given = ", ".join(f"{key_hint(k)[:16]}…" for k in keys)
            why = f"signed by key hint {str(hint)[:16]}…, not one of the keys given (key hint {given})"
            results.append(LineResult(line.number, "not-verified", why))  # the signer is named once
            continue
        if why is not None:
            results.append(LineResult(line.number, "not-verified", why, hint=hint))
            continue
        results.append(replace(_verify_line(line, candidates, digest, path), hint=hint))
    return digest, results


def _not_ours(line: ClaimLine) -> str | None:
    """Why moeaudit cannot verify this line at all (another kind of bundle), or None."""
    material = line.bundle.get("verificationMaterial")
    if not isinstance(material, dict) or not isinstance(material.get("publicKey"), dict):
        return (
            "a keyless bundle (a certificate, not a public key), which moeaudit does not verify: use cosign or sigstore"
        )
    stamps = material.get("timestampVerificationData")
    if material.get("tlogEntries") or (isinstance(stamps, dict) and stamps.get("rfc3161Timestamps")):
        return "carries transparency-log entries or timestamps, which moeaudit does not verify: use cosign or sigstore"
    return None


def _verify_line(line: ClaimLine, keys: Sequence[PublicKey], digest: str, path: Path) -> LineResult:
    failure = "does not verify"
    for key in keys:
        try:
            verified = verify_bundle(line.bundle, key, path)
        except SignatureInvalid as exc:
            failure = exc.what
            continue
        try:
            stmt = json.loads(verified.body.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except (ValueError, RecursionError) as exc:  # DuplicateKey is a ValueError
            return LineResult(line.number, "invalid", f"signed payload is not strict JSON ({exc})", verified.keyid)
        if not isinstance(stmt, dict) or stmt.get("_type") != "https://in-toto.io/Statement/v1":
            return LineResult(line.number, "invalid", "signed payload is not an in-toto Statement v1", verified.keyid)
        if not names_digest(stmt, digest):
            named = ", ".join(
                f"{s.get('name')} sha256:{str((s.get('digest') or {}).get('sha256'))[:16]}…"
                for s in stmt.get("subject") or []
                if isinstance(s, dict)
            )
            return LineResult(
                line.number,
                "other-subject",
                f"a valid signature over {named or 'no subject'}, not this directory (sha256:{digest[:16]}…): "
                "the files changed since it was signed, or it is another model's claim",
                verified.keyid,
                stmt,
            )
        return LineResult(line.number, "verified", str(stmt.get("predicateType")), verified.keyid, stmt)
    return LineResult(line.number, "invalid", failure)


def failed(results: Sequence[LineResult]) -> PolicyFailed | None:
    """The exit-1 error for a set of results, or None: a line by a given key that does not
    verify or is about other bytes, or no line verified at all."""
    bad = [r for r in results if r.status in ("invalid", "other-subject")]
    if bad:
        return PolicyFailed(
            f"{len(bad)} claim(s) do not hold for this directory (line {', '.join(str(r.number) for r in bad)})"
        )
    if not any(r.status == "verified" for r in results):
        return PolicyFailed("no claim in the file is signed by a key given", hint="pass the signer's --pubkey")
    return None


__all__ = [
    "CLAIMS_FILE",
    "ClaimLine",
    "LineResult",
    "append",
    "claims_path",
    "failed",
    "read_claims",
    "subject_digest",
    "verify_claims",
]
