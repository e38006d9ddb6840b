"""``moeaudit verify``: a certificate's signature checked (DSSE envelope or Sigstore bundle),
then, when asked, every input it binds rechecked, its signed verdict required to be one of
those named, and what held attested as a signed in-toto Simple Verification Result.

The steps are separate functions because the CLI shows each one's result before the next runs:
the signature is reported valid before a recheck that may fail."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit.commands.common import QUIET, Hooks, check_output, signing_key
from moeaudit.errors import UsageError

if TYPE_CHECKING:
    from moeaudit.attest.recheck import Recheck
    from moeaudit.records import VerifiedStatement


@dataclass(frozen=True)
class Verified:
    """The certificate whose signature held: its statement (with ``_keyid`` and ``_sha256`` of
    the bytes checked), and what the later steps were asked for — a recheck (where the inputs
    are now), the verdicts required, the attestation to write and the key to sign it with."""

    cert: Path
    stmt: VerifiedStatement
    recheck: bool = False
    where: tuple[Path | None, Path | None, Path | None, Path | None] = (None, None, None, None)
    required: tuple[str, ...] = ()
    attest: Path | None = None
    signing_key: Any = None
    force: bool = False


def verify(
    cert: Path,
    *,
    pubkey: Path | None = None,
    recheck: bool = False,
    run_dir: Path | None = None,
    canary_path: Path | None = None,
    policy_path: Path | None = None,
    reference: Path | None = None,
    required: tuple[str, ...] = (),
    attest: Path | None = None,
    key: Path | None = None,
    force: bool = False,
    hooks: Hooks = QUIET,
) -> Verified:
    """Check ``cert``'s signature with ``pubkey`` (default: the user's moeaudit key's .pub);
    the options of the later steps are checked first, and ``attest`` before any work.
    ``run_dir``, ``canary_path``, ``policy_path``, ``reference``: where the bound inputs are
    now, for the recheck (default: where the certificate records them)."""
    from moeaudit.attest.certificate import open_certificate
    from moeaudit.attest.signing import load_public_key

    if not recheck and (run_dir or canary_path or policy_path or reference):
        raise UsageError(
            "--run-dir, --canary, --policy and --reference say where to recheck inputs", hint="add --recheck"
        )
    if (key is not None or force) and attest is None:
        raise UsageError(
            "--key and --force are for the --attest-verification file", hint="add --attest-verification FILE"
        )
    check_output(attest, force)
    key_ = signing_key(key, hooks) if attest is not None else None
    if pubkey is None:
        from moeaudit.attest.signing import default_public_key

        pubkey = default_public_key()  # none yet: the error says how to pass --pubkey
        hooks.note(f"verifying with your key {pubkey} (pass --pubkey KEY.pub to verify another signer's)")
    stmt = open_certificate(cert, load_public_key(pubkey))
    where = (run_dir, canary_path, policy_path, reference)
    return Verified(cert, stmt, recheck, where, required, attest, key_, force)


def recheck_inputs(verified: Verified) -> Recheck:
    """Every bound input's digest recomputed where it is now."""
    from moeaudit.attest.recheck import Overrides, recheck

    return recheck(verified.stmt, Overrides(*verified.where))


def recheck_failure(result: Recheck) -> str:
    """The failure the findings make (empty when every bound input matches)."""
    if not result.findings:
        return ""
    counts = [
        (n, status)
        for status in ("changed", "missing", "added")
        if (n := sum(f.status == status for f in result.findings))
    ]
    (n, status), rest = counts[0], counts[1:]
    noun = "file" if status == "added" else "bound input"  # an added file is not bound by the certificate
    return (
        f"{n} {noun}{'s' if n > 1 else ''} {status}"
        + "".join(f", {m} {s}" for m, s in rest)
        + " since certification (listed above)"
    )


def verdict_failure(verified: Verified) -> str:
    """``--require-verdict``: the failure when the signed verdict is not one of those required."""
    verdict, required = verified.stmt["predicate"]["verdict"], verified.required
    if required and verdict not in required:
        return f"signed verdict {verdict} is not {' or '.join(required)} (--require-verdict)"
    return ""


def attest_verification(verified: Verified) -> list[str]:
    """``--attest-verification``: a signed in-toto Simple Verification Result of what held,
    written whole; its properties are returned."""
    from moeaudit.attest.certificate import now_rfc3339
    from moeaudit.attest.intoto import (
        certified_criteria,
        criteria_preregistered,
        file_subject,
        sign,
        verification_result,
    )
    from moeaudit.jsonio import atomic_write

    stmt, path = verified.stmt, verified.attest
    assert path is not None
    subject = file_subject(verified.cert.name, stmt["_sha256"])  # the bytes whose signature was checked
    checkpoints = [file_subject(s["name"], s["digest"]["sha256"]) for s in stmt["subject"]]
    svr = verification_result(
        subject,
        checkpoints,
        keyid=stmt["_keyid"],
        verdict=stmt["predicate"]["verdict"],
        required=verified.required,
        rechecked=verified.recheck,
        time=now_rfc3339(),
        criteria=certified_criteria(stmt["predicate"]),
        preregistered=criteria_preregistered(stmt["predicate"]),
    )
    atomic_write(path, sign(svr, verified.signing_key), force=verified.force)
    return list(svr["predicate"]["properties"])
