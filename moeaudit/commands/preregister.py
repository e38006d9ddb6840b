"""``moeaudit preregister``, and what ``certify`` does with a preregistration
(:mod:`moeaudit.attest.preregistration`; docs/security.md, "Preregistered criteria")."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit.commands.common import QUIET, Hooks, check_output, signing_key
from moeaudit.limits import file_sha256

if TYPE_CHECKING:
    from moeaudit.records import PreregistrationStatement


def preregister(
    policy_path: Path,
    canary_path: Path,
    run: str,
    out: Path,
    key: Path | None = None,
    force: bool = False,
    hooks: Hooks = QUIET,
) -> PreregistrationStatement:
    """Sign the criteria a run will be certified under (the policy's and the canary's digests,
    the run's name, the time) and write them to ``out`` whole; the statement is returned."""
    from moeaudit import __version__
    from moeaudit import canary as canary_mod
    from moeaudit.attest.preregistration import sign, statement
    from moeaudit.jsonio import atomic_write
    from moeaudit.policy import load_policy

    check_output(out, force)  # its directory too, before a default key is created
    policy = load_policy(policy_path)
    file = policy.file_input()
    assert file is not None  # parsed from this file just now
    probe = canary_mod.load(canary_path)
    signer = signing_key(key, hooks)
    stmt = statement(
        run=run,
        policy_name=policy_path.name,
        policy_sha256=file["sha256"],
        settings_digest=policy.digest,
        calibrated=policy.envelope.calibrated or policy.gates.calibrated,
        canary_name=canary_path.name,
        canary_digest=probe.digest,
        canary_sha256=file_sha256(canary_path, "canary"),  # the subject names the file: its bytes' digest
        tool_version=__version__,
    )
    atomic_write(out, sign(stmt, signer), force=force)
    return stmt


def load_for_certify(run_dir: Path, given: Path | None, pubkeys: tuple[Path, ...], signing_key: Any) -> Any:
    """The preregistration ``certify`` uses: ``--preregistration FILE``, else
    ``RUN_DIR/preregistration.json`` when present; verified (before any replay) with
    ``--preregistration-pubkey`` keys, else the certifying key's public key. None when absent."""
    import os

    from moeaudit.attest.preregistration import FILE_NAME, open_preregistration
    from moeaudit.attest.signing import load_public_key

    path = given if given is not None else run_dir / FILE_NAME
    if given is None and not os.path.lexists(path):
        return None
    keys = [load_public_key(p) for p in pubkeys] or [signing_key.public_key()]
    return open_preregistration(path, keys)


def attach(audit: Any, found: Any) -> str:
    """Sign ``predicate.preregistration`` into the audit's statement; the line to show."""
    from moeaudit.attest.preregistration import assess, written_at

    pred = audit.statement["predicate"]
    step, ckpt = audit.run.checkpoints[0]
    names = [r["name"] for r in pred["checkpoint_files"][0]["resources"]]
    policy = pred["policy"]
    record = assess(
        found,
        run=pred["run"]["name"],
        settings_digest=policy["digest"],
        canary_digest=pred["canary"]["digest"]["sha256"],
        calibrated=bool(policy.get("calibrated") or (policy.get("gates") or {}).get("calibrated")),
        first_checkpoint=(ckpt.path.name, step, written_at(ckpt.path, names)),
    )
    pred["preregistration"] = record
    return str(record["summary"])
