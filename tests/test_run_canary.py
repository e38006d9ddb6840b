"""The canary must be the run's canary: certify refuses (exit 4, both digests named) a canary
other than the one the run recorded — in its canary probe's lines, in the callback's copy, or, for
a canary built from text, a checkpoint's tokenizer.json against its tokenizer_sha256 — unless
--accept-canary-mismatch, which signs each mismatch as a finding. ``envelope --source probe``
refuses probe lines of another canary the same way."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from signed import signed_statement

from moeaudit import canary as canary_mod
from moeaudit.canary import Canary, run_mismatches
from moeaudit.cli import cli
from moeaudit.report.export import canary as canary_evidence

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"
pytestmark = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")
VOCAB = 97  # the sample runs' vocabulary


@pytest.fixture(scope="module")
def env(tmp_path_factory, samples_cache) -> dict[str, str]:
    root = tmp_path_factory.mktemp("samples")
    return {"MOEAUDIT_CACHE_DIR": str(samples_cache), "XDG_CONFIG_HOME": str(root / "config")}


@pytest.fixture(scope="module")
def key(tmp_path_factory, env) -> Path:
    path = tmp_path_factory.mktemp("key") / "key"
    assert CliRunner(env=env).invoke(cli, ["keygen", "--out", str(path)]).exit_code == 0
    return path


def _run_canary() -> Canary:
    return canary_mod.load(SAMPLES / "canary.safetensors")


def _other(built_from: dict[str, str] | None = None) -> Canary:
    """Another model's canary: the same shape, every id shifted by one, all inside the vocabulary."""
    mine = _run_canary()
    tokens = ((mine.tokens_array.astype("int64") + 1) % VOCAB).astype("int32")
    return Canary(tokens, mine.domain_ids_array, mine.domains, built_from=built_from)


def _save(canary: Canary, path: Path) -> Path:
    canary_mod.save(canary, path)
    return path


def _one_error_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("moeaudit: error")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_certify_refuses_a_canary_the_run_did_not_record(tmp_path, env, key) -> None:
    other = _save(_other(), tmp_path / "other.safetensors")
    out = tmp_path / "cert"
    result = CliRunner(env=env).invoke(
        cli, ["certify", str(SAMPLES / "healthy"), "--canary", str(other), "--key", str(key), "--out", str(out)]
    )
    assert result.exit_code == 4, result.output + result.stderr
    line = _one_error_line(result.stderr)
    assert _run_canary().digest in line and canary_mod.load(other).digest in line
    assert "canary_probe.jsonl" in line and "--accept-canary-mismatch" in line
    assert not out.exists()  # nothing half-written


def test_an_accepted_mismatch_is_signed_as_a_finding(tmp_path, env, key) -> None:
    """--accept-canary-mismatch: the certificate is written and signs the mismatch; an envelope
    the policy reads from the probe is not judged on another canary's gradients."""
    other = _save(_other(), tmp_path / "other.safetensors")
    policy = tmp_path / "policy.toml"
    policy.write_text((SAMPLES / "policy.toml").read_text().replace('source = "logs"', 'source = "probe"'))
    out = tmp_path / "cert"
    args = ["certify", str(SAMPLES / "healthy"), "--canary", str(other), "--policy", str(policy)]
    result = CliRunner(env=env).invoke(cli, [*args, "--key", str(key), "--out", str(out), "--accept-canary-mismatch"])
    assert result.exit_code == 0, result.output + result.stderr
    stmt = signed_statement(json.loads((out / "certificate.json").read_text()))
    pred = stmt["predicate"]
    assert "NOT the run's canary (recorded otherwise in canary_probe.jsonl" in canary_evidence(stmt).summary
    assert pred["canary"]["digest"]["sha256"] == canary_mod.load(other).digest
    assert pred["canary"]["mismatches"] == [
        {"source": "canary_probe.jsonl", "recorded": _run_canary().digest, "given": canary_mod.load(other).digest}
    ]
    assert pred["envelope"] is None
    envelope = next(c for c in pred["checks"] if c["name"] == "envelope")
    assert "the canary probe logged canary sha256:" + _run_canary().digest[:16] in json.dumps(envelope)
    assert "canary mismatch signed as a finding" in result.stderr


def test_the_run_copy_and_the_tokenizer_are_checked(tmp_path) -> None:
    run = tmp_path / "run"
    ckpt = run / "checkpoint-1"
    ckpt.mkdir(parents=True)
    mine = _run_canary()
    (run / "canary_probe.jsonl").write_text(json.dumps({"step": 1}) + "\n")  # names no canary: no finding
    assert run_mismatches(mine, run, [ckpt]) == []
    _save(_other(), run / "canary.safetensors")  # the callback's copy of another canary
    assert run_mismatches(mine, run, [ckpt]) == [
        {"source": "canary.safetensors", "recorded": _other().digest, "given": mine.digest}
    ]
    (run / "canary.safetensors").unlink()
    (ckpt / "tokenizer.json").write_text('{"model": "shipped"}')
    shipped = hashlib.sha256(b'{"model": "shipped"}').hexdigest()
    built = {"tokenizer_sha256": "a" * 64, "text_sha256": "b" * 64}
    text_canary = _other(built_from=built)
    assert run_mismatches(text_canary, run, [ckpt]) == [
        {"source": "checkpoint-1/tokenizer.json", "recorded": shipped, "given": "a" * 64}
    ]
    same = _other(built_from={**built, "tokenizer_sha256": shipped})
    assert run_mismatches(same, run, [ckpt]) == []
    assert run_mismatches(mine, run, [ckpt]) == []  # a token-window canary records no tokenizer


def test_certify_refuses_a_canary_built_with_another_tokenizer(tmp_path, env, key) -> None:
    run = tmp_path / "healthy"
    shutil.copytree(SAMPLES / "healthy", run)
    (run / "canary_probe.jsonl").unlink()
    (run / "checkpoint-250" / "tokenizer.json").write_text('{"model": "shipped"}')
    built = {"tokenizer_sha256": "c" * 64, "text_sha256": "d" * 64}
    text_canary = _save(_other(built_from=built), tmp_path / "text.safetensors")
    out = tmp_path / "cert"
    result = CliRunner(env=env).invoke(
        cli, ["certify", str(run), "--canary", str(text_canary), "--key", str(key), "--out", str(out)]
    )
    assert result.exit_code == 4, result.output + result.stderr
    line = _one_error_line(result.stderr)
    assert "checkpoint-250/tokenizer.json" in line and "c" * 64 in line
    assert hashlib.sha256(b'{"model": "shipped"}').hexdigest() in line
    assert not out.exists()


@pytest.mark.parametrize("bare", [False, True])
def test_envelope_source_probe_refuses_another_canary(tmp_path, env, bare) -> None:
    other = _save(_other(), tmp_path / "other.safetensors")
    where = SAMPLES / "healthy" / ("canary_probe.jsonl" if bare else "")
    runner = CliRunner(env=env)
    result = runner.invoke(cli, ["envelope", str(where), "--source", "probe", "--canary", str(other)])
    assert result.exit_code == 4, result.output + result.stderr
    line = _one_error_line(result.stderr)
    assert _run_canary().digest in line and canary_mod.load(other).digest in line
    # the run's canary (given, or found above the run): judged as before
    for extra in (["--canary", str(SAMPLES / "canary.safetensors")], []):
        result = runner.invoke(cli, ["envelope", str(where), "--source", "probe", *extra])
        assert result.exit_code in (0, 1), result.output + result.stderr


def test_envelope_source_probe_refuses_two_canaries_in_one_probe(tmp_path, env) -> None:
    run = tmp_path / "healthy"
    shutil.copytree(SAMPLES / "healthy", run)
    lines = [json.loads(x) for x in (run / "canary_probe.jsonl").read_text().splitlines()]
    lines[-1]["canary"] = "0" * 64
    (run / "canary_probe.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner(env=env).invoke(cli, ["envelope", str(run), "--source", "probe"])  # no canary found
    assert result.exit_code == 4, result.output + result.stderr
    line = _one_error_line(result.stderr)
    assert "name 2 canaries" in line and "0" * 64 in line and _run_canary().digest in line


@pytest.mark.parametrize("parse_probe", [False, True], ids=["hashed", "parsed"])
def test_the_probe_canary_is_read_from_the_bytes_whose_digest_is_signed(tmp_path: Path, parse_probe: bool) -> None:
    """The canary the probe's lines name comes from the probe's one hashed read: a probe renamed
    over it afterwards (before the replays) changes neither the finding nor the signed digest."""
    from moeaudit.run import discover

    run_dir = tmp_path / "run"
    shutil.copytree(SAMPLES / "healthy", run_dir)
    probe = run_dir / "canary_probe.jsonl"
    mine, other = _run_canary(), _other()
    lines = [json.loads(x) for x in probe.read_text().splitlines() if x.strip()]
    named = {x.get("canary") for x in lines}
    assert named == {mine.digest}, "the sample's probe names its own canary"
    run = discover(run_dir)
    run.read_logs_once(parse_probe=parse_probe)
    signed = run.inputs["probe"]["sha256"]
    assert signed == hashlib.sha256(probe.read_bytes()).hexdigest()
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("".join(json.dumps({**x, "canary": other.digest}) + "\n" for x in lines))
    swapped.replace(probe)  # another probe, naming another canary, renamed over after the read
    assert run_mismatches(mine, run.path, (), run.probe_canaries) == []  # the bytes signed name mine
    assert run_mismatches(mine, run.path)[0]["recorded"] == other.digest  # a second read would not
    found = run_mismatches(other, run.path, (), run.probe_canaries)
    assert found == [{"source": "canary_probe.jsonl", "recorded": mine.digest, "given": other.digest}]
