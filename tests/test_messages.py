"""What the tool says when the first hour goes wrong, one test per message:
a file that is not a certificate (exit 4, not 1), `export --out x.html` writing HTML, how to
pass --pubkey before any key exists, a run directory where a checkpoint belongs, a canary's
JSONL source given as the canary, a `step_250/` directory, an abandoned checkpoint after a
resume, and a torchtitan run named after its dump folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from signed import signed_statement

from moeaudit.attest.certificate import canonical_json, sign_statement
from moeaudit.attest.signing import generate_key, sign_envelope
from moeaudit.cli import cli
from moeaudit.lineage import abandoned
from moeaudit.run import Event, Run
from moeaudit.run_names import run_name

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
FIXTURE = Path(__file__).parent / "fixtures" / "statement_example.json"
needs_samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


def invoke(*args: Any, env: dict[str, str] | None = None) -> Any:
    return CliRunner(env=env).invoke(cli, [str(a) for a in args])


@pytest.fixture()
def signed(tmp_path: Path) -> tuple[Path, Path]:
    """(certificate.json, its public key) for the fixture statement."""
    key = generate_key(tmp_path / "key")
    stmt = json.loads(FIXTURE.read_text(encoding="utf-8"))
    cert = tmp_path / "certificate.json"
    cert.write_text(json.dumps(sign_statement(stmt, key)))
    return cert, tmp_path / "key.pub"


# --- verify: not a certificate is an input error ------------------------------------------------


@pytest.mark.parametrize(
    "content, says",
    [
        ("hello\n", "not a certificate (not JSON"),
        ('{"model_type": "mixtral"}', "not a certificate (JSON without a DSSE envelope's fields)"),
        ('{"_type": "https://in-toto.io/Statement/v1", "predicate": {}}', "an unsigned in-toto statement"),
        ("[1, 2, 3]", "not a certificate"),
    ],
)
def test_verify_on_a_file_that_is_not_a_certificate_exits_4(
    tmp_path: Path, signed: tuple[Path, Path], content: str, says: str
) -> None:
    other = tmp_path / "other.json"
    other.write_text(content)
    result = invoke("verify", other, "--pubkey", signed[1])
    assert result.exit_code == 4, result.stderr
    assert says in result.stderr and "certificate.json (a DSSE envelope)" in result.stderr


def test_an_altered_certificate_is_still_invalid_exit_1(tmp_path: Path, signed: tuple[Path, Path]) -> None:
    cert, pub = signed
    env = json.loads(cert.read_text())
    env["extra"] = 1  # a certificate in shape, altered: a signature question, not an input one
    cert.write_text(json.dumps(env))
    result = invoke("verify", cert, "--pubkey", pub)
    assert result.exit_code == 1 and "not a DSSE envelope" in result.stderr
    key = generate_key(tmp_path / "k2")
    env = sign_envelope(key, canonical_json({"a": 1}))
    env["signatures"][0]["sig"] = env["signatures"][0]["sig"][::-1]
    cert.write_text(json.dumps(env))
    assert invoke("verify", cert, "--pubkey", tmp_path / "k2.pub").exit_code == 1


# --- export: the format follows --out ------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fmt_flag, starts",
    [
        ("report.html", [], "<!DOCTYPE html>"),
        ("report.HTM", [], "<!DOCTYPE html>"),
        ("report.json", [], "{"),
        ("report.md", [], "# "),
        ("report.txt", [], "# "),
        ("report.html", ["--format", "md"], "# "),  # an explicit --format wins
    ],
)
def test_export_format_follows_the_out_suffix(
    tmp_path: Path, signed: tuple[Path, Path], name: str, fmt_flag: list[str], starts: str
) -> None:
    cert, pub = signed
    out = tmp_path / name
    result = invoke("export", cert, "--framework", "eu-ai-act", "--out", out, "--pubkey", pub, *fmt_flag)
    assert result.exit_code == 0, result.stderr
    assert out.read_text(encoding="utf-8").lstrip().startswith(starts)


# --- no key yet -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["verify"], ["export", "--framework", "sr-11-7", "--out", "x.md"]])
def test_without_a_key_yet_export_and_verify_say_how_to_pass_pubkey(
    tmp_path: Path, signed: tuple[Path, Path], command: list[str]
) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "fresh-config")}
    args = [command[0], signed[0], *command[1:]]
    if command[0] == "export":
        args[-1] = tmp_path / "x.md"
    result = invoke(*args, env=env)
    assert result.exit_code == 4, result.stderr
    assert "no --pubkey given and you have no moeaudit key yet" in result.stderr
    assert "pass --pubkey KEY.pub, the public key of whoever signed the certificate" in result.stderr
    assert not (tmp_path / "x.md").exists()


# --- a run directory where one checkpoint belongs -------------------------------------------------


def fake_run(root: Path, steps: tuple[int, ...] = (100, 200, 300)) -> Path:
    for s in steps:
        (root / f"checkpoint-{s}").mkdir(parents=True)
    return root


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{run}"],
        ["gate", "{run}", "{run}/checkpoint-300"],
        ["gate", "{run}/checkpoint-100", "{run}"],
        ["receipts", "{run}"],
        ["compare", "{run}", "{run}/checkpoint-300"],
    ],
)
def test_a_run_directory_given_as_a_checkpoint_lists_its_checkpoints(tmp_path: Path, argv: list[str]) -> None:
    run = fake_run(tmp_path / "run")
    result = invoke(*[a.format(run=run) for a in argv])
    assert result.exit_code == 4, result.stderr
    assert (
        "this is a run directory, not a checkpoint; its checkpoints are checkpoint-100, "
        "checkpoint-200, checkpoint-300 (3 checkpoints)"
    ) in result.stderr
    assert f"e.g. moeaudit {argv[0]}" in result.stderr and "checkpoint-300" in result.stderr.split("e.g.")[1]


# --- the canary's JSONL source given as the canary -------------------------------------------------


@needs_samples
def test_canary_jsonl_error_shows_no_header_numbers() -> None:
    result = invoke("receipts", SAMPLES / "healthy" / "checkpoint-250", "--canary", SAMPLES / "canary.jsonl")
    assert result.exit_code == 4
    line = result.stderr.strip().splitlines()[-1]
    assert "a JSONL file of token windows (a canary's source), not a built canary" in line
    assert (
        "header length" not in line
        and "limit" not in line
        and not any(w.isdigit() and len(w) > 6 for w in line.replace("(", " ").split())
    )
    assert "moeaudit canary build --tokens" in line and "--canary canary.safetensors" in line


# --- step_250/ and other near misses ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["step_250", "checkpoint_250", "ckpt-250", "global_step250", "iter_0000250", "Checkpoint-250"]
)
@pytest.mark.parametrize("command", [["certify"], ["calibrate", "--out", "{tmp}/p.toml"], ["envelope"]])
def test_a_misnamed_checkpoint_directory_is_refused_with_the_accepted_names(
    tmp_path: Path, name: str, command: list[str]
) -> None:
    run = fake_run(tmp_path / "run", (100,))
    (run / name).mkdir()
    result = invoke(command[0], run, *[a.format(tmp=tmp_path) for a in command[1:]])
    assert result.exit_code == 4, result.stderr
    assert f"{name}/ looks like a checkpoint but is not named as one" in result.stderr
    assert (
        "checkpoint-<step> (Hugging Face Trainer) or step-<step> (torchtitan)" in result.stderr
        and "rename it checkpoint-250" in result.stderr
    )


def test_other_directories_in_a_run_are_left_alone(tmp_path: Path) -> None:
    from moeaudit.run_names import refuse_misnamed

    run = fake_run(tmp_path / "run", (100,))
    for name in ("runs", "logs", "step_notes", "checkpoint-100-tmp", "tb"):
        (run / name).mkdir()
    (run / "step_250").write_text("a file, not a checkpoint directory")
    refuse_misnamed(run)


# --- an abandoned checkpoint after a resume --------------------------------------------------------


def _run(tmp_path: Path, steps: tuple[int, ...], resumes: tuple[int, ...], logged: tuple[int, ...] | None) -> Run:
    metrics = None
    if logged is not None:
        metrics = tmp_path / "metrics.jsonl"
        metrics.write_text(
            "".join(json.dumps({"step": s, "loss": 1.0, "expert_grad_norms": {"0": [0.1, 0.2]}}) + "\n" for s in logged)
        )
    ckpts = [(s, SimpleNamespace(path=tmp_path / f"checkpoint-{s}")) for s in steps]
    return Run(
        tmp_path,
        ckpts,
        events=[Event(s, "resume", f"from checkpoint-{s}") for s in resumes],  # type: ignore[arg-type]
        metrics=metrics,
    )


def test_abandoned_rule(tmp_path: Path) -> None:
    # the case: saves at 100, 200, 300; resumed at 200 from checkpoint-200, no log
    names = [a.name for a in abandoned(_run(tmp_path, (100, 200, 300), (200,), None))]
    assert names == ["checkpoint-300"]
    # the resumed run's log (rewound to 200 by the hook) ends at 250: checkpoint-300 predates it
    (found,) = abandoned(_run(tmp_path, (100, 200, 300), (200,), tuple(range(10, 251, 10))))
    assert (found.name, found.step, found.resume_step) == ("checkpoint-300", 300, 200)
    assert "the resumed run's log ends at step 250" in found.reason
    # the resumed run got past 300: its checkpoint-300 replaced the old one (sample `resume`)
    assert abandoned(_run(tmp_path, (100, 200, 300), (200,), tuple(range(10, 401, 10)))) == []
    # a save one logging interval after the last logged step is the resumed run's own
    assert abandoned(_run(tmp_path, (100, 200, 300), (200,), tuple(range(10, 291, 10)))) == []
    assert abandoned(_run(tmp_path, (100, 200, 300), (), None)) == []  # no resume, nothing abandoned


@needs_samples
def test_an_abandoned_checkpoint_is_named_in_the_report(tmp_path: Path, samples_cache: Path) -> None:
    run = tmp_path / "resumed"
    for step in (250, 500, 750):
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{step}", run / f"checkpoint-{step}")
    lines = (SAMPLES / "healthy" / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["step"] <= 600))
    (run / "events.jsonl").write_text('{"step": 500, "event": "resume", "note": "from checkpoint-500"}\n')
    env = {"MOEAUDIT_CACHE_DIR": str(samples_cache), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    out = tmp_path / "cert"
    result = invoke(
        "certify",
        run,
        "--out",
        out,
        "--canary",
        SAMPLES / "canary.safetensors",
        "--policy",
        SAMPLES / "policy.toml",
        env=env,
    )
    assert result.exit_code == 0, result.stderr
    assert "warning: checkpoint-750 is abandoned: saved above the resume at step 500" in result.stderr
    assert "abandoned: checkpoint-750 (audited, not the model's history)" in result.stdout
    pred = signed_statement(json.loads((out / "certificate.json").read_text()))["predicate"]
    assert [a["name"] for a in pred["run"]["abandoned"]] == ["checkpoint-750"]
    assert pred["run"]["checkpoints"] == [250, 500, 750]  # still audited: a resume hides nothing
    html = (out / "certificate.html").read_text(encoding="utf-8")
    assert "<strong>Abandoned checkpoints</strong>" in html


# --- torchtitan runs are named after their dump folder ----------------------------------------------


def test_torchtitan_run_name(tmp_path: Path) -> None:
    for dump in ("exp7", "exp8/outputs"):
        (tmp_path / dump / "checkpoint" / "step-10").mkdir(parents=True)
    assert run_name(tmp_path / "exp7" / "checkpoint") == "exp7"
    assert run_name(tmp_path / "exp8" / "outputs" / "checkpoint") == "exp8"  # torchtitan's default dump name
    hf = fake_run(tmp_path / "checkpoint", (100,))  # a Trainer run that is called "checkpoint"
    assert run_name(hf) == "checkpoint"
    named = tmp_path / "healthy"
    (named / "step-250").mkdir(parents=True)
    assert run_name(named) == "healthy"  # a torchtitan folder with its own name keeps it


@needs_samples
def test_two_torchtitan_runs_get_different_default_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """certify's default --out is moeaudit-certificates/<run name>: two torchtitan runs used to
    both be "checkpoint", the second colliding with the first."""
    import moeaudit.output

    chosen: list[Path] = []

    class Stop(Exception):
        pass

    def output_set(out: Path, *_a: Any, **_k: Any) -> None:
        chosen.append(Path(out))
        raise Stop

    monkeypatch.setattr(moeaudit.output, "OutputSet", output_set)
    monkeypatch.chdir(tmp_path)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    for dump in ("exp7/outputs", "exp8/outputs"):
        run = tmp_path / dump / "checkpoint"
        (run / "step-10").mkdir(parents=True)
        result = invoke("certify", run, "--canary", SAMPLES / "canary.safetensors", env=env)
        assert "internal error: Stop" in result.stderr, result.stderr  # stopped at the output, before any replay
    assert chosen == [Path("moeaudit-certificates/exp7"), Path("moeaudit-certificates/exp8")]
