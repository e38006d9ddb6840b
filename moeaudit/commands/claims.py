"""``moeaudit claims add|list|verify``: signed statements in ``claims.jsonl`` beside a model
(:mod:`moeaudit.attest.claims_file`; docs/security.md, "Claims beside the model")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from moeaudit.commands.signer import private_key, public_keys


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


def claim_bundle(source: Path, directory: Path, digest: str, pubkeys: tuple[Path, ...], key: Path | None) -> Any:
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
        for candidate in public_keys(pubkeys):
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
        signer = private_key(key)
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
    from moeaudit.attest.claims_file import append, subject_digest

    digest = subject_digest(directory)
    bundle = claim_bundle(claim, directory, digest, pubkeys, key)
    path, number, added = append(directory, bundle)
    if added:
        click.echo(f"added line {number} to {path} (subject sha256:{digest})")
    else:
        click.echo(f"{path} holds this claim already (line {number}); nothing written")


@claims.command("list", short_help="List the claims (signatures not checked).")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of one line per claim.")
def claims_list(directory: Path, as_json: bool) -> None:
    """List the claims in DIRECTORY/claims.jsonl as they read, signatures NOT checked (use
    `claims verify`).

    \b
    Examples:
      moeaudit claims list sample_checkpoints/healthy/checkpoint-1500
      moeaudit claims list sample_checkpoints/healthy/checkpoint-1500 --json
    """
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
def claims_verify(directory: Path, pubkeys: tuple[Path, ...]) -> None:
    """Verify DIRECTORY/claims.jsonl (exit 0 valid, 1 invalid, 4 input error).

    Each line signed by a given key must verify and name DIRECTORY's root digest; lines by other
    signers (or keyless) are listed as not verified. Exit 1 when a line by a given key does not
    hold, or when no line is signed by a given key.

    \b
    Examples:
      moeaudit claims verify sample_checkpoints/healthy/checkpoint-1500 --pubkey release-key.pub
    """
    from moeaudit.attest.claims_file import failed, verify_claims

    keys = public_keys(pubkeys)
    digest, results = verify_claims(directory, keys)
    click.echo(f"{directory}: sha256:{digest}")
    for r in results:
        click.echo(f"  {r.text()}" + (f" (keyid {r.keyid[:16]}…)" if r.keyid else ""))
    error = failed(results)
    if error is not None:
        error.path = str(directory / "claims.jsonl")
        raise error
