"""Strict and bounded everywhere (docs/security.md, "Resource caps"): events.jsonl read strictly; a FIFO in the cache
never hangs certify; --out inside an audited checkpoint or run refused before anything is written;
non-finite learning rates in trainer_state.json are findings; a Sigstore bundle with evidence we
do not verify is refused; a SIGKILLed run's leftovers are removed and named; one-line errors stay
short and a full disk names --out."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import moeaudit.jsonio
from moeaudit.cli import cli
from moeaudit.errors import MAX_LINE_CHARS, InputError
from moeaudit.output import OutputSet, refuse_inside
from moeaudit.run import audited_paths, read_events

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
needs_samples = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")
HANG = 60  # seconds: what "never hangs" is held to (the runs below take a few seconds)


def _run(tmp: Path, steps: tuple[int, ...] = (1250, 1500)) -> Path:
    run = tmp / "run"
    run.mkdir()
    for s in steps:
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{s}", run / f"checkpoint-{s}")
    shutil.copy(SAMPLES / "healthy" / "metrics.jsonl", run / "metrics.jsonl")
    return run


def _env(tmp: Path, cache: Path) -> dict[str, str]:
    return {"MOEAUDIT_CACHE_DIR": str(cache), "XDG_CONFIG_HOME": str(tmp / "cfg")}


def _certify_args(run: Path, out: Path, *extra: str) -> list[str]:
    return [
        "certify",
        str(run),
        "--out",
        str(out),
        "--canary",
        str(SAMPLES / "canary.safetensors"),
        "--policy",
        str(SAMPLES / "policy.toml"),
        *extra,
    ]


def _certify_process(tmp: Path, cache: Path, run: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """certify in its own process, killed if it runs past HANG (a hang fails, never blocks)."""
    return subprocess.run(
        [sys.executable, "-m", "moeaudit", *_certify_args(run, out)],
        env={**os.environ, **_env(tmp, cache)},
        capture_output=True,
        text=True,
        timeout=HANG,
        cwd=tmp,
    )


def _error_line(stderr: str) -> str:
    (line,) = [x for x in stderr.splitlines() if x.startswith("moeaudit: error:")]
    return line


# --- events.jsonl ------------------------------------------------------------------------------

GOOD = '{"step": 0, "event": "resume", "note": "restarted"}\n'


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (
            '{"step": 0, "event": "regime_change", "stage": "pretraining", "stage": "post-training"}',
            "key 'stage' appears twice",
        ),
        ('{"step": 0, "event": "resume", "event": "regime_change"}', "key 'event' appears twice"),
        ('{"step": 0, "event": "resume", "note": NaN}', "NaN is not a JSON value"),
        ('{"step": Infinity, "event": "resume"}', "Infinity is not a JSON value"),
        ('{"step": 0, "event": "resume", "note": -Infinity}', "-Infinity is not a JSON value"),
        ('{"step": 0, "event": "resume", "note": 1e999}', "overflows"),
        ('{"step": 0, "event": "resume", "stgae": "post-training"}', "unknown key(s) 'stgae'"),
        ('{"step": 0, "event": "resume", "note": {"why": "x"}}', "'note' must be a string"),
        ('{"stage": "post-training", "step": 3}', "a stage line holds only 'stage'"),
    ],
)
def test_events_refused_naming_file_and_line(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(GOOD + line + "\n")
    with pytest.raises(InputError) as info:
        read_events(path)
    message = info.value.diagnostics()
    assert message.startswith(f"{path}:2: ") and why in message, message
    assert info.value.exit_code == 4 and "\n" not in message


def test_the_stage_is_the_latest_by_step_and_a_conflict_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        '{"step": 500, "event": "regime_change", "stage": "post-training"}\n'
        '{"step": 0, "event": "regime_change", "stage": "pretraining"}\n'
    )
    assert read_events(path)[1] == "post-training"  # not whichever line came last
    path.write_text('{"stage": "pretraining"}\n{"step": 10, "event": "regime_change", "stage": "post-training"}\n')
    assert read_events(path)[1] == "post-training"  # a stage line: the stage from the start
    path.write_text(
        '{"step": 5, "event": "regime_change", "stage": "post-training"}\n'
        '{"step": 5, "event": "resume", "stage": "pretraining"}\n'
    )
    with pytest.raises(
        InputError, match="for step 5 is stated as 'post-training' at line 1 and as 'pretraining' at line 2"
    ):
        read_events(path)
    path.write_text('{"stage": "post-training"}\n{"stage": "pretraining"}\n')
    with pytest.raises(InputError, match="from the start is stated"):
        read_events(path)


@needs_samples
def test_a_duplicate_stage_fails_the_command_with_one_line(tmp_path: Path) -> None:
    run = _run(tmp_path)
    (run / "events.jsonl").write_text(
        GOOD + '{"step": 0, "event": "regime_change", "stage": "post-training", "stage": "pretraining"}\n'
    )
    result = CliRunner().invoke(cli, ["envelope", str(run), "--source", "logs"])
    assert result.exit_code == 4
    assert _error_line(result.stderr).startswith(f"moeaudit: error: {run / 'events.jsonl'}:2: key 'stage'")


# --- a FIFO in the cache ---------------------------------------------------------------------------


def test_a_fifo_as_the_cache_key_does_not_block(tmp_path: Path) -> None:
    from moeaudit.cache import SECRET_NAME, ReceiptsCache

    os.mkfifo(tmp_path / SECRET_NAME, 0o600)
    code = (
        "from pathlib import Path; from moeaudit.cache import ReceiptsCache; "
        f"c = ReceiptsCache(Path({str(tmp_path)!r})); print(c.get('0' * 64), c.problem)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("None receipts cache not used:") and "named pipe (FIFO)" in done.stdout
    cache = ReceiptsCache(tmp_path)  # and in this process too, now that it is known not to hang
    assert cache.get("0" * 64) is None and "named pipe" in str(cache.problem)


def test_a_fifo_as_a_cache_entry_is_a_named_miss(tmp_path: Path) -> None:
    from moeaudit.cache import ReceiptsCache

    said: list[str] = []
    cache = ReceiptsCache(tmp_path / "c", warn=said.append)
    key = cache.key("receipts", "x")
    entry = cache._path(key)
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    assert cache.get(key) is None and cache.misses == 1
    cache.put(key, {"a": 1})  # a name atomic_write will not replace: a slower next run, no error
    assert said == [
        f"warning: receipts cache entry {entry} is a named pipe (FIFO), not a regular file: "
        "ignored, recomputed (delete it)"
    ]


@needs_samples
def test_certify_with_fifos_in_its_cache_finishes(tmp_path: Path) -> None:
    run, cache = _run(tmp_path), tmp_path / "cache"
    assert _certify_process(tmp_path, cache, run, tmp_path / "out1").returncode == 0
    entries = sorted(p for p in cache.rglob("*") if p.suffix in (".json", ".safetensors", ".bin"))
    assert entries
    for p in entries:  # every entry becomes a FIFO nobody writes to
        p.unlink()
        os.mkfifo(p)
    done = _certify_process(tmp_path, cache, run, tmp_path / "out2")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out2" / "certificate.json").is_file()
    assert "is a named pipe (FIFO), not a regular file: ignored" in done.stderr
    (cache / "hmac.key").unlink()
    os.mkfifo(cache / "hmac.key", 0o600)
    done = _certify_process(tmp_path, cache, run, tmp_path / "out3")
    assert done.returncode == 0, done.stderr
    assert "receipts cache not used" in done.stderr and "hmac.key is a named pipe" in done.stderr


# --- --out inside what is audited ----------------------------------------------------------------


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@needs_samples
@pytest.mark.parametrize("where", ["checkpoint-1500/cert", "checkpoint-1500", "certs", "."])
def test_certify_refuses_out_inside_the_run_before_writing(tmp_path: Path, where: str) -> None:
    run = _run(tmp_path)
    before = _listing(run)
    out = run / where
    result = CliRunner(env=_env(tmp_path, tmp_path / "cache")).invoke(cli, _certify_args(run, out))
    assert result.exit_code == 4, result.output
    assert "--out is inside" in _error_line(result.stderr) and "which this command audits" in result.stderr
    assert _listing(run) == before  # no lock, no staging directory, no certificate
    assert not (tmp_path / "cache").exists()  # refused before the replay


@needs_samples
def test_certify_refuses_the_default_out_inside_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path)
    before = _listing(run)
    monkeypatch.chdir(run)  # ./moeaudit-certificates/run would land inside the run
    result = CliRunner(env=_env(tmp_path, tmp_path / "cache")).invoke(
        cli, _certify_args(run, run)[:2] + _certify_args(run, run)[4:]
    )
    assert result.exit_code == 4 and "the default --out is inside" in result.stderr, result.output
    assert _listing(run) == before


@needs_samples
def test_certify_refuses_out_inside_a_linked_checkpoint(tmp_path: Path) -> None:
    run = _run(tmp_path)
    elsewhere = tmp_path / "store" / "ckpt"
    elsewhere.parent.mkdir()
    (run / "checkpoint-1500").rename(elsewhere)
    (run / "checkpoint-1500").symlink_to(elsewhere)
    result = CliRunner(env=_env(tmp_path, tmp_path / "cache")).invoke(cli, _certify_args(run, elsewhere / "cert"))
    assert result.exit_code == 4 and "--out is inside" in result.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(
        p.name for p in (SAMPLES / "healthy" / "checkpoint-1500").iterdir()
    )


@needs_samples
@pytest.mark.parametrize(
    "command",
    [
        ["receipts", "{c}", "--json", "{c}/r.json"],
        ["compare", "{b}", "{c}", "--json", "{b}/sub/c.json"],
        ["gate", "{b}", "{c}", "--json", "{c}/g.json"],
        ["gate", "{b}", "{c}", "--junit", "{b}/g.xml"],
        ["envelope", "{run}", "--json", "{c}/e.json"],
        ["envelope", "{run}", "--json", "{run}/metrics.jsonl", "--force"],
        ["calibrate", "{run}", "--out", "{c}/policy.toml"],
    ],
)
def test_other_outputs_inside_an_audited_checkpoint_are_refused(tmp_path: Path, command: list[str]) -> None:
    run = _run(tmp_path)
    names = {"run": str(run), "b": str(run / "checkpoint-1250"), "c": str(run / "checkpoint-1500")}
    before = _listing(run)
    result = CliRunner(env=_env(tmp_path, tmp_path / "cache")).invoke(cli, [a.format(**names) for a in command])
    assert result.exit_code == 4, result.output
    assert "is inside" in _error_line(result.stderr) and "which this command audits" in result.stderr
    assert _listing(run) == before


@needs_samples
def test_outputs_beside_the_audited_files_stay_allowed(tmp_path: Path) -> None:
    run = _run(tmp_path)
    refuse_inside(run / "policy.toml", audited_paths(run), "--out")  # calibrate's usual place
    refuse_inside(tmp_path / "gate.json", audited_paths(run / "checkpoint-1250", run / "checkpoint-1500"))
    refuse_inside("-", audited_paths(run, whole_run=True))
    with pytest.raises(InputError):
        refuse_inside(run / "x", audited_paths(run, whole_run=True))


# --- trainer_state.json ----------------------------------------------------------------------------


@dataclass
class _Ckpt:
    path: Path


@dataclass
class _Run:
    checkpoints: list[tuple[int, _Ckpt]]


def _state(ckpt: Path, history: str) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "trainer_state.json").write_text('{"global_step": 400, "log_history": [' + history + "]}")


def test_nonfinite_learning_rates_are_findings_not_the_peak(tmp_path: Path) -> None:
    from moeaudit.series import infer_warmup

    ckpt = tmp_path / "checkpoint-400"
    _state(
        ckpt,
        '{"step": 100, "learning_rate": 0.5}, {"step": 200, "learning_rate": 1.0},'
        '{"step": 300, "learning_rate": Infinity}, {"step": 350, "learning_rate": NaN},'
        '{"step": 360, "learning_rate": 1e999}, {"step": "x", "learning_rate": 9.0},'
        '{"step": 370, "learning_rate": true}, {"step": 400, "learning_rate": 0.8},'
        '{"step": 400, "eval_loss": 1.2}',
    )
    warmup = infer_warmup(_Run([(400, _Ckpt(ckpt))]))
    assert warmup.step == 200  # not 300 (Infinity) nor 350 (NaN)
    state = ckpt / "trainer_state.json"
    assert warmup.findings == (
        f"{state}: learning rate inf at step 300 (log_history[2]) is not finite — a diverged or broken "
        "schedule; not taken as the warm-up peak",
        f"{state}: learning rate nan at step 350 (log_history[3]) is not finite — a diverged or broken "
        "schedule; not taken as the warm-up peak",
        f"{state}: learning rate inf at step 360 (log_history[4]) is not finite — a diverged or broken "
        "schedule; not taken as the warm-up peak",
        f"{state}: skipped 2 log_history entries without a step and a learning rate ≥ 0: "
        "log_history[5] (step 'x'), log_history[6] (learning_rate True)",
    )


def test_unusable_trainer_states_are_reported_and_an_earlier_one_used(tmp_path: Path) -> None:
    from moeaudit.series import infer_warmup

    first, dup, fifo = tmp_path / "checkpoint-100", tmp_path / "checkpoint-200", tmp_path / "checkpoint-300"
    _state(first, '{"step": 10, "learning_rate": 1.0}, {"step": 20, "learning_rate": 0.5}')
    dup.mkdir()
    (dup / "trainer_state.json").write_text('{"log_history": [], "log_history": []}')
    fifo.mkdir()
    os.mkfifo(fifo / "trainer_state.json")
    warmup = infer_warmup(_Run([(100, _Ckpt(first)), (200, _Ckpt(dup)), (300, _Ckpt(fifo))]))
    assert warmup.step == 10
    assert len(warmup.findings) == 2
    assert "named pipe (FIFO)" in warmup.findings[0] and str(fifo) in warmup.findings[0]
    assert warmup.findings[1] == f"skipped {dup / 'trainer_state.json'}: key 'log_history' appears twice in one object"


# --- Sigstore bundles with evidence moeaudit does not check ------------------------------------------


@pytest.mark.parametrize(
    ("material", "why"),
    [
        ({"tlogEntries": [{"logIndex": "1"}]}, "carries 1 transparency-log entry, which moeaudit does not verify"),
        ({"tlogEntries": [{}, {}]}, "carries 2 transparency-log entries"),
        (
            {"timestampVerificationData": {"rfc3161Timestamps": [{"signedTimestamp": "AA=="}]}},
            "carries 1 RFC 3161 timestamp",
        ),
        ({"tlogEntries": {}}, "tlogEntries is not a list"),
        ({"timestampVerificationData": {"other": 1}}, "holds more than rfc3161Timestamps"),
    ],
)
def test_a_bundle_with_unverified_log_entries_is_refused(tmp_path: Path, material: dict, why: str) -> None:
    from moeaudit.attest.signing import generate_key, sign_envelope, to_bundle

    key = generate_key(tmp_path / "key")
    bundle = to_bundle(sign_envelope(key, b"{}"), key.public_key())
    bundle["verificationMaterial"].update(material)
    (tmp_path / "certificate.sigstore.json").write_text(json.dumps(bundle))
    result = CliRunner().invoke(
        cli, ["verify", str(tmp_path / "certificate.sigstore.json"), "--pubkey", str(tmp_path / "key.pub")]
    )
    assert result.exit_code == 1 and why in _error_line(result.stderr), result.stderr
    bundle["verificationMaterial"].update({"tlogEntries": [], "timestampVerificationData": {"rfc3161Timestamps": []}})
    from moeaudit.attest.signing import verify_signed

    assert verify_signed(json.dumps(bundle).encode(), key.public_key(), tmp_path).body == b"{}"


# --- after a SIGKILL ---------------------------------------------------------------------------------


def _leftovers(where: Path, name: str = "out") -> list[str]:
    return sorted(p.name for p in where.iterdir() if p.name.startswith(f".{name}."))


@needs_samples
def test_after_sigkill_mid_certify_the_next_run_removes_and_names_the_leftovers(tmp_path: Path) -> None:
    run, out = _run(tmp_path, (250, 500, 750, 1000, 1250, 1500)), tmp_path / "out"
    env = {**os.environ, **_env(tmp_path, tmp_path / "fresh-cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeaudit", *_certify_args(run, out)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert proc.stderr is not None
    deadline = time.time() + HANG
    while time.time() < deadline:  # the replay has started: staging and lock exist
        line = proc.stderr.readline()
        if line.startswith("replaying") or not line:
            break
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=HANG) == -signal.SIGKILL
    left = _leftovers(tmp_path)
    assert ".out.lock" in left and any(".staging-" in n for n in left), left
    staging = next(n for n in left if ".staging-" in n)
    result = CliRunner(env=_env(tmp_path, tmp_path / "cache")).invoke(cli, _certify_args(run, out))
    assert result.exit_code == 0, result.stderr
    assert f"warning: removed the stale lock {tmp_path / '.out.lock'} left by process {proc.pid}," in result.stderr
    assert f"warning: removed {tmp_path / staging}, a staging directory left by a killed moeaudit run" in result.stderr
    assert _leftovers(tmp_path) == [] and (out / "certificate.json").is_file()


def test_a_set_moved_aside_by_a_killed_commit_is_restored(tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = tmp_path / ".out.old-0123456789ab"
    old.mkdir()
    (old / "certificate.json").write_text("{}")
    stray = tmp_path / ".out.staging-ba9876543210"
    stray.mkdir()
    (stray / "notes.txt").write_text("not ours")
    said: list[str] = []
    with OutputSet(out, warn=said.append, force=True) as target:
        assert target.staging.is_dir()
    assert (out / "certificate.json").read_text() == "{}" and not old.exists()
    assert said == [
        f"warning: left {stray} in place: it looks like a staging directory of a killed run "
        "but holds files moeaudit does not write",
        f"warning: restored {out} from {old.name}, where a killed run had moved it aside",
    ]


# --- one short line; a full disk names --out -------------------------------------------------------


def test_a_log_line_with_20000_layers_gives_one_short_line(tmp_path: Path) -> None:
    layers = {str(i): [1.0, 2.0] for i in range(20_000)}
    first = {"step": 1, "loss": 1.0, "expert_grad_norms": {"0": [1.0, 2.0]}}
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps(first) + "\n" + json.dumps({"step": 2, "loss": 1.0, "expert_grad_norms": layers}) + "\n"
    )
    result = CliRunner().invoke(cli, ["envelope", str(tmp_path / "metrics.jsonl")])
    assert result.exit_code == 4
    line = _error_line(result.stderr)
    assert len(line) <= MAX_LINE_CHARS + len("moeaudit: error: "), len(line)  # was 169 KB
    assert f"{tmp_path / 'metrics.jsonl'}:2: layers ['0', '1', '2', " in line
    assert "'19999'] differ from ['0'] logged at line 1 — every line must log every routed layer" in line


def test_every_message_is_capped_in_one_place() -> None:
    from moeaudit.errors import MAX_PATH_CHARS, MAX_VALUE_CHARS, elide_values

    long = InputError("value " + "x" * 100_000 + " end", path="/p/" + "d" * 5000 + "/f.json", hint="do this")
    message = long.diagnostics()
    assert len(message) <= MAX_LINE_CHARS and message.endswith("end — do this")
    assert message.startswith("/p/dd") and "/f.json: value xx" in message
    assert len(message.split(": value")[0]) <= MAX_PATH_CHARS
    shown = elide_values("keep (short) [" + "1, " * 100 + "2] and (this)")
    assert shown.startswith("keep (short) [1, 1, ") and shown.endswith(", 1, 2] and (this)")
    assert " … " in shown and len(shown) == len("keep (short) ") + MAX_VALUE_CHARS + len(" and (this)")
    assert elide_values("unbalanced [" + "1, " * 100) == "unbalanced [" + "1, " * 100
    prose = "(the one at /" + "d" * 200 + "/canary.safetensors is inside the audited run)"
    assert elide_values(prose) == prose  # a parenthesis is prose: only the line cap shortens it


@needs_samples
def test_a_full_disk_names_out_not_the_staging_path(
    tmp_path: Path, samples_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, out = _run(tmp_path), tmp_path / "out"
    real = moeaudit.jsonio.atomic_write

    def full(path, data, **kw):
        if Path(path).name == "certificate.html":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data, **kw)

    monkeypatch.setattr(moeaudit.jsonio, "atomic_write", full)
    result = CliRunner(env=_env(tmp_path, samples_cache)).invoke(cli, _certify_args(run, out))
    assert result.exit_code == 4
    assert _error_line(result.stderr) == (
        f"moeaudit: error: {out / 'certificate.html'}: No space left on "
        "device — free disk space (or write somewhere else) and rerun"
    )
    assert not out.exists() and _leftovers(tmp_path) == []


def test_an_error_about_a_staged_file_names_it_under_out(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(InputError) as info, OutputSet(out) as target:
        raise InputError("the certificate would be too large", path=target.staging / "certificate.json")
    assert info.value.diagnostics().startswith(f"{out / 'certificate.json'}: the certificate would be")
    assert str(out / "certificate.json") in str(info.value)


@needs_samples
def test_trainer_state_is_parsed_from_the_bytes_the_checkpoint_digest_covers(tmp_path: Path) -> None:
    """The warm-up is read from trainer_state.json once, through the checkpoint: the root digest
    covers exactly the bytes parsed, so a trainer_state.json renamed over it afterwards is named
    as changed instead of being digested silently beside a warm-up taken from the other file."""
    import hashlib

    from moeaudit.checkpoint import Checkpoint
    from moeaudit.errors import CheckpointError
    from moeaudit.series import infer_warmup

    path = tmp_path / "checkpoint-1000"
    shutil.copytree(SAMPLES / "healthy" / "checkpoint-1000", path)
    state = path / "trainer_state.json"
    parsed = hashlib.sha256(state.read_bytes()).hexdigest()
    ckpt = Checkpoint(path)
    warmup = infer_warmup(_Run([(1000, ckpt)]))  # type: ignore[list-item]
    other = tmp_path / "other.json"
    other.write_text('{"log_history": [{"step": 1, "learning_rate": 1.0}, {"step": 2, "learning_rate": 0.5}]}')
    os.replace(other, state)
    with pytest.raises(CheckpointError) as exc:
        _ = ckpt.digest
    assert "trainer_state.json" in exc.value.diagnostics() and "changed while it was being audited" in str(
        exc.value.diagnostics()
    )
    assert f"(sha256 {parsed[:16]}…)" in warmup.how  # the warm-up names the bytes it came from
    fresh = Checkpoint(path)  # unchanged since it was read: the digest is of the bytes parsed
    infer_warmup(_Run([(1000, fresh)]))  # type: ignore[list-item]
    assert fresh._snapshot is None and fresh.digest and fresh._snapshot is not None
    assert fresh._snapshot.per_file["trainer_state.json"] == hashlib.sha256(state.read_bytes()).hexdigest()


LOOK_ALIKES = {
    "checkpoint-500 ": "'checkpoint-500 ': not audited: white space around the step",
    "checkpoint-+500": "'checkpoint-+500': not audited: a sign before the step ('+')",
    "checkpoint-1_000": "'checkpoint-1_000': not audited: an underscore in the step",
    "checkpoint-5\n00": "'checkpoint-5\\n00': not audited: '5\\n00' is not a step in digits 0-9",
    "step-x": "'step-x': not audited: 'x' is not a step in digits 0-9",
}


@needs_samples
def test_directories_named_like_checkpoints_are_each_named_with_why(tmp_path: Path) -> None:
    """A directory whose name looks like a checkpoint but gives no step is left out of the audit,
    and named — one line each, control characters escaped — never silently."""
    from moeaudit.attest.signing import generate_key
    from moeaudit.run import discover

    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(SAMPLES / "healthy" / "checkpoint-1000", run / "checkpoint-1000")
    for name in LOOK_ALIKES:
        shutil.copytree(SAMPLES / "healthy" / "checkpoint-1000", run / name)
    found = discover(run)
    assert found.steps == [1000]
    assert sorted(f"{n}: {why.split(';')[0]}" for n, why in found.left_out) == sorted(LOOK_ALIKES.values())
    generate_key(tmp_path / "key")
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}).invoke(
        cli,
        [
            "certify",
            str(run),
            "--key",
            str(tmp_path / "key"),
            "--out",
            str(tmp_path / "out"),
            "--canary",
            str(SAMPLES / "canary.safetensors"),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("warning: left out ")]
    assert sorted(line.removeprefix("warning: left out ").split(";")[0] for line in lines) == sorted(
        LOOK_ALIKES.values()
    ), result.stderr
