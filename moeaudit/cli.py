"""The command line: parses arguments, prints, exits. What a command does is
``moeaudit.commands`` (one module per command, typed arguments and results); everything else
is library code. Errors become one line and an exit code in one place
(``moeaudit.cli_common.AuditGroup``).

A command here is its options, then a function that calls its use case with them (the option
names are the use case's keyword arguments), prints the result and picks the exit code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from moeaudit import __version__
from moeaudit.cli_common import (
    HOOKS,
    AuditGroup,
    device_errors,
    emit_json,
    nproc_option,
    path_option,
    policy_option,
    precision_option,
    verbose_option,
)
from moeaudit.errors import UsageError
from moeaudit.limits import MAX_WINDOW_TOKENS
from moeaudit.report.terminal import (
    err,
    print_calibration,
    print_canary,
    print_checkpoint,
    print_compare,
    print_envelope,
    print_gate,
    print_gates,
    print_json,
    print_receipts,
)

# Threads that wait at the end of a parallel op sleep at once instead of spinning (libgomp reads
# this when torch loads, so it is set before any command imports torch; a user's own setting
# wins). On a shared machine a spinning thread burns the time slice its partner needs: the
# replay's CPU time grew 2.5× under load with spinning, not at all without (docs/benchmarks.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@click.group(cls=AuditGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moeaudit")
@verbose_option
def cli() -> None:
    """Audit Mixture-of-Experts training runs: receipts, envelopes, signed certificates.

    
    Examples:
      moeaudit certify sample_checkpoints/healthy
      moeaudit verify moeaudit-certificates/healthy/certificate.json
      moeaudit inspect sample_checkpoints/healthy/checkpoint-1500
    """


# ----- inspect ---------------------------------------------------------------------------


@cli.command()
@click.argument("ckpt", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@verbose_option
def inspect(ckpt: Path, as_json: bool) -> None:
    """Describe a checkpoint from its headers (no tensor is loaded).

    
    Examples:
      moeaudit inspect sample_checkpoints/healthy/checkpoint-1500
      moeaudit inspect --json sample_checkpoints/deepseek/checkpoint-250
    """
    from moeaudit.commands.inspect import inspect as describe

    summary = describe(ckpt)
    if as_json:
        print_json(summary)
        return
    print_checkpoint(ckpt, summary)


# ----- canary ----------------------------------------------------------------------------


@cli.group()
def canary() -> None:
    """Build and show canary probe sets.

    
    Examples:
      moeaudit canary show sample_checkpoints/canary.safetensors
      moeaudit canary build --tokens sample_checkpoints/canary.jsonl --out canary.safetensors
    """


@canary.command("build")
@path_option("--tokens", "tokens", help='JSONL, one {"domain": str, "tokens": [int, ...]} per line.')
@path_option("--text", "text", help='JSONL, one {"text": str, "domain": str} per line, tokenized with --tokenizer.')
@path_option("--tokenizer", help="The model's tokenizer.json, for --text (needs the tokenizers package).")
@click.option(
    "--window-len",
    type=click.IntRange(2, MAX_WINDOW_TOKENS),
    default=256,
    show_default=True,
    help="With --text: tokens per window (T).",
)
@click.option(
    "--windows",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="With --text: number of windows (W), shared evenly between the domains.",
)
@path_option("--out", required=True, help="The canary file to write (.safetensors).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@verbose_option
@click.pass_context
def canary_build(
    ctx: click.Context,
    tokens: Path | None,
    text: Path | None,
    tokenizer: Path | None,
    window_len: int,
    windows: int,
    out: Path,
    force: bool,
) -> None:
    """Package token windows or tokenized text into a hashed canary.

    
    Examples:
      moeaudit canary build --tokens sample_checkpoints/canary.jsonl --out canary.safetensors
      moeaudit canary build --text docs.jsonl --tokenizer tokenizer.json --out canary.safetensors
    """
    from moeaudit.commands.canary import build

    if (tokens is None) == (text is None):
        raise UsageError("give exactly one of --tokens FILE.jsonl or --text FILE.jsonl")
    if (text is None) != (tokenizer is None):
        raise UsageError("--tokenizer goes with --text (and --text needs it)")
    defaulted = {
        n: ctx.get_parameter_source(n) == click.core.ParameterSource.DEFAULT for n in ("window_len", "windows")
    }
    if tokens is not None and not all(defaulted.values()):
        raise UsageError("--window-len and --windows apply to --text; --tokens windows are given as is")
    c = build(out, tokens=tokens, text=text, tokenizer=tokenizer, window_len=window_len, windows=windows, force=force)
    click.echo(
        f"wrote {out}: {c.num_windows} windows × {c.window_len} tokens, "
        f"{len(c.domains)} domains, digest sha256:{c.digest}"
    )


@canary.command("show")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a summary.")
@verbose_option
def canary_show(path: Path, as_json: bool) -> None:
    """Show a canary's shape, domains and digest.

    
    Examples:
      moeaudit canary show sample_checkpoints/canary.safetensors
      moeaudit canary show --json sample_checkpoints/canary.safetensors
    """
    from moeaudit.commands.canary import show

    summary = show(path)
    if as_json:
        print_json(summary)
        return
    print_canary(path, summary)


# ----- receipts --------------------------------------------------------------------------


@cli.command(short_help="State receipts of one checkpoint.")
@click.argument("ckpt", type=click.Path(path_type=Path))
@path_option("--canary", "canary_path", help="Canary file (default: canary.safetensors next to or above CKPT).")
@policy_option
@path_option("--json", "json_out", help="Write the moeaudit.receipts/v1 document to this file ('-' for stdout).")
@click.option("--force", is_flag=True, help="Overwrite an existing --json file.")
@click.option("--conflict", is_flag=True, help="Also domain gradient conflict (one extra backward per canary domain).")
@click.option(
    "--generate",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Also generation receipts from N greedy tokens (N extra forwards).",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    metavar="DEVICE",
    help="Compute the replay on this torch device, e.g. cuda or cuda:1 (one layer's "
    "weights at a time); receipts are deterministic per device.",
)
@nproc_option
@precision_option
@verbose_option
def receipts(json_out: Path | None, **options: Any) -> None:
    """State receipts of one checkpoint on the canary (one forward + one backward).

    
    Examples:
      moeaudit receipts sample_checkpoints/healthy/checkpoint-1500
      moeaudit receipts sample_checkpoints/healthy/checkpoint-1500 --conflict --json receipts.json
    """
    from moeaudit.commands.receipts import receipts as state_receipts

    with device_errors():
        doc = state_receipts(json_out=json_out, hooks=HOOKS, **options)
    emit_json(doc, json_out, lambda: print_receipts(doc))


# ----- compare ---------------------------------------------------------------------------


@cli.command(short_help="Drift and margins of CANDIDATE against BASE.")
@click.argument("base", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@path_option("--canary", "canary_path", help="Canary file (default: canary.safetensors next to or above BASE).")
@path_option("--reference", help="Healthy reference checkpoint (or its receipts JSON) for the handoff margin.")
@policy_option
@path_option("--json", "json_out", help="Write the moeaudit.compare/v1 document to this file ('-' for stdout).")
@click.option("--force", is_flag=True, help="Overwrite an existing --json file.")
@nproc_option
@precision_option
@verbose_option
def compare(json_out: Path | None, **options: Any) -> None:
    """Drift of CANDIDATE from BASE on base-anchored states, and the lifecycle margins.

    
    Examples:
      moeaudit compare sample_checkpoints/sft-refine/checkpoint-0 sample_checkpoints/sft-refine/checkpoint-1000
      moeaudit compare sample_checkpoints/healthy/checkpoint-250 sample_checkpoints/healthy/checkpoint-1500 --json -
    """
    from moeaudit.commands.compare import compare as run_compare

    done = run_compare(json_out=json_out, hooks=HOOKS, **options)
    emit_json(done.doc, json_out, lambda: print_compare(done.doc, done.policy))


# ----- envelope and calibration ----------------------------------------------------------


@cli.command(short_help="Gradient Starvation Envelope of a run.")
@click.argument("source_path", metavar="RUN_DIR|metrics.jsonl", type=click.Path(path_type=Path))
@policy_option
@click.option(
    "--source",
    type=click.Choice(["auto", "logs", "replay", "probe"]),
    default=None,
    help="Series from training logs, from replaying every checkpoint, or from the hook's "
    "canary probe at saves (canary_probe.jsonl) (default: the policy's).",
)
@path_option("--canary", "canary_path", help="Canary for --source replay.")
@click.option(
    "--compare",
    is_flag=True,
    help="Also evaluate the other sources and compare logs (and the canary probe, when "
    "logged) with replays window by window (between consecutive checkpoints).",
)
@path_option(
    "--calibrate-on",
    "calibrate_on",
    metavar="HEALTHY_RUN",
    help="Judge each source under constants fitted on this healthy run from the same "
    "source and sampling, instead of the policy's.",
)
@path_option("--json", "json_out", help="Write the moeaudit.envelope/v1 report to this file ('-' for stdout).")
@click.option("--force", is_flag=True, help="Overwrite an existing --json file.")
@click.option("--no-cache", is_flag=True, help="Replay every checkpoint (ignore and do not fill the cache).")
@verbose_option
def envelope(json_out: Path | None, **options: Any) -> None:
    """Gradient Starvation Envelope compliance of a run (exit 0 compliant, 1 not, 3 a gated
    rule could not be evaluated), as certify's envelope check reads it: the variance bound is
    gated only under calibrated constants, else reported.

    
    Examples:
      moeaudit envelope sample_checkpoints/healthy
      moeaudit envelope sample_checkpoints/collapse --source logs
      moeaudit envelope sample_checkpoints/collapse --compare --calibrate-on sample_checkpoints/healthy
    """
    from moeaudit.commands.envelope import envelope as evaluate
    from moeaudit.commands.envelope import exit_code

    report = evaluate(json_out=json_out, hooks=HOOKS, **options)
    emit_json(report, json_out, lambda: print_envelope(report))
    raise SystemExit(exit_code(report))


@cli.command(short_help="Fit the envelope and gate tolerances on a healthy run.")
@click.argument("run_dir", type=click.Path(path_type=Path))
@path_option(
    "--canary",
    "canary_path",
    help="Canary the checkpoints are replayed on to fit the gate tolerances (default: "
    "canary.safetensors in RUN_DIR or up to two levels above).",
)
@path_option("--out", required=True, help="Policy TOML to write.")
@policy_option
@click.option(
    "--source",
    type=click.Choice(["auto", "logs", "replay", "probe"]),
    default="auto",
    show_default=True,
    help="Series to fit on: training logs, checkpoint replays or the canary probe (auto: logs when present).",
)
@click.option(
    "--variant",
    type=click.Choice(["raw", "normalized"]),
    default="normalized",
    show_default=True,
    help="normalized (var_grad/ḡ², scale-free) is the default: the ε = c·Var_t[V] of Gradient "
    "Starvation Envelope (000) Eq. 16 is not scale-free for raw variance (docs/envelope.md).",
)
@click.option(
    "--since",
    type=click.IntRange(min=0),
    default=None,
    help="Ignore samples before this step (warm-up). Default: the learning-rate peak in "
    "the last checkpoint's trainer_state.json, else 0.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --out file.")
@verbose_option
def calibrate(out: Path, variant: str, **options: Any) -> None:
    """Fit every tolerance the verdict uses on a healthy run and write a policy: the envelope
    (Gradient Starvation Envelope (000) Eq. 16) and the gate tolerances (docs/policy.md).

    
    Examples:
      moeaudit calibrate sample_checkpoints/healthy --out policy.toml
      moeaudit calibrate sample_checkpoints/healthy --source replay --out policy.toml
    """
    from moeaudit.commands.calibrate import calibrate as fit_policy

    result = fit_policy(out=out, variant=variant, hooks=HOOKS, **options)
    print_calibration(result, variant, out)
    click.echo(f"wrote {out}")


# ----- certify -----------------------------------------------------------------------------


@cli.command(short_help="Audit a run and write a signed certificate.")
@click.argument("run_dir", type=click.Path(path_type=Path))
@path_option(
    "--canary", "canary_path", help="Canary file (default: canary.safetensors in RUN_DIR or up to two levels above)."
)
@policy_option
@path_option("--reference", help="Healthy reference checkpoint (or its receipts JSON): gates the handoff margin.")
@path_option("--key", help="Signing key (default: your moeaudit key, created on first use).")
@path_option("--out", help="Output directory (default: ./moeaudit-certificates/<run name>).")
@click.option("--force", is_flag=True, help="Replace an existing certificate in --out.")
@click.option("--no-cache", is_flag=True, help="Recompute every receipt (ignore and do not fill the cache).")
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    metavar="DEVICE",
    help="Compute the replays on this torch device, e.g. cuda (see receipts --device).",
)
@click.option(
    "--stage",
    type=click.Choice(["pretraining", "post-training"]),
    default=None,
    help="Training stage (default: events.jsonl's, else the policy's, else pretraining).",
)
@click.option(
    "--fail-on",
    type=click.Choice(["fail", "inconclusive"]),
    default=None,
    help="After writing the certificate, exit 1 on a FAIL verdict; 'inconclusive' also "
    "exits 3 on INCONCLUSIVE (default: exit 0 whatever the verdict).",
)
@click.option(
    "--accept-canary-mismatch",
    is_flag=True,
    help="Certify although the run records another canary (canary_probe.jsonl, its canary.safetensors, "
    "a checkpoint's tokenizer.json); the certificate signs each mismatch as a finding.",
)
@path_option(
    "--preregistration",
    help="Signed preregistration of the policy and canary (default: preregistration.json in RUN_DIR, if any).",
)
@click.option(
    "--preregistration-pubkey",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Public key the preregistration is verified with (default: the signing key's).",
)
@click.option(
    "--ablate",
    type=click.Choice(["low-occupancy", "all"]),
    default=None,
    help="Also the ablation receipt at the last checkpoint: canary NLL change when each expert the occupancy "
    "floors flag (or every routed expert) is removed from routing (extra forwards; reported, not gated).",
)
@nproc_option
@precision_option
@verbose_option
def certify(fail_on: str | None, **options: Any) -> None:
    """Audit a training run and write a signed certificate (exit 0 whenever one was written).

    With --fail-on, a FAIL verdict exits 1 (and, with --fail-on inconclusive, an INCONCLUSIVE one
    exits 3) after the certificate is written.

    
    Examples:
      moeaudit certify sample_checkpoints/healthy
      moeaudit certify sample_checkpoints/collapse --out certs/collapse --fail-on fail
      moeaudit certify sample_checkpoints/sft-refine --stage post-training
    """
    from moeaudit.commands.certify import certify as certify_run
    from moeaudit.commands.certify import fail_on_code

    with device_errors():
        done = certify_run(hooks=HOOKS, **options)
    print_gates(done.audit.statement["predicate"])
    click.echo(f"criteria: {done.criteria}")
    paths = done.paths
    click.echo(
        f"wrote {paths['certificate']}, {paths['bundle']} (Sigstore bundle), {paths['html']} and {paths['receipts']}/"
    )
    verdict = done.audit.verdict
    if code := fail_on_code(verdict, fail_on):
        err.print(
            f"moeaudit: exit {code}: verdict {verdict} (--fail-on {fail_on}); the certificate was written", markup=False
        )
        raise SystemExit(code)


# ----- gate ------------------------------------------------------------------------------


@cli.command(short_help="CI gate: promote (0), hold (1), inconclusive (3).")
@click.argument("base", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@path_option(
    "--canary", "canary_path", help="Canary file (default: canary.safetensors beside BASE or up to two levels above)."
)
@policy_option
@path_option("--reference", help="Healthy reference for the handoff margin.")
@click.option(
    "--stage",
    type=click.Choice(["pretraining", "post-training"]),
    default=None,
    help="Training stage the promotion belongs to (default: the run's events.jsonl, else the "
    "policy's, else pretraining within one run and post-training across runs).",
)
@path_option("--junit", help="Also write a JUnit XML report here.")
@path_option(
    "--json", "json_out", help="Also write the decision, its conditions and the gate as JSON here ('-' for stdout)."
)
@path_option(
    "--attest-test-result",
    "attest",
    help="Also write the decision here as a signed in-toto Test Result "
    "(https://in-toto.io/attestation/test-result/v0.1) over the candidate's root digest.",
)
@path_option("--key", help="Signing key for --attest-test-result (default: your moeaudit key).")
@click.option("--force", is_flag=True, help="Overwrite an existing --junit, --json or --attest-test-result file.")
@nproc_option
@precision_option
@verbose_option
def gate(junit: Path | None, json_out: Path | None, attest: Path | None, force: bool, **options: Any) -> None:
    """CI gate: promote CANDIDATE over BASE (exit 0), hold (1), or inconclusive (3).

    
    Examples:
      moeaudit gate sample_checkpoints/sft-refine/checkpoint-0 sample_checkpoints/sft-refine/checkpoint-1000
      moeaudit gate sample_checkpoints/sft-repurpose/checkpoint-0 sample_checkpoints/sft-repurpose/checkpoint-1000
      moeaudit gate RUN/checkpoint-1000 RUN/checkpoint-1500 --attest-test-result promotion.intoto.json
    """
    from moeaudit.commands.gate import EXIT, gate_json, write_outputs
    from moeaudit.commands.gate import gate as decide

    gated = decide(junit=junit, json_out=json_out, attest=attest, force=force, hooks=HOOKS, **options)
    stdout = str(json_out) == "-"  # as emit_json: the document alone on stdout
    if not stdout:
        print_gate(gated.result)
    write_outputs(
        gated,
        junit=junit,
        json_out=None if stdout else json_out,
        attest=attest,
        step_summary=os.environ.get("GITHUB_STEP_SUMMARY"),
        force=force,
        hooks=HOOKS,
    )
    if stdout:
        click.echo(gate_json(gated.result), nl=False)
    raise SystemExit(EXIT[gated.result["decision"]])


# ----- keys and verification -------------------------------------------------------------


@cli.command()
@path_option("--out", required=True, help="Private key path (KEY.pub is written beside it).")
@click.option(
    "--key-type",
    type=click.Choice(["ecdsa-p256", "ed25519"]),
    default="ecdsa-p256",
    show_default=True,
    help="ECDSA P-256 verifies with cosign and model_signing; Ed25519 does not.",
)
@click.option("--ecdsa", is_flag=True, hidden=True, help="Same as --key-type ecdsa-p256 (the default).")
@click.option("--passphrase-env", is_flag=True, help="Encrypt the key with the passphrase in $MOEAUDIT_KEY_PASSPHRASE.")
@click.option("--force", is_flag=True, help="Replace existing key files.")
@verbose_option
def keygen(out: Path, key_type: str, ecdsa: bool, **options: Any) -> None:
    """Create a signing key pair: KEY (mode 0600) and KEY.pub.

    
    Examples:
      moeaudit keygen --out release-key
      moeaudit keygen --out release-key --key-type ed25519
    """
    from moeaudit.commands.keygen import keygen as generate

    if ecdsa and key_type != "ecdsa-p256":
        raise UsageError("--ecdsa contradicts --key-type ed25519", hint="pass one of them")
    from moeaudit.attest.signing import key_hint, load_public_key

    keyid = generate(out, key_type=key_type, **options)
    hint = key_hint(load_public_key(Path(f"{out}.pub")))
    # the keyid names the key in verify's output, the hint in Sigstore bundles (claims list)
    click.echo(f"wrote {out} (private, 0600) and {out}.pub ({key_type}); keyid {keyid}; key hint {hint}")


def _verdicts(_ctx: click.Context, _param: Any, values: tuple[str, ...]) -> tuple[str, ...]:
    """--require-verdict PASS --require-verdict INCONCLUSIVE, or PASS,INCONCLUSIVE (any case)."""
    from moeaudit.attest.certificate import VERDICTS

    names = tuple(v.strip().upper() for value in values for v in value.split(","))
    wrong = [v for v in names if v not in VERDICTS]
    if wrong:
        raise click.BadParameter(f"{', '.join(map(repr, wrong))}: a verdict is one of {', '.join(VERDICTS)}")
    return names


@cli.command()
@click.argument("cert", type=click.Path(path_type=Path))
@path_option("--pubkey", help="Public key to verify CERT with (default: your moeaudit key's .pub, as export).")
@click.option(
    "--recheck",
    is_flag=True,
    help="Recompute the digest of every input the certificate binds (checkpoints, logs, "
    "canary, policy file, reference) and name each one changed or missing (exit 1).",
)
@path_option("--run-dir", help="Where the certified run is now (default: the path recorded in the certificate).")
@path_option(
    "--canary", "canary_path", help="With --recheck: where the certified canary is now (default: the path recorded)."
)
@path_option(
    "--policy",
    "policy_path",
    help="With --recheck: where the certified policy file is now (default: the path recorded).",
)
@path_option(
    "--reference", help="With --recheck: where the certified reference is now (the certificate records only its name)."
)
@click.option(
    "--require-verdict",
    "required",
    multiple=True,
    metavar="VERDICT",
    callback=_verdicts,
    help="Exit 1 unless the signed verdict is one of these: PASS, FAIL, INCONCLUSIVE "
    "(repeat the option or separate with commas).",
)
@path_option(
    "--attest-verification",
    "attest",
    help="When verification succeeds, also write what was verified here as a signed in-toto "
    "Simple Verification Result (https://in-toto.io/attestation/svr/v0.2).",
)
@path_option("--key", help="Signing key for --attest-verification (default: your moeaudit key).")
@click.option("--force", is_flag=True, help="Overwrite an existing --attest-verification file.")
@path_option("--certificate", help="CERT is an export's OUT.dsse.json: check it binds this certificate and OUT.")
@verbose_option
def verify(cert: Path, certificate: Path | None, **options: Any) -> None:
    """Verify a certificate's signature (exit 0 valid, 1 invalid).

    CERT is certificate.json (DSSE envelope) or certificate.sigstore.json (Sigstore bundle).
    --recheck exits 1 when any bound input changed or is missing since certification;
    --require-verdict exits 1 when the signed verdict is not one of those named.

    
    Examples:
      moeaudit verify moeaudit-certificates/healthy/certificate.json
      moeaudit verify moeaudit-certificates/healthy/certificate.sigstore.json --pubkey release-key.pub --recheck
      moeaudit verify moeaudit-certificates/healthy/certificate.json --attest-verification svr.json
    """
    from moeaudit.commands import verify as steps
    from moeaudit.errors import PolicyFailed

    if certificate is not None:  # a signed export (docs/security.md, "Signed exports")
        from moeaudit.commands.verify_export import check_export

        click.echo(check_export(cert, certificate, hooks=HOOKS, **options).line())
        return
    verified = steps.verify(cert, hooks=HOOKS, **options)
    stmt, pred = verified.stmt, verified.stmt["predicate"]
    click.echo(
        f"valid: {cert} signed by keyid {stmt['_keyid']}; verdict {pred['verdict']}; "
        f"{len(stmt['subject'])} checkpoint(s); issued {pred.get('issued_at', '—')}"
    )
    if isinstance(pred.get("preregistration"), dict):  # certificates before it have none
        click.echo(f"criteria: {pred['preregistration'].get('summary')}")
    problems = []
    if verified.recheck:
        found = steps.recheck_inputs(verified)
        for finding in found.findings:
            click.echo(f"recheck: {finding.line()}")
        if not found.findings:
            others = f", and the {len(found.matched)} other bound input(s): " + "; ".join(found.matched)
            click.echo(f"recheck: all {found.checkpoints} checkpoint digests match" + (others if found.matched else ""))
        problems.append(steps.recheck_failure(found))
    problems.append(steps.verdict_failure(verified))
    if any(problems):
        raise PolicyFailed("; ".join(p for p in problems if p), path=cert)
    if verified.attest is not None and verified.signing_key is not None:
        properties = steps.attest_verification(verified)
        click.echo(f"wrote {verified.attest} (in-toto Simple Verification Result: {', '.join(properties)})")


# ----- export ----------------------------------------------------------------------------


@cli.command(short_help="Map a certificate to a compliance framework.")
@click.argument("cert", type=click.Path(path_type=Path))
@click.option(
    "--framework",
    required=True,
    type=click.Choice(
        [
            "eu-ai-act",
            "eu-ai-act-gpai",
            "eu-ai-act-gpai-authority",
            "eu-ai-act-gpai-downstream",
            "iso-42001",
            "nist-ai-600-1",
            "sr-11-7",
        ]
    ),
    help="Framework to map the certificate's evidence to (eu-ai-act-gpai: the GPAI Code of "
    "Practice's Model Documentation Form; -authority, -downstream: the fields it flags for each "
    "audience; iso-42001: ISO/IEC 42001 Annex A controls).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["md", "html", "json"]),
    default=None,
    help="Report format (default: from --out's suffix: .html, .json, or .md / .txt / none for md).",
)
@path_option("--out", required=True, help="Report file to write.")
@path_option("--pubkey", help="Public key to verify CERT with (default: your moeaudit key's .pub).")
@click.option("--force", is_flag=True, help="Overwrite an existing --out file.")
@click.option(
    "--sign",
    is_flag=True,
    help="Also write OUT.dsse.json: the JSON report as an in-toto statement about the certificate "
    "file's digest and OUT's, signed with your moeaudit key (check it: verify OUT.dsse.json --certificate CERT).",
)
@verbose_option
def export(cert: Path, framework: str, out: Path, **options: Any) -> None:
    """Map a verified certificate's evidence to a compliance framework.

    
    Examples:
      moeaudit export moeaudit-certificates/healthy/certificate.json --framework eu-ai-act --out eu.md
      moeaudit export moeaudit-certificates/healthy/certificate.json --framework sr-11-7 --format html --out sr.html
    """
    from moeaudit.commands.export import export as write_report

    fmt, signed = write_report(cert, framework, out, **options)
    if signed is not None:
        click.echo(f"wrote {signed} (the JSON report, signed)")
    click.echo(f"wrote {out} ({framework}, {fmt}) from verified {cert}")


# ----- samples ---------------------------------------------------------------------------


@cli.group()
def samples() -> None:
    """The sample training runs shipped with moeaudit.

    
    Examples:
      moeaudit samples build --tiny --out /tmp/moeaudit-samples
    """


@samples.command("build")
@click.option(
    "--out",
    default="sample_checkpoints",
    type=click.Path(path_type=Path),
    show_default=True,
    help="Directory to write the sample runs into.",
)
@click.option("--tiny", is_flag=True, help="A scaled-down build (seconds), as the tests use.")
@click.option("--force", is_flag=True, help="Replace sample runs already in --out.")
@verbose_option
def samples_build(out: Path, **options: Any) -> None:
    """Train the sample runs on generated data (deterministic, CPU).

    
    Examples:
      moeaudit samples build --tiny --out /tmp/moeaudit-samples
      moeaudit samples build --out my-samples
    """
    from moeaudit.commands.samples import build

    build(out, hooks=HOOKS, **options)
    click.echo(f"wrote sample runs to {out}")


# ----- claims, preregister (moeaudit/cli_claims.py) ------------------------------------------

from moeaudit.cli_claims import claims as _claims  # noqa: E402
from moeaudit.cli_claims import preregister as _preregister  # noqa: E402

cli.add_command(_claims)
cli.add_command(_preregister)


def _terminate(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (a CI cancel, `kill`) cleans up exactly like Ctrl-C


def main() -> None:
    import signal
    import sys
    from contextlib import nullcontext

    from moeaudit.commands.common import ranks

    torchrun = os.environ.get("WORLD_SIZE", "1") not in ("", "1")
    if torchrun and os.environ.get("RANK", "0") not in ("", "0"):
        from moeaudit.replay import worker  # ranks ≥ 1 of `torchrun ... -m moeaudit CMD` serve rank 0's replays

        worker.main()
    signal.signal(signal.SIGTERM, _terminate)
    try:
        with ranks(None) if torchrun else nullcontext():  # rank 0: whatever the command, it stops the others
            cli(prog_name="moeaudit")
    except SystemExit as exc:
        dist_mod = sys.modules.get("moeaudit.replay.dist")
        if dist_mod is not None and dist_mod.used():  # leave as the ranks do: no C++ static destructors racing gloo
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1)
        raise


if __name__ == "__main__":
    main()
