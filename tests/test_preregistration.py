"""``moeaudit preregister`` and what ``certify`` signs about it: whether the policy and canary
it audited under are the preregistered ones, whether the preregistration predates the first
audited checkpoint, and what that makes of a calibrated policy. Runs are the healthy sample's
checkpoints copied to a temporary run: copied with their times kept (written long before the
preregistration) or as new files (written after it)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from moeaudit.attest.signing import generate_key
from moeaudit.cli import cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
POLICY, CANARY = SAMPLES / "policy.toml", SAMPLES / "canary.safetensors"
pytestmark = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


def _run_dir(tmp_path: Path, *, keep_times: bool) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    copy = shutil.copy2 if keep_times else shutil.copy  # shutil.copy: new files, written now
    for step in (1250, 1500):
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{step}", run / f"checkpoint-{step}", copy_function=copy)
    return run


def _preregister(tmp_path: Path, out: Path, *, key: Path, policy: Path = POLICY, run: str = "run") -> Any:
    return CliRunner().invoke(
        cli,
        [
            "preregister",
            "--policy",
            str(policy),
            "--canary",
            str(CANARY),
            "--run",
            run,
            "-o",
            str(out),
            "--key",
            str(key),
        ],
    )


def _certify(run: Path, out: Path, key: Path, cache: Path, *extra: str, policy: Path = POLICY) -> tuple[Any, Any]:
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(cache)}).invoke(
        cli,
        [
            "certify",
            str(run),
            "--out",
            str(out),
            "--key",
            str(key),
            "--canary",
            str(CANARY),
            "--policy",
            str(policy),
            *extra,
        ],
    )
    if result.exit_code != 0 or not (out / "certificate.json").exists():
        return result, None
    env = json.loads((out / "certificate.json").read_bytes())
    return result, json.loads(base64.b64decode(env["payload"]))["predicate"]


def _svr(path: Path) -> Any:
    return json.loads(base64.b64decode(json.loads(path.read_bytes())["payload"]))["predicate"]


@pytest.fixture()
def key(tmp_path: Path) -> Path:
    generate_key(tmp_path / "k")
    return tmp_path / "k"


def test_criteria_preregistered_before_the_checkpoints(tmp_path: Path, key: Path, samples_cache: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    made = _preregister(tmp_path, run / "preregistration.json", key=key)
    assert made.exit_code == 0, made.stderr
    _run_dir(tmp_path, keep_times=False)  # the checkpoints are written after it
    result, pred = _certify(run, tmp_path / "out", key, samples_cache)
    assert result.exit_code == 0, result.stderr
    rec = pred["preregistration"]  # wire names
    assert (rec["status"], rec["ordering"], rec["calibration"]) == ("matched", "before", "preregistered")
    raw = (run / "preregistration.json").read_bytes()
    assert rec["file"] == {"path": "preregistration.json", "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    first = rec["firstCheckpoint"]
    assert (first["name"], first["step"]) == ("checkpoint-1250", 1250)
    assert rec["createdAt"] <= first["writtenAt"] and "modification time" in first["evidence"]
    assert rec["run"] == "run" and "mismatches" not in rec
    line = f"criteria: {rec['summary']}"
    assert line in result.stdout and "before the first audited checkpoint checkpoint-1250" in line
    assert rec["summary"] in (tmp_path / "out" / "certificate.html").read_text()
    shown = CliRunner().invoke(
        cli,
        [
            "verify",
            str(tmp_path / "out" / "certificate.sigstore.json"),
            "--pubkey",
            f"{key}.pub",
            "--key",
            str(key),
            "--attest-verification",
            str(tmp_path / "svr.json"),
        ],
    )
    assert shown.exit_code == 0 and line in shown.stdout
    svr = _svr(tmp_path / "svr.json")
    assert "MOEAUDIT_CRITERIA_PREREGISTERED" in svr["properties"]
    (named,) = [p for p in svr["verifier"]["policies"] if p["name"] == "preregistration.json"]
    assert named["digest"] == {"sha256": hashlib.sha256(raw).hexdigest()}
    assert named["annotations"] == {"status": "matched", "ordering": "before"}
    # the preregistration signs the digests certify compares, in its published schema
    statement = json.loads(base64.b64decode(json.loads(raw)["payload"]))
    import jsonschema

    from moeaudit.schemas import load

    jsonschema.Draft202012Validator(load("preregistration-v1.statement.schema.json")).validate(statement)
    assert statement["predicate"]["policy"]["settingsDigest"] == pred["policy"]["digest"]
    assert statement["predicate"]["canary"]["digest"] == pred["canary"]["digest"]
    assert statement["subject"][0]["digest"]["sha256"] == hashlib.sha256(POLICY.read_bytes()).hexdigest()


def test_a_preregistration_after_the_checkpoints_names_the_calibration_as_fitted_after(
    tmp_path: Path, key: Path, samples_cache: Path
) -> None:
    run = _run_dir(tmp_path, keep_times=True)  # files written when the samples were built
    assert _preregister(tmp_path, run / "preregistration.json", key=key).exit_code == 0
    result, pred = _certify(run, tmp_path / "out", key, samples_cache)
    assert result.exit_code == 0, result.stderr
    rec = pred["preregistration"]
    assert (rec["status"], rec["ordering"], rec["calibration"]) == ("matched", "after", "fitted after the evidence")
    assert rec["createdAt"] > rec["firstCheckpoint"]["writtenAt"]
    assert "AFTER the first audited checkpoint" in result.stdout
    assert "the calibrated policy was fitted after the evidence" in result.stdout
    shown = CliRunner().invoke(
        cli,
        [
            "verify",
            str(tmp_path / "out" / "certificate.json"),
            "--pubkey",
            f"{key}.pub",
            "--key",
            str(key),
            "--attest-verification",
            str(tmp_path / "svr.json"),
        ],
    )
    assert shown.exit_code == 0, shown.stderr
    assert "MOEAUDIT_CRITERIA_PREREGISTERED" not in _svr(tmp_path / "svr.json")["properties"]


def test_digest_mismatch_is_signed_as_a_finding(tmp_path: Path, key: Path, samples_cache: Path) -> None:
    """A preregistered policy other than the one audited under (a tolerance loosened since), and
    another run's name: the certificate is written, its verdict unchanged, the mismatch signed."""
    loosened = tmp_path / "loosened.toml"
    loosened.write_text(POLICY.read_text().replace("tol_c2_rel = 0.5", "tol_c2_rel = 0.9"))
    run = tmp_path / "run"
    run.mkdir()
    elsewhere = tmp_path / "prereg.json"
    assert _preregister(tmp_path, elsewhere, key=key, run="another-run").exit_code == 0
    _run_dir(tmp_path, keep_times=False)
    result, pred = _certify(
        run, tmp_path / "out", key, samples_cache, "--preregistration", str(elsewhere), policy=loosened
    )
    assert result.exit_code == 0, result.stderr
    rec = pred["preregistration"]
    assert (rec["status"], rec["mismatches"], rec["calibration"]) == (
        "mismatch",
        ["policy", "run"],
        "not shown to predate the evidence",
    )
    from moeaudit.policy import load_policy

    assert rec["preregistered"]["settingsDigest"] == load_policy(POLICY).digest != pred["policy"]["digest"]
    assert "does NOT match: policy, run differ(s)" in result.stdout
    assert pred["verdict"] == "PASS"


def test_absent_preregistration_and_an_uncalibrated_policy(tmp_path: Path, key: Path, samples_cache: Path) -> None:
    plain = tmp_path / "plain.toml"
    plain.write_text("[gates]\nescalate_after = 4\n")
    run = _run_dir(tmp_path, keep_times=True)
    result, pred = _certify(run, tmp_path / "out", key, samples_cache, policy=plain)
    assert result.exit_code == 0, result.stderr
    rec = pred["preregistration"]
    assert (rec["status"], rec["ordering"], rec["calibration"]) == ("absent", "unknown", "not calibrated")
    assert set(rec) == {"status", "ordering", "calibration", "summary", "firstCheckpoint"}
    # nothing to order against: the files' times are not signed, so a copy of the run certifies the same
    assert rec["firstCheckpoint"]["writtenAt"] is None
    assert rec["firstCheckpoint"]["evidence"] == "not read: no preregistration to order against"
    assert "criteria: not preregistered (no preregistration.json in the run, none given)\n" in result.stdout
    # the sample policy is calibrated: without a preregistration that is named
    result, pred = _certify(run, tmp_path / "out2", key, samples_cache)
    assert pred["preregistration"]["calibration"] == "not shown to predate the evidence"


def test_a_preregistration_signed_by_another_key_is_refused_before_the_replay(
    tmp_path: Path, key: Path, samples_cache: Path
) -> None:
    generate_key(tmp_path / "trainer")
    run = _run_dir(tmp_path, keep_times=True)
    assert _preregister(tmp_path, run / "preregistration.json", key=tmp_path / "trainer").exit_code == 0
    result, pred = _certify(run, tmp_path / "out", key, samples_cache)
    assert result.exit_code == 1 and pred is None and not (tmp_path / "out").exists()
    assert "preregistration.json" in result.stderr and "--preregistration-pubkey" in result.stderr
    result, pred = _certify(
        run, tmp_path / "out", key, samples_cache, "--preregistration-pubkey", str(tmp_path / "trainer.pub")
    )
    assert result.exit_code == 0, result.stderr
    assert pred["preregistration"]["status"] == "matched"
    # a file that is no preregistration: an input error
    (tmp_path / "cert-as-prereg.json").write_bytes((tmp_path / "out" / "certificate.json").read_bytes())
    result, _ = _certify(
        run, tmp_path / "out3", key, samples_cache, "--preregistration", str(tmp_path / "cert-as-prereg.json")
    )
    assert result.exit_code == 4 and "not a moeaudit preregistration" in result.stderr


def test_a_run_trained_after_its_preregistration(tmp_path: Path, key: Path) -> None:
    """The order as it happens: the canary first, the preregistration, then the training (the
    tiny healthy sample run, retrained), then certify — nothing copied, no time set by hand."""
    from moeaudit.samples.build import build_samples

    out = tmp_path / "samples"
    build_samples(out, "tiny", runs=["healthy"])  # the canary (deterministic: rebuilt identical below)
    plain = tmp_path / "plain.toml"
    plain.write_text("[gates]\nescalate_after = 4\n")
    prereg = tmp_path / "preregistration.json"
    made = CliRunner().invoke(
        cli,
        [
            "preregister",
            "--policy",
            str(plain),
            "--canary",
            str(out / "canary.safetensors"),
            "--run",
            "healthy",
            "-o",
            str(prereg),
            "--key",
            str(key),
        ],
    )
    assert made.exit_code == 0, made.stderr
    build_samples(out, "tiny", runs=["healthy"])  # trained now, after the preregistration
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}).invoke(
        cli,
        [
            "certify",
            str(out / "healthy"),
            "--out",
            str(tmp_path / "cert"),
            "--key",
            str(key),
            "--canary",
            str(out / "canary.safetensors"),
            "--policy",
            str(plain),
            "--preregistration",
            str(prereg),
        ],
    )
    assert result.exit_code == 0, result.stderr
    env = json.loads((tmp_path / "cert" / "certificate.json").read_bytes())
    rec = json.loads(base64.b64decode(env["payload"]))["predicate"]["preregistration"]
    assert (rec["status"], rec["ordering"], rec["calibration"]) == ("matched", "before", "not calibrated")
    assert rec["firstCheckpoint"]["name"] == "checkpoint-3"


def test_ordering_is_strict_to_the_microsecond() -> None:
    """``before`` needs the preregistration strictly earlier than the first checkpoint's files;
    equal times are ``after``; no file time is ``unknown``."""
    from datetime import datetime, timezone

    from moeaudit.attest.preregistration import Preregistration, assess

    at = datetime(2025, 11, 28, 22, 21, 48, 466483, tzinfo=timezone.utc)
    written = int(at.timestamp()) * 10**9 + 466_483_999  # ns: 2025-11-28T22:21:48.466483Z, +999 ns
    pred = {
        "run": "r",
        "createdAt": "2025-11-28T22:21:48.466483Z",
        "policy": {"settingsDigest": "aa"},
        "canary": {"digest": {"sha256": "bb"}},
    }

    def order(created: str, when: int | None) -> tuple[str, str]:
        found = Preregistration(Path("p.json"), "cc", 1, "dd", {**pred, "createdAt": created})
        rec = assess(
            found,
            run="r",
            settings_digest="aa",
            canary_digest="bb",
            calibrated=True,
            first_checkpoint=("checkpoint-1", 1, when),
        )
        return rec["ordering"], rec["calibration"]

    assert order("2025-11-28T22:21:48.466483Z", written) == ("after", "fitted after the evidence")
    assert order("2025-11-28T22:21:48.466482Z", written) == ("before", "preregistered")
    assert order("2025-11-28T23:21:48.466482+01:00", written) == ("before", "preregistered")  # same instant
    assert order("2025-11-28T22:21:48.466482Z", None) == ("unknown", "not shown to predate the evidence")


def test_a_file_that_is_not_signed_json_is_named_a_preregistration_error(tmp_path: Path) -> None:
    """An unsigned or non-JSON --preregistration is exit 4 with one line that names what was
    expected (a signed preregistration), not "not a certificate"."""
    from moeaudit.attest.preregistration import open_preregistration
    from moeaudit.attest.signing import load_public_key
    from moeaudit.errors import InputError

    key = generate_key(tmp_path / "k")
    for name, raw in (("plain.json", b'{"x": 1}'), ("text.json", b"not json")):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(InputError) as err:
            open_preregistration(tmp_path / name, [load_public_key(tmp_path / "k.pub"), key.public_key()])
        assert err.value.what.startswith("not a signed preregistration"), err.value.what
        assert "certificate" not in err.value.what + str(err.value.hint)
