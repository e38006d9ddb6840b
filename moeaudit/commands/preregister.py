"""``moeaudit preregister``, and what ``certify`` does with a preregistration
(:mod:`moeaudit.attest.preregistration`; docs/security.md, "Preregistered criteria")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from moeaudit.commands.signer import private_key


@click.command(short_help="Sign the policy and canary before training.")
@click.option("--policy", "policy_path", required=True, type=click.Path(path_type=Path), help="Policy TOML to fix.")
@click.option("--canary", "canary_path", required=True, type=click.Path(path_type=Path), help="Canary file to fix.")
@click.option("--run", "run", required=True, help="The run's name, as certify will name it (its directory's name).")
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=Path),
    default=Path("preregistration.json"),
    show_default=True,
    help="Signed preregistration to write (certify finds preregistration.json in the run directory).",
)
@click.option("--key", type=click.Path(path_type=Path), help="Signing key (default: your moeaudit key).")
@click.option("--force", is_flag=True, help="Overwrite an existing --out file.")
def preregister(policy_path: Path, canary_path: Path, run: str, out: Path, key: Path | None, force: bool) -> None:
    """Sign the criteria a run will be certified under — the policy's and the canary's digests and
    the run's name — with the time of signing, before training starts. certify then signs whether
    they predate the first audited checkpoint.

    \b
    Examples:
      moeaudit preregister --policy sample_checkpoints/policy.toml --canary sample_checkpoints/canary.safetensors --run healthy
      moeaudit preregister --policy sample_checkpoints/policy.toml --canary sample_checkpoints/canary.safetensors --run my-run -o my-run/preregistration.json
    """  # noqa: E501
    from moeaudit import __version__
    from moeaudit import canary as canary_mod
    from moeaudit.attest.preregistration import sign, statement
    from moeaudit.jsonio import atomic_write, check_output_target
    from moeaudit.policy import load_policy

    check_output_target(out, force=force)
    policy = load_policy(policy_path)
    file = policy.file_input()
    assert file is not None  # parsed from this file just now
    probe = canary_mod.load(canary_path)
    signer = private_key(key)
    stmt = statement(
        run=run,
        policy_name=policy_path.name,
        policy_sha256=file["sha256"],
        settings_digest=policy.digest,
        calibrated=policy.envelope.calibrated or policy.gates.calibrated,
        canary_name=canary_path.name,
        canary_digest=probe.digest,
        tool_version=__version__,
    )
    atomic_write(out, sign(stmt, signer), force=force)
    pred = stmt["predicate"]
    click.echo(
        f"wrote {out}: run {run}, policy settings sha256:{policy.digest[:16]}…, canary sha256:{probe.digest[:16]}…, "
        f"signed {pred['createdAt']}"
    )


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
