"""The command line of ``moeaudit claims`` and ``moeaudit preregister``: arguments, printing and
exit codes; the work is :mod:`moeaudit.commands.claims` and :mod:`moeaudit.commands.preregister`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from moeaudit.cli_common import HOOKS, verbose_option


@click.group(short_help="Signed claims beside a model (claims.jsonl).")
def claims() -> None:
    """Signed statements about a checkpoint directory in its claims.jsonl: one Sigstore bundle per
    line, each an in-toto statement whose subject is the directory's OpenSSF model-signing root
    digest (claims.jsonl itself left out).

    \b
    Examples:
      moeaudit claims add sample_checkpoints/healthy/checkpoint-1500 certs/certificate.sigstore.json
      moeaudit claims list sample_checkpoints/healthy/checkpoint-1500
      moeaudit claims verify sample_checkpoints/healthy/checkpoint-1500 --pubkey release-key.pub
    """


@claims.command("add", short_help="Append a verified or newly signed claim.")
@click.argument("directory", type=click.Path(path_type=Path))
@click.argument("claim", type=click.Path(path_type=Path))
@click.option(
    "--pubkey",
    "pubkeys",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Public key a signed CLAIM is verified with before it is added (default: your moeaudit key's .pub).",
)
@click.option(
    "--key",
    type=click.Path(path_type=Path),
    help="Key an unsigned in-toto statement is signed with (default: your moeaudit key).",
)
@verbose_option
def claims_add(directory: Path, claim: Path, pubkeys: tuple[Path, ...], key: Path | None) -> None:
    """Append CLAIM to DIRECTORY/claims.jsonl, verified first (the whole file is written anew and
    renamed into place: never half a line).

    CLAIM is a certificate (certificate.json or certificate.sigstore.json) naming DIRECTORY among
    its subjects, kept as its signer signed it, or an unsigned in-toto statement, signed here.

    \b
    Examples:
      moeaudit claims add sample_checkpoints/healthy/checkpoint-1500 moeaudit-certificates/healthy/certificate.json
      moeaudit claims add sample_checkpoints/healthy/checkpoint-1500 eval.intoto.json --key release-key.pem
    """
    from moeaudit.commands import claims as work

    done = work.add(directory, claim, pubkeys, key, HOOKS)
    if done.added:
        click.echo(f"added line {done.line} to {done.path} (subject sha256:{done.digest})")
    else:
        click.echo(f"{done.path} holds this claim already (line {done.line}); nothing written")


@claims.command("list", short_help="List the claims (signatures not checked).")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of one line per claim.")
@verbose_option
def claims_list(directory: Path, as_json: bool) -> None:
    """List the claims in DIRECTORY/claims.jsonl as they read, signatures NOT checked (use
    `claims verify`).

    \b
    Examples:
      moeaudit claims list sample_checkpoints/healthy/checkpoint-1500
      moeaudit claims list sample_checkpoints/healthy/checkpoint-1500 --json
    """
    from moeaudit.commands import claims as work

    digest, rows = work.listing(directory)
    if as_json:
        click.echo(json.dumps({"subject": {"sha256": digest}, "claims": rows, "verified": False}, indent=2))
        return
    click.echo(f"{directory}: sha256:{digest}, {len(rows)} claim(s), signatures not checked")
    for r in rows:
        about = "this directory" if r["names_this_directory"] else "OTHER bytes"
        extra = f", verdict {r['verdict']}" if r["verdict"] else ""
        click.echo(
            f"  line {r['line']}: {r['predicate_type']} about {about}{extra}; "
            f"key hint {str(r['key_hint'])[:16]}…; issued {r['issued'] or '—'}"
        )


@claims.command("verify", short_help="Verify every claim by the keys given.")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--pubkey",
    "--key",
    "pubkeys",
    multiple=True,
    type=click.Path(path_type=Path),
    help="A signer's public key (repeat for several; default: your moeaudit key's .pub).",
)
@verbose_option
def claims_verify(directory: Path, pubkeys: tuple[Path, ...]) -> None:
    """Verify DIRECTORY/claims.jsonl (exit 0 valid, 1 invalid, 4 input error).

    Each line signed by a given key must verify and name DIRECTORY's root digest; lines by other
    signers (or keyless) are listed as not verified. Exit 1 when a line by a given key does not
    hold, or when no line is signed by a given key.

    \b
    Examples:
      moeaudit claims verify sample_checkpoints/healthy/checkpoint-1500 --pubkey release-key.pub
    """
    from moeaudit.commands import claims as work

    digest, results, error = work.verify(directory, pubkeys, HOOKS)
    click.echo(f"{directory}: sha256:{digest}")
    for r in results:
        click.echo(f"  {r.text()}{r.key_names()}")
    if error is not None:
        raise error


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
@verbose_option
def preregister(policy_path: Path, canary_path: Path, run: str, out: Path, key: Path | None, force: bool) -> None:
    """Sign the criteria a run will be certified under — the policy's and the canary's digests and
    the run's name — with the time of signing, before training starts. certify then signs whether
    they predate the first audited checkpoint.

    \b
    Examples:
      moeaudit preregister --policy sample_checkpoints/policy.toml --canary sample_checkpoints/canary.safetensors --run healthy
      moeaudit preregister --policy sample_checkpoints/policy.toml --canary sample_checkpoints/canary.safetensors --run my-run -o my-run/preregistration.json
    """  # noqa: E501
    from moeaudit.commands.preregister import preregister as sign_criteria

    stmt = sign_criteria(policy_path, canary_path, run, out, key, force, HOOKS)
    pred = stmt["predicate"]
    click.echo(
        f"wrote {out}: run {run}, policy settings sha256:{pred['policy']['settingsDigest'][:16]}…, "
        f"canary sha256:{pred['canary']['digest']['sha256'][:16]}…, signed {pred['createdAt']}"
    )
