"""``moeaudit verify OUT.dsse.json --certificate CERT``: a signed export report checked against
the certificate it was made from and the report file it binds (docs/security.md, "Signed
exports").

``export --sign`` signs an in-toto statement (predicate type
``https://moeaudit.dev/compliance-export/v1``) whose first subject is the certificate file the
report was made from (base name, SHA-256 of its bytes) and, from this version on, whose second
is the report file written beside the signature (``OUT``, SHA-256 of its bytes). This check:

1. verifies the statement's signature (DSSE or Sigstore bundle, as certificates) before parsing;
2. hashes ``CERT``'s bytes and compares them with the first subject's digest;
3. when the statement binds a report, hashes the file of that name in the signature's directory
   and compares it with the second subject's digest.

A failure of any of them is one line naming the file, exit 1. The certificate's own signature is
not checked here (its signer may be another key): ``moeaudit verify CERT`` does that. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeaudit.commands.common import QUIET, Hooks
from moeaudit.errors import InputError, PolicyFailed, UsageError

_UNTRUSTED = "moeaudit never writes one; do not trust this export"


@dataclass(frozen=True)
class ExportCheck:
    """What held: the signer, the framework, the certificate and (when bound) the report file."""

    signed: Path
    keyid: str
    framework: str
    certificate: Path
    certificate_sha256: str
    report: Path | None  # None: a statement from before reports were bound

    def line(self) -> str:
        out = (
            f"valid: {self.signed} signed by keyid {self.keyid}; {self.framework} export of "
            f"{self.certificate} (sha256 {self.certificate_sha256[:16]}…)"
        )
        if self.report is None:
            return (
                out
                + "; it binds no report file (signed before reports were bound): its signed report is the JSON in it"
            )
        return out + f"; report {self.report} unchanged"


def check_export(
    signed: Path,
    certificate: Path,
    *,
    pubkey: Path | None = None,
    hooks: Hooks = QUIET,
    **others: Any,
) -> ExportCheck:
    """``verify SIGNED --certificate CERTIFICATE`` (``others``: verify's other options, which
    are for certificates and refused when given)."""
    from moeaudit.attest.signing import load_public_key

    given = [name for name, value in others.items() if value not in (None, False, ())]
    if given:
        flags = ", ".join("--" + _FLAGS.get(name, name).replace("_", "-") for name in given)
        raise UsageError(
            f"--certificate checks a signed export; {flags} {'is' if len(given) == 1 else 'are'} for certificates",
            hint="drop them, or verify the certificate itself without --certificate",
        )
    if pubkey is None:
        from moeaudit.attest.signing import default_public_key

        pubkey = default_public_key()
        hooks.note(f"verifying with your key {pubkey} (pass --pubkey KEY.pub to verify another signer's)")
    return verify_export(signed, certificate, load_public_key(pubkey))


_FLAGS = {
    "canary_path": "canary",
    "policy_path": "policy",
    "required": "require-verdict",
    "attest": "attest-verification",
}


def verify_export(signed: Path, certificate: Path, public_key: Any) -> ExportCheck:
    """Signature first, then the certificate's digest, then the bound report's."""
    from moeaudit.attest.certificate import STATEMENT_TYPE
    from moeaudit.attest.signing import verify_signed
    from moeaudit.jsonio import DuplicateKey, no_duplicate_keys
    from moeaudit.limits import MAX_CERTIFICATE_BYTES, read_regular
    from moeaudit.report.export import EXPORT_PREDICATE

    verified = verify_signed(read_regular(signed, "signed export", MAX_CERTIFICATE_BYTES), public_key, signed)
    try:
        stmt = json.loads(verified.body.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (DuplicateKey, ValueError, RecursionError) as exc:
        raise InputError(f"signed payload is not strict JSON ({exc})", path=signed, hint=_UNTRUSTED) from exc
    if (
        not isinstance(stmt, dict)
        or stmt.get("_type") != STATEMENT_TYPE
        or stmt.get("predicateType") != EXPORT_PREDICATE
    ):
        kind = stmt.get("predicateType") if isinstance(stmt, dict) else None
        raise InputError(
            f"the signature is valid, but this is not an export report (predicateType {str(kind)[:80]!r})",
            path=signed,
            hint="--certificate is for the OUT.dsse.json `export --sign` writes; verify a certificate without it",
        )
    subjects = _subjects(stmt.get("subject"), signed)
    cert_sha256 = hashlib.sha256(read_regular(certificate, "certificate", MAX_CERTIFICATE_BYTES)).hexdigest()
    name, want = subjects[0]
    if cert_sha256 != want:
        raise PolicyFailed(
            f"digest {cert_sha256[:16]}… is not the certificate the export signs ({name}, {want[:16]}…): "
            "another certificate, or changed since the export",
            path=certificate,
            hint="pass the certificate the report was exported from",
        )
    report = None
    if len(subjects) == 2:
        name, want = subjects[1]
        report = signed.parent / name
        if not os.path.lexists(report):
            raise PolicyFailed(
                f"missing: the export signs this report file ({want[:16]}…), not found beside {signed.name}",
                path=report,
                hint="keep the report next to its signature under the name it was exported as",
            )
        got = hashlib.sha256(read_regular(report, "export report", MAX_CERTIFICATE_BYTES)).hexdigest()
        if got != want:
            raise PolicyFailed(
                f"changed since it was signed: digest now {got[:16]}…, signed {want[:16]}…",
                path=report,
                hint="do not trust this copy of the report; export it again from the certificate",
            )
    predicate = stmt.get("predicate")
    fw = predicate.get("framework") if isinstance(predicate, dict) else None
    framework = str(fw.get("key")) if isinstance(fw, dict) else "?"
    return ExportCheck(signed, verified.keyid, framework, certificate, cert_sha256, report)


def _subjects(subjects: Any, signed: Path) -> list[tuple[str, str]]:
    """(name, sha256) of the certificate and, when bound, the report; names are bare file names."""
    ok = (
        isinstance(subjects, list)
        and len(subjects) in (1, 2)
        and all(
            isinstance(s, dict)
            and isinstance(s.get("name"), str)
            and s["name"] not in ("", ".", "..")
            and "/" not in s["name"]
            and "\\" not in s["name"]
            and isinstance(s.get("digest"), dict)
            and isinstance(s["digest"].get("sha256"), str)
            and re.fullmatch("[0-9a-f]{64}", s["digest"]["sha256"])
            for s in subjects
        )
    )
    if not ok:
        raise InputError(
            "the signed export's subjects are not the certificate and the report (bare names, sha256)",
            path=signed,
            hint=_UNTRUSTED,
        )
    return [(s["name"], s["digest"]["sha256"]) for s in subjects]
