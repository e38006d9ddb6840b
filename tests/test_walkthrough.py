"""A new user's walk through the README and ``--help`` on the shipped samples: what each
documented spelling does, exit codes and one-line errors included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from moeaudit.cli import cli

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"
HEALTHY = SAMPLES / "healthy"
needs_samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


@needs_samples
def test_gate_json_dash_is_stdout_as_for_receipts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `--json -` means stdout for receipts, compare and envelope; gate's --json is the same option
    monkeypatch.chdir(tmp_path)
    run = SAMPLES / "healthy"
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}).invoke(
        cli, ["gate", str(run / "checkpoint-250"), str(run / "checkpoint-500"), "--json", "-"]
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)  # stdout is the document alone
    assert doc["schema"] == "moeaudit.gate/v1" and doc["decision"] == "PROMOTE"
    assert doc["candidate"] == "checkpoint-500" and doc["base"] == "checkpoint-250"
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no file named "-"


@needs_samples
def test_preregister_into_a_missing_run_directory_is_refused_before_signing(tmp_path: Path) -> None:
    # the help's example writes my-run/preregistration.json: before training, my-run may not exist yet
    cfg = tmp_path / "cfg"
    result = CliRunner(env={"XDG_CONFIG_HOME": str(cfg)}).invoke(
        cli,
        [
            "preregister",
            "--policy",
            str(SAMPLES / "policy.toml"),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
            "--run",
            "my-run",
            "-o",
            str(tmp_path / "my-run" / "preregistration.json"),
        ],
    )
    assert result.exit_code == 4
    why = "output directory does not exist — create it first or choose another path"
    assert result.stderr == f"moeaudit: error: {tmp_path / 'my-run'}: {why}\n"
    assert not cfg.exists()  # refused before the default signing key is created


def test_verify_without_pubkey_says_how_to_name_another_key(tmp_path: Path) -> None:
    from moeaudit.attest.signing import ensure_key

    cfg = tmp_path / ("config-" * 12)  # a path long enough that the note would wrap at 140 columns
    ensure_key(cfg / "moeaudit" / "signing-key.pem")
    result = CliRunner(env={"XDG_CONFIG_HOME": str(cfg)}).invoke(cli, ["verify", str(tmp_path / "certificate.json")])
    assert result.exit_code == 4
    mine = cfg / "moeaudit" / "signing-key.pem.pub"
    assert result.stderr.splitlines() == [
        f"verifying with your key {mine} (pass --pubkey KEY.pub to verify another signer's)",
        f"moeaudit: error: {tmp_path / 'certificate.json'}: certificate not found",
    ]


def test_notes_on_stderr_are_never_wrapped(tmp_path: Path) -> None:
    # CI logs are grepped line by line: a note is one line however long (as warnings are)
    from moeaudit.cli_common import note
    from moeaudit.report.terminal import err

    line = "policy: " + "/very/long/path" * 20 + " (envelope constants calibrated)"
    with err.capture() as captured:
        note(line)
    assert captured.get() == line + "\n"


def test_calibrate_summary_is_two_unwrapped_lines() -> None:
    from types import SimpleNamespace

    from moeaudit.policy import Policy
    from moeaudit.report.terminal import err, print_calibration

    result = SimpleNamespace(policy=Policy(), envelope_steps=(100, 1500), steps=(250, 1500))
    with err.capture() as captured:
        print_calibration(result, "normalized", "/a/long/path/to/the/policy/that/was/written/" * 3 + "policy.toml")
    lines = captured.get().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("calibrated the envelope on auto (normalized), variance bound not fitted")
    assert lines[1].endswith("policy.toml with how each was fitted)")


def test_a_passing_refinement_does_not_read_refinement_twice() -> None:
    # certify prints "refinement: PASS — <reason>", gate "✓ refinement: <reason>"
    from moeaudit.judge.decide import refinement_check

    margin: Any = {"exact": 0.0996, "ci95": [0.0094, 0.1737], "tau": 0.25}
    check = refinement_check(margin, "post-training", 0.0)
    assert check["status"] == "PASS"
    assert check["reason"] == (
        "refined, not repurposed: the protected layers stayed within the budget τ "
        "(r_ex = +0.0996, 95% interval [+0.0094, +0.1737], τ = 0.25)"
    )
    failed = refinement_check({**margin, "exact": -1.2332, "ci95": [-1.2831, -1.1032]}, "post-training", 0.0)
    assert failed["status"] == "FAIL" and failed["reason"].startswith("repurposing: a protected layer exceeds")


@needs_samples
@pytest.mark.parametrize(
    "argv",
    [
        ["export", "{tmp}/certificate.json", "--framework", "eu-ai-act", "--out", "-"],
        ["calibrate", str(HEALTHY), "--out", "-"],
        ["canary", "build", "--tokens", str(SAMPLES / "canary.jsonl"), "--out", "-"],
        ["preregister", "--policy", str(SAMPLES / "policy.toml"), "--canary", str(SAMPLES / "canary.safetensors")]
        + ["--run", "r", "-o", "-"],
        ["verify", "{tmp}/certificate.json", "--attest-verification", "-"],
        ["gate", str(HEALTHY / "checkpoint-250"), str(HEALTHY / "checkpoint-500"), "--junit", "-"],
        ["gate", str(HEALTHY / "checkpoint-250"), str(HEALTHY / "checkpoint-500"), "--attest-test-result", "-"],
    ],
    ids=["export", "calibrate", "canary-build", "preregister", "verify-attest", "gate-junit", "gate-attest"],
)
def test_dash_is_refused_where_the_output_is_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    # '-' is stdout for --json of receipts, compare, envelope and gate; elsewhere it is no file name
    monkeypatch.chdir(tmp_path)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}
    result = CliRunner(env=env).invoke(cli, [a.format(tmp=tmp_path) for a in argv])
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == (
        "moeaudit: error: -: this output is written to a file, not to stdout — name the file to write"
    )
    assert not (tmp_path / "-").exists()


@needs_samples
@pytest.mark.parametrize(
    "argv, why",
    [
        (["certify", str(HEALTHY), "--out", "-"], "--out is the directory the certificate is written to, not stdout"),
        (["keygen", "--out", "-"], "--out is the private key file (KEY.pub beside it), not stdout"),
    ],
    ids=["certify", "keygen"],
)
def test_dash_is_no_certificate_directory_or_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], why: str
) -> None:
    monkeypatch.chdir(tmp_path)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}
    result = CliRunner(env=env).invoke(cli, argv)
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == f"moeaudit: error: -: {why}"
    assert not list(tmp_path.glob("-*"))


def test_samples_build_does_not_replace_runs_without_force(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the default --out is sample_checkpoints: `samples build --tiny` there would replace the shipped runs
    import moeaudit.samples.build as samples_build

    built: list[Path] = []
    monkeypatch.setattr(samples_build, "build_samples", lambda out, **_k: built.append(Path(out)))
    (tmp_path / "runs" / "healthy").mkdir(parents=True)
    (tmp_path / "runs" / "healthy" / "keep").write_text("shipped\n")
    refused = CliRunner().invoke(cli, ["samples", "build", "--tiny", "--out", str(tmp_path / "runs")])
    assert refused.exit_code == 4 and built == []
    why = "already holds sample runs (healthy) — pass --force to replace them (other files stay)"
    assert refused.stderr == f"moeaudit: error: {tmp_path / 'runs'}: {why}\n"
    assert (tmp_path / "runs" / "healthy" / "keep").read_text() == "shipped\n"
    forced = CliRunner().invoke(cli, ["samples", "build", "--tiny", "--out", str(tmp_path / "runs"), "--force"])
    assert forced.exit_code == 0 and built == [tmp_path / "runs"]
    fresh = CliRunner().invoke(cli, ["samples", "build", "--tiny", "--out", str(tmp_path / "new")])
    assert fresh.exit_code == 0 and built[-1] == tmp_path / "new"


def test_the_readme_commands_table_names_every_option() -> None:
    """Each command's row in README.md's "Commands" table names every option its --help shows,
    but the ones the README states once for all (--force: "an existing output is not overwritten
    without --force"; --nproc: "More than one GPU"; --verbose)."""
    import re

    import click

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    # a row's first cell may show more than one form of a command (`a`<br>`b`): each is a row
    cells = re.findall(r"^\| (`moeaudit .*?`) \| ", readme, re.M)
    rows = [form for cell in cells for form in re.findall(r"`moeaudit ([^`]+)`", cell)]
    missing: dict[str, list[str]] = {}

    def walk(group: click.Group, prefix: str) -> None:
        for name, command in group.commands.items():
            full = f"{prefix} {name}".strip()
            if isinstance(command, click.Group):
                walk(command, full)
                continue
            row = " ".join(r for r in rows if r == full or r.startswith(f"{full} "))
            assert row, f"no README row for {full}"
            named = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", row))
            shared = ("--force", "--nproc", "--verbose", "--help")
            options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
            gaps = [p.opts[-1] for p in options if p.opts[-1] not in shared and not named & set(p.opts)]
            if gaps:
                missing[full] = gaps

    walk(cli, "")
    assert missing == {}


def test_a_held_occupancy_below_the_floor_says_it_is_within_noise() -> None:
    # sft-repurpose at 1000: π_min ratio 0.341 under the 0.5 floor, "held" because the range over
    # both bootstrap intervals reaches above it; without the range the line reads as a contradiction
    from moeaudit.judge.promote import candidate_condition
    from moeaudit.policy import GateSettings

    st: Any = {
        "against": "checkpoint-0",
        "c2_ok": True,
        "c2_min_delta": -0.0434,
        "c2_deltas": {"1": -0.0434},
        "c2_tolerance": {"1": 0.0974},
        "c2_fallen_layers": [],
        "occupancy_ok": True,
        "layers_with_more_dead": [],
        "pi_min_ratio": 0.341,
        "entropy_ratio": 0.950,
        "ratio_ci95": {"pi_min": [0.2093, 0.6204], "entropy": [0.93, 0.97]},
        "below_floor": {},
        "ok": True,
    }
    gate: Any = {"status": "GREEN", "step": 1000, "structural": st, "health": {"problems": [], "failed": []}}
    detail = candidate_condition(gate, GateSettings())["detail"]
    assert "occupancy held (π_min ratio 0.341, range 0.209–0.620 over both bootstrap intervals, floor 0.5;" in detail
    assert "entropy ratio 0.950, range 0.930–0.970, floor 0.9)" in detail


@needs_samples
@pytest.mark.parametrize(
    "text, why",
    [
        ("{\n", "not valid JSON (Expecting property name enclosed in double quotes: line 2 column 1 (char 2))"),
        ("[1, 2]\n", "not a JSON object"),
    ],
)
def test_a_broken_config_json_is_named_once(tmp_path: Path, text: str, why: str) -> None:
    import shutil

    ckpt = tmp_path / "checkpoint-500"
    shutil.copytree(SAMPLES / "healthy" / "checkpoint-500", ckpt)
    (ckpt / "config.json").write_text(text)
    result = CliRunner().invoke(cli, ["inspect", str(ckpt)])
    assert result.exit_code == 4
    assert result.stderr == f"moeaudit: error: {ckpt / 'config.json'}: {why}\n"  # not "config.json: config.json is …"


@needs_samples
@pytest.mark.parametrize(
    "device, why",
    [
        ("mps", "mps is not available on this machine: pass --device cpu, or cuda on a machine with a GPU"),
        ("xpu", "xpu is not available on this machine: pass --device cpu, or cuda on a machine with a GPU"),
        ("meta", "meta tensors hold no data: pass --device cpu, or cuda on a machine with a GPU"),
        ("tpu", "unknown device type 'tpu': pass --device cpu, or cuda on a machine with a GPU"),
    ],
)
def test_an_unusable_device_is_a_usage_error_before_any_work(device: str, why: str) -> None:
    import torch

    if getattr(torch, device, None) is not None and torch.__dict__[device].is_available():
        pytest.skip(f"{device} is available here")
    ckpt = SAMPLES / "healthy" / "checkpoint-500"
    result = CliRunner().invoke(cli, ["receipts", str(ckpt), "--device", device])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.splitlines()[-1] == f"Error: Invalid value for --device: {why}"


def test_gate_output_is_one_line_per_condition_in_a_ci_log() -> None:
    # CI logs are not a terminal: the console is 140 columns, and a wrapped condition splits
    # "τ = 0.25" across lines; each condition stays one line for grep and log viewers
    from moeaudit.report.terminal import out, print_gate

    detail = "refined, not repurposed: the protected layers stayed within the budget τ " + "(r_ex = +0.0996) " * 8
    result: Any = {
        "decision": "PROMOTE",
        "verdict": "PASS",
        "verdict_reason": "every gate BASELINE or GREEN and every evaluated check passes " * 2,
        "candidate": "checkpoint-1000",
        "base": "checkpoint-0",
        "stage": "post-training",
        "stage_source": "the run's events.jsonl",
        "conditions": [{"name": "refinement", "status": "pass", "detail": detail}],
        "notes": ["judged against the run's active baseline at step 250 (as certify would) " * 3],
    }
    with out.capture() as captured:
        print_gate(result)
    lines = captured.get().splitlines()
    assert len(lines) == 3, lines
    assert lines[1] == f"  ✓ refinement: {detail}"


@needs_samples
def test_gate_says_where_it_wrote_its_reports(tmp_path: Path) -> None:
    run = SAMPLES / "healthy"
    junit, doc = tmp_path / "gate.xml", tmp_path / "gate.json"
    argv = ["gate", str(run / "checkpoint-250"), str(run / "checkpoint-500"), "--junit", str(junit), "--json", str(doc)]
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}).invoke(cli, argv)
    assert result.exit_code == 0, result.stderr
    assert f"wrote {junit} (JUnit XML)" in result.stderr.splitlines()
    assert f"wrote {doc} (moeaudit.gate/v1)" in result.stderr.splitlines()


def test_a_wrong_passphrase_or_a_public_key_as_key_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moeaudit.attest.signing import generate_key, load_private_key
    from moeaudit.errors import InputError

    generate_key(tmp_path / "k", passphrase=b"s3cret")
    monkeypatch.setenv("MOEAUDIT_KEY_PASSPHRASE", "wrong")
    with pytest.raises(InputError) as wrong:
        load_private_key(tmp_path / "k")
    why = "the passphrase does not decrypt this private key — check $MOEAUDIT_KEY_PASSPHRASE or the passphrase typed"
    assert wrong.value.diagnostics() == f"{tmp_path / 'k'}: {why}"
    with pytest.raises(InputError) as public:
        load_private_key(tmp_path / "k.pub")
    assert public.value.diagnostics() == (
        f"{tmp_path / 'k.pub'}: a public key, not a private key — pass the private key KEY (KEY.pub is its public half)"
    )


@needs_samples
def test_calibrate_says_why_it_goes_over_the_checkpoints_twice(tmp_path: Path) -> None:
    # under a policy file, calibrate audits the run twice: with that policy, then with the built-in
    # one it must PASS under; the second pass is announced, not a silent repeat of the progress lines
    env = {"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "policy.toml"
    result = CliRunner(env=env).invoke(cli, ["calibrate", str(SAMPLES / "healthy"), "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    second = "checking the run under the built-in policy (calibrate fits only a run it certifies PASS)"
    assert lines.count(second) == 1
    firsts = [i for i, ln in enumerate(lines) if ln.startswith("[1/6] checkpoint-250")]
    assert len(firsts) == 2 and firsts[0] < lines.index(second) < firsts[1]


@needs_samples
@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", str(HEALTHY / "checkpoint-500")],
        ["gate", str(HEALTHY / "checkpoint-250"), str(HEALTHY / "checkpoint-500")],
    ],
    ids=["inspect", "gate"],
)
def test_a_closed_stdout_is_an_operational_error_not_a_verdict(tmp_path: Path, argv: list[str]) -> None:
    # `moeaudit gate A B | head -1`: the reader leaves early. Exit 1 would read as HOLD (and 0 or 3
    # would be lost); it is exit 4, said on stderr
    import os
    import subprocess
    import sys

    env = {**os.environ, "MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(SAMPLES.parent)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeaudit", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child has written anything
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 4, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("moeaudit: error:")]
    assert lines == [
        "moeaudit: error: Broken pipe — the program reading the output closed it early (e.g. `| head`): "
        "the exit code is no verdict; rerun without it"
    ], stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr


@needs_samples
def test_an_envelope_pass_under_the_built_in_rules_does_not_open_with_could_not(tmp_path: Path) -> None:
    # "envelope: PASS — the policy's envelope could not be evaluated (…); built-in rules: …" read as
    # a PASS of nothing; the line now says first what was evaluated
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}
    result = CliRunner(env=env).invoke(cli, ["certify", str(SAMPLES / "sft-refine"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("  envelope: "))
    assert line.startswith(
        "  envelope: PASS — built-in rules (the policy's envelope does not apply here: envelope constants were "
        "calibrated on a pretraining run"
    ), line
    assert "could not be evaluated" not in line


@needs_samples
def test_tf32_off_cuda_says_the_replay_ran_fp32(tmp_path: Path) -> None:
    # the help says "tf32 (CUDA; elsewhere it runs fp32)"; the run itself now says so too
    result = CliRunner().invoke(cli, ["receipts", str(HEALTHY / "checkpoint-500"), "--precision", "tf32"])
    assert result.exit_code == 0, result.stderr
    note = "note: --precision tf32 applies on CUDA only: these replays run in fp32, the reference"
    assert result.stderr.splitlines().count(note) == 1


@needs_samples
def test_a_gate_from_a_checkpoint_to_itself_is_a_usage_error(tmp_path: Path) -> None:
    """A CI job that names one path twice (or a link to it) promoted nothing and read PROMOTE:
    now one line, exit 2, before any replay or output."""
    (tmp_path / "link").symlink_to(HEALTHY / "checkpoint-500")
    for base in (HEALTHY / "checkpoint-500", tmp_path / "link"):
        result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}).invoke(
            cli, ["gate", str(base), str(HEALTHY / "checkpoint-500"), "--json", str(tmp_path / "g.json")]
        )
        assert result.exit_code == 2, result.output + result.stderr
        lines = [x for x in result.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and "the base and the candidate are the same checkpoint" in lines[0], lines
        assert not (tmp_path / "g.json").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["eu.pdf", "eu.docx", "eu.yaml"])
def test_export_refuses_a_suffix_of_a_format_it_does_not_write(tmp_path: Path, name: str) -> None:
    """`--out eu.pdf` wrote Markdown under a name that says PDF: now a usage error before the
    certificate is read; .md, .txt and no suffix still mean Markdown (tests/test_export.py)."""
    from moeaudit.commands.export import SUFFIXES

    result = CliRunner(env={"XDG_CONFIG_HOME": str(tmp_path / "cfg")}).invoke(
        cli, ["export", str(tmp_path / "absent.json"), "--framework", "eu-ai-act", "--out", str(tmp_path / name)]
    )
    assert result.exit_code == 2, result.output + result.stderr
    assert result.stderr.splitlines()[-1].endswith(
        f"--out ends in {Path(name).suffix}, a format export does not write (md, html, json) — name the file "
        ".md, .html or .json, or pass --format"
    )
    assert list(tmp_path.iterdir()) == []
    assert {SUFFIXES[s] for s in ("", ".md", ".txt", ".markdown")} == {"md"} and SUFFIXES[".htm"] == "html"
