"""Trust and output integrity (docs/security.md, "Integrity of outputs"): what moeaudit writes over, how the default key
is created, the resource caps on what it reads, and operating-system errors as one-line input
errors (exit 4). The bad-input matrix (tests/test_bad_inputs.py) pins the CLI rows that need
the corpus; these are the unit and CLI tests that need only ``tmp_path``."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import moeaudit.jsonio as jsonio
from moeaudit.attest.signing import ensure_key, generate_key, keyid, load_private_key, load_public_key
from moeaudit.cli import cli
from moeaudit.errors import InputError
from moeaudit.jsonio import atomic_write
from moeaudit.limits import (
    MAX_CERTIFICATE_BYTES,
    MAX_JSONL_LINE_BYTES,
    iter_lines,
    read_regular,
)
from moeaudit.metrics import parse_metrics

ROOT = Path(__file__).resolve().parent.parent


def run(*args: Any, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner(env=env).invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def one_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("moeaudit: error:")]
    assert len(lines) == 1, stderr
    assert "internal error" not in lines[0], lines[0]
    return lines[0]


def metrics_text(steps: int = 4, **extra: Any) -> str:
    rows = [
        {
            "step": 10 * (s + 1),
            "loss": 2.0 - 0.1 * s,
            "expert_grad_norms": {"0": [1.0, 1.5 + 0.1 * s], "1": [0.5, 0.7]},
            **extra,
        }
        for s in range(steps)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def metrics(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text(metrics_text())
    return path


# ----- item 4: output targets are regular files only -----------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_json_output_refuses_a_special_target_even_with_force(tmp_path: Path, metrics: Path, kind: str) -> None:
    target, victim = tmp_path / "out.json", tmp_path / "victim.json"
    victim.write_text("keep me\n")
    {"fifo": lambda: os.mkfifo(target), "symlink": lambda: target.symlink_to(victim), "directory": target.mkdir}[kind]()
    code, _, stderr = run("envelope", metrics, "--json", target, "--force")
    line = one_error(stderr)
    assert code == 4
    what = {"fifo": "a named pipe (FIFO)", "symlink": "a symbolic link", "directory": "a directory"}
    assert f"{target}: output is {what[kind]}, not a regular file" in line
    assert victim.read_text() == "keep me\n"  # the link was not followed
    mode = os.lstat(target).st_mode
    assert {"fifo": stat.S_ISFIFO, "symlink": stat.S_ISLNK, "directory": stat.S_ISDIR}[kind](mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "run", "victim.json"]


def test_a_character_device_is_never_replaced() -> None:
    """/dev/null as root used to become a regular file; only lstat is called on it here."""
    with pytest.raises(InputError, match="output is a character device, not a regular file"):
        atomic_write("/dev/null", "x", force=True)
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_a_file_that_appears_during_the_write_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --force the temp file is linked into place (O_EXCL semantics), not renamed."""
    target, real = tmp_path / "out.json", tempfile.mkstemp

    def racing(*a: Any, **k: Any) -> Any:
        made = real(*a, **k)
        target.write_text("written by someone else")
        return made

    monkeypatch.setattr(jsonio.tempfile, "mkstemp", racing)
    with pytest.raises(InputError, match="output exists"):
        atomic_write(target, "mine", force=False)
    assert target.read_text() == "written by someone else"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temp file left


def test_a_fifo_that_appears_during_a_forced_write_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, real = tmp_path / "out.json", tempfile.mkstemp

    def racing(*a: Any, **k: Any) -> Any:
        made = real(*a, **k)
        os.mkfifo(target)
        return made

    monkeypatch.setattr(jsonio.tempfile, "mkstemp", racing)
    with pytest.raises(InputError, match="named pipe"):
        atomic_write(target, "mine", force=True)
    assert stat.S_ISFIFO(os.lstat(target).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_canary_build_refuses_a_fifo_output(tmp_path: Path) -> None:
    tokens = tmp_path / "c.jsonl"
    tokens.write_text(json.dumps({"domain": "d", "tokens": [1, 2, 3]}) + "\n")
    os.mkfifo(tmp_path / "c.safetensors")
    code, _, stderr = run("canary", "build", "--tokens", tokens, "--out", tmp_path / "c.safetensors", "--force")
    assert code == 4 and "c.safetensors: output is a named pipe (FIFO)" in one_error(stderr)
    assert stat.S_ISFIFO(os.lstat(tmp_path / "c.safetensors").st_mode)


# ----- item 5: the default key is created once, as a matching pair ---------------------------


def _first_use(config_home: str, barrier: Any, results: Any) -> None:
    os.environ["XDG_CONFIG_HOME"] = config_home
    from moeaudit.attest.signing import keyid
    from moeaudit.commands.common import QUIET, signing_key

    barrier.wait()  # every process reaches the "no key yet" check at once
    try:
        results.put(keyid(signing_key(None, QUIET).public_key()))
    except BaseException as exc:  # noqa: BLE001 — reported to the parent as a failure
        results.put(f"error: {type(exc).__name__}: {exc}")


def test_concurrent_first_use_creates_one_matching_key_pair(tmp_path: Path) -> None:
    n = 6
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_first_use, args=(str(tmp_path), barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    key_path = tmp_path / "moeaudit" / "signing-key.pem"
    private, _ = load_private_key(key_path)
    on_disk = keyid(private.public_key())
    assert keyid(load_public_key(Path(f"{key_path}.pub"))) == on_disk  # the pair matches
    assert got == [on_disk] * n  # every racer signs with that key; no loser failed
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    assert sorted(p.name for p in key_path.parent.iterdir()) == [
        "signing-key.pem",
        "signing-key.pem.lock",
        "signing-key.pem.pub",
    ]


def test_ensure_key_creates_once(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "signing-key.pem"
    assert ensure_key(path) is True
    first = path.read_bytes()
    assert ensure_key(path) is False and path.read_bytes() == first
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_ensure_key_does_not_pair_a_new_key_with_a_stale_pub(tmp_path: Path) -> None:
    path = tmp_path / "signing-key.pem"
    Path(f"{path}.pub").write_text("someone's old public key\n")
    with pytest.raises(InputError, match="a public key exists without its private key"):
        ensure_key(path)
    assert not path.exists() and Path(f"{path}.pub").read_text() == "someone's old public key\n"


def test_keygen_never_writes_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / "key.pub").symlink_to(victim)
    with pytest.raises(InputError, match="key.pub: output is a symbolic link"):
        generate_key(tmp_path / "key", force=True)
    assert victim.read_text() == "keep\n" and not (tmp_path / "key").exists()


def test_keygen_refusal_leaves_no_half_pair(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("an existing private key\n")
    with pytest.raises(InputError, match="key file exists"):
        generate_key(tmp_path / "key")
    assert not (tmp_path / "key.pub").exists()
    assert (tmp_path / "key").read_text() == "an existing private key\n"


def test_keygen_into_a_missing_directory_is_one_line_naming_it(tmp_path: Path) -> None:
    code, _, stderr = run("keygen", "--out", tmp_path / "nowhere" / "key")
    assert code == 4
    line = one_error(stderr)
    why = "output directory does not exist — create it first or choose another path"
    assert line == f"moeaudit: error: {tmp_path / 'nowhere'}: {why}"
    assert not (tmp_path / "nowhere").exists()


def test_keygen_refusal_leaves_nothing_behind(tmp_path: Path) -> None:
    # a stale KEY.pub alone: refused before anything, KEY.lock included, is created
    (tmp_path / "key.pub").write_text("someone's old public key\n")
    code, _, stderr = run("keygen", "--out", tmp_path / "key")
    assert code == 4 and one_error(stderr).endswith("key.pub: key file exists — pass --force to replace it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.pub"]


# ----- item 9: resource caps ---------------------------------------------------------------------


def test_verify_refuses_a_fifo_instead_of_hanging(tmp_path: Path) -> None:
    generate_key(tmp_path / "k")
    os.mkfifo(tmp_path / "cert.json")
    done = subprocess.run(
        [sys.executable, "-m", "moeaudit", "verify", str(tmp_path / "cert.json"), "--pubkey", str(tmp_path / "k.pub")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 4
    assert "cert.json: certificate is a named pipe (FIFO), not a regular file" in one_error(done.stderr)


def test_character_devices_are_refused_before_reading() -> None:
    with pytest.raises(InputError, match="certificate is a character device, not a regular file"):
        read_regular("/dev/zero", "certificate", MAX_CERTIFICATE_BYTES)


def test_an_oversized_certificate_is_refused_by_its_size(tmp_path: Path) -> None:
    generate_key(tmp_path / "k")
    cert = tmp_path / "cert.json"
    with open(cert, "wb") as f:
        f.truncate(MAX_CERTIFICATE_BYTES + 1)  # sparse: nothing is written, nothing is read
    code, _, stderr = run("verify", cert, "--pubkey", tmp_path / "k.pub")
    assert code == 4
    assert f"certificate is {MAX_CERTIFICATE_BYTES + 1} bytes, over the 256 MiB limit" in one_error(stderr)


def test_a_policy_fifo_or_directory_is_refused(tmp_path: Path, metrics: Path) -> None:
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "dir.toml").mkdir()
    for name, kind in (("fifo.toml", "a named pipe (FIFO)"), ("dir.toml", "a directory")):
        code, _, stderr = run("envelope", metrics, "--policy", tmp_path / name)
        assert code == 4
        assert f"{name}: policy file is {kind}, not a regular file" in one_error(stderr)


def test_bootstrap_is_capped(tmp_path: Path, metrics: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text("[receipts]\nbootstrap = 1000000000\n")
    code, _, stderr = run("envelope", metrics, "--policy", policy)
    assert code == 4 and "p.toml: receipts.bootstrap must be ≤ 100000" in one_error(stderr)
    policy.write_text("[receipts]\nbootstrap = 100000\n")
    assert run("envelope", metrics, "--policy", policy)[0] in (0, 1, 3)


def test_a_metrics_line_over_the_cap_is_refused(tmp_path: Path, metrics: Path) -> None:
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:-1] + ', "note": "' + "x" * MAX_JSONL_LINE_BYTES + '"}'
    metrics.write_text("\n".join(lines) + "\n")
    code, _, stderr = run("envelope", metrics)
    assert code == 4 and f"{metrics}:2: line is longer than 4 MiB" in one_error(stderr)


def test_lines_are_streamed_with_a_cap(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"12345\n" + b"x" * 8 + b"\n1234567890\nend")
    got = []
    with pytest.raises(InputError, match=r"log.jsonl:3: line is longer than"):
        for n, raw, terminated in iter_lines(path, "log", max_line=9):
            got.append((n, raw, terminated))
    assert got == [(1, b"12345", True), (2, b"x" * 8, True)]
    path.write_bytes(b"123456789\n" + b"123456789")  # exactly at the cap: fine
    assert list(iter_lines(path, "log", max_line=9)) == [(1, b"123456789", True), (2, b"123456789", False)]


@pytest.mark.parametrize("log", ["metrics.jsonl", "events.jsonl", "canary_probe.jsonl"])
def test_a_run_log_that_is_a_fifo_is_refused_not_ignored(tmp_path: Path, log: str) -> None:
    import make_bad_inputs

    run_dir = tmp_path / "run"
    make_bad_inputs.save_checkpoint(run_dir / "checkpoint-10", make_bad_inputs.tensors())
    if log != "metrics.jsonl":
        (run_dir / "metrics.jsonl").write_text(metrics_text())
    os.mkfifo(run_dir / log)
    source = "probe" if log == "canary_probe.jsonl" else "logs"
    code, _, stderr = run("envelope", run_dir, "--source", source)
    assert code == 4 and f"{run_dir / log}: " in one_error(stderr)
    assert "a named pipe (FIFO), not a regular file" in stderr


def test_a_window_over_the_cap_is_refused_before_the_replay(tmp_path: Path) -> None:
    import make_bad_inputs

    from moeaudit.limits import MAX_WINDOW_TOKENS

    ckpt = make_bad_inputs.save_checkpoint(tmp_path / "ckpt", make_bad_inputs.tensors())
    tokens = tmp_path / "long.jsonl"
    tokens.write_text(json.dumps({"domain": "d", "tokens": [i % 32 for i in range(MAX_WINDOW_TOKENS + 1)]}) + "\n")
    canary = tmp_path / "long.safetensors"
    assert run("canary", "build", "--tokens", tokens, "--out", canary)[0] == 0
    code, _, stderr = run("receipts", ckpt, "--canary", canary, "--json", tmp_path / "r.json")
    line = one_error(stderr)
    assert code == 4 and f"{canary}: canary windows are {MAX_WINDOW_TOKENS + 1} tokens long" in line
    assert f"at most {MAX_WINDOW_TOKENS} tokens" in line and not (tmp_path / "r.json").exists()


def test_bootstrap_in_blocks_is_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    from moeaudit.receipts import bootstrap

    values_WX = torch.rand(40, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    boot = bootstrap.WindowBootstrap(40, 500, seed=3)
    assert boot.idx_BW is not None
    whole = bootstrap._interval(values_WX[boot.idx_BW].sum(1)[:, 2])
    monkeypatch.setattr(bootstrap, "GATHER_ELEMENTS", 40 * 6 * 7)  # blocks of 7 resamples
    assert len(boot._chunks(values_WX)) == 72
    assert boot.statistic(values_WX, lambda s: s[:, 2]) == whole


# ----- item 10: OS errors, Inf in logs ----------------------------------------------------------


def test_a_full_disk_is_one_line_naming_the_output(
    tmp_path: Path, metrics: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, stderr = run("envelope", metrics, "--json", out_dir / "report.json")
    line = one_error(stderr)
    assert code == 4
    assert line == (
        f"moeaudit: error: {out_dir / 'report.json'}: No space left on device — "
        "free disk space (or write somewhere else) and rerun"
    )
    assert list(out_dir.iterdir()) == []  # neither the output nor its temp file


def test_a_permission_error_is_one_line_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moeaudit.report.export

    def denied(*_a: Any, **_k: Any) -> str:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/srv/certs/cert.json")

    monkeypatch.setattr(moeaudit.report.export, "run_export", denied)
    code, _, stderr = run("export", tmp_path / "c.json", "--framework", "eu-ai-act", "--out", tmp_path / "x.md")
    assert code == 4
    assert one_error(stderr) == (
        "moeaudit: error: /srv/certs/cert.json: Permission denied — "
        "check the permissions of the file and of its directory"
    )


def test_inf_in_metrics_is_a_finding_not_a_number() -> None:
    text = metrics_text(3).replace('"loss": 1.9', '"loss": 1e999').replace("[0.5, 0.7]", "[0.5, -1e999]", 1)
    ms = parse_metrics(text, "m.jsonl")
    assert ms.loss == (2.0, None, 1.8)
    assert ms.norms["1"][0] == (0.5, None)
    assert [(f.line, f.where, f.what) for f in ms.findings] == [
        (
            1,
            "expert_grad_norms['1'][1]",
            "non-finite expert gradient norm (a number beyond the float range, read as Inf)",
        ),
        (2, "loss", "non-finite loss (a number beyond the float range, read as Inf)"),
    ]


def test_inf_in_metrics_is_reported_by_envelope(metrics: Path) -> None:
    metrics.write_text(metrics_text().replace('"loss": 1.9', '"loss": 1e999'))
    code, stdout, _ = run("envelope", metrics, "--json", "-")
    report = json.loads(stdout)
    assert code in (0, 1, 3)
    what = "non-finite loss (a number beyond the float range, read as Inf)"
    assert report["findings"] == [{"line": 2, "step": 20, "where": "loss", "what": what}]
