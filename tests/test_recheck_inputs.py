"""``verify --recheck`` recomputes every input the certificate binds — the
checkpoints, metrics.jsonl, events.jsonl, canary_probe.jsonl, the canary (by its content
digest), the policy file and a --reference — and names each one that changed or is missing
(exit 1); ``verify --require-verdict`` and ``certify --fail-on`` turn the verdict into an exit
code for scripts.

One certify of a copy of the shipped resume run (two checkpoints, every log) serves the module;
each test edits one input and puts it back."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from signed import signed_statement

from moeaudit.cli import cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
pytestmark = pytest.mark.skipif(not (SAMPLES / "resume").is_dir(), reason="sample runs not built")

LOGS = ("metrics.jsonl", "events.jsonl", "canary_probe.jsonl")


class Certified:
    """A certified copy of the resume run: ``work/run``, ``work/inputs/{canary.safetensors,
    policy.toml, reference.json}`` (named to certify by absolute path), the key and the cert."""

    def __init__(self, work: Path, env: dict[str, str]):
        self.work, self.env = work, env
        self.run, self.inputs = work / "run", work / "inputs"
        self.key = work / "key"
        self.cert = work / "out" / "certificate.json"
        self.canary = self.inputs / "canary.safetensors"
        self.policy = self.inputs / "policy.toml"
        self.reference = self.inputs / "reference.json"

    def bound(self) -> dict[str, Path]:
        files = {name: self.run / name for name in LOGS}
        return {**files, "canary": self.canary, "policy": self.policy, "reference": self.reference}

    def certify(self, out: Path, *extra: str) -> Result:
        return invoke(
            self.env,
            "certify",
            self.run,
            "--key",
            self.key,
            "--out",
            out,
            "--canary",
            self.canary,
            "--policy",
            self.policy,
            *extra,
        )

    def verify(self, *extra: str | Path, reference: bool = True) -> Result:
        ref = ("--reference", self.reference) if reference else ()
        return invoke(self.env, "verify", self.cert, "--pubkey", f"{self.key}.pub", *extra, *ref)


def invoke(env: dict[str, str], *argv: str | Path) -> Result:
    return CliRunner(env=env).invoke(cli, [str(a) for a in argv])


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory, samples_cache: Path) -> Certified:
    from moeaudit.attest.signing import generate_key

    work = tmp_path_factory.mktemp("recheck")
    c = Certified(work, {"MOEAUDIT_CACHE_DIR": str(samples_cache)})
    c.run.mkdir()
    c.inputs.mkdir()
    for step in (1250, 1500):
        shutil.copytree(SAMPLES / "resume" / f"checkpoint-{step}", c.run / f"checkpoint-{step}")
    for name in LOGS:
        shutil.copy(SAMPLES / "resume" / name, c.run / name)
    shutil.copy(SAMPLES / "canary.safetensors", c.canary)
    shutil.copy(SAMPLES / "policy.toml", c.policy)
    generate_key(c.key)
    first = c.certify(work / "first")  # its receipts of checkpoint-1500 serve as the reference
    assert first.exit_code == 0, first.stderr
    shutil.copy(work / "first" / "receipts" / "checkpoint-1500.json", c.reference)
    result = c.certify(c.cert.parent, "--reference", c.reference)
    assert result.exit_code == 0, result.stderr
    return c


@pytest.fixture()
def pristine(certified: Certified) -> Iterator[Certified]:
    """The certified files, put back as they were after the test."""
    saved = {path: path.read_bytes() for path in certified.bound().values()}
    yield certified
    for path, data in saved.items():
        path.write_bytes(data)


def findings(result: Result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("recheck: ") and "digests match" not in line]


def test_the_certificate_binds_every_input(certified: Certified) -> None:
    pred = signed_statement(json.loads(certified.cert.read_text()))["predicate"]
    assert set(pred["inputs"]) == {"metrics", "events", "probe", "policy_file", "reference"}
    assert pred["canary"]["origin"] == f"named with --canary at {certified.canary}"


def test_unchanged_inputs_all_match(certified: Certified) -> None:
    result = certified.verify("--recheck")
    assert result.exit_code == 0, result.output
    assert findings(result) == []
    assert "recheck: all 2 checkpoint digests match, and the 6 other bound input(s)" in result.stdout
    for path in certified.bound().values():
        assert str(path) in result.stdout


def _edit(c: Certified, name: str) -> Path:
    """Change the input ``name`` (a key of ``Certified.bound``) so its signed digest no longer holds."""
    path = c.bound()[name]
    if name == "canary":  # a valid canary with one token changed: another content digest
        from moeaudit import canary as canary_mod

        lines = (SAMPLES / "canary.jsonl").read_text().splitlines()
        first = json.loads(lines[0])
        first["tokens"][0] = (first["tokens"][0] + 1) % 32
        source = c.work / "edited-canary.jsonl"
        source.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
        canary_mod.save(canary_mod.build_from_jsonl(source), path)
    else:  # a log, the policy or the reference receipts: one more line
        with path.open("a", encoding="utf-8") as f:
            f.write("\n")
    return path


@pytest.mark.parametrize(
    "name", ["metrics.jsonl", "events.jsonl", "canary_probe.jsonl", "canary", "policy", "reference"]
)
def test_each_edited_input_is_named_and_fails(pristine: Certified, name: str) -> None:
    edited = _edit(pristine, name)
    result = pristine.verify("--recheck")
    assert result.exit_code == 1, result.output
    assert len(findings(result)) == 1, result.stdout
    assert findings(result)[0].startswith(f"recheck: changed: {edited} (")
    assert result.stderr.strip() == (
        f"moeaudit: error: {pristine.cert}: 1 bound input changed since certification (listed above)"
    )


def test_several_changes_are_each_named(pristine: Certified) -> None:
    edited = {_edit(pristine, "metrics.jsonl"), _edit(pristine, "policy")}
    (pristine.run / "events.jsonl").unlink()
    result = pristine.verify("--recheck")
    assert result.exit_code == 1
    lines = findings(result)
    changed = {
        line.removeprefix("recheck: changed: ").split(" (")[0]
        for line in lines
        if line.startswith("recheck: changed: ")
    }
    assert len(lines) == 3 and changed == {str(p) for p in edited}
    assert f"recheck: missing: {pristine.run / 'events.jsonl'} (events log): not found" in lines
    assert "2 bound inputs changed, 1 missing since certification" in result.stderr


def test_the_canary_is_compared_by_content_not_bytes(pristine: Certified) -> None:
    """The same windows in other bytes (the safetensors header padded) still match; a damaged
    canary is named as changed."""
    raw = pristine.canary.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    pristine.canary.write_bytes(struct.pack("<Q", n + 8) + raw[8 : 8 + n] + b" " * 8 + raw[8 + n :])
    assert pristine.canary.read_bytes() != raw
    result = pristine.verify("--recheck")
    assert result.exit_code == 0, result.output
    pristine.canary.write_bytes(raw[:-4] + bytes(b ^ 0xFF for b in raw[-4:]))
    result = pristine.verify("--recheck")
    assert result.exit_code == 1
    assert findings(result) == [
        f"recheck: changed: {pristine.canary} (canary): cannot be read as "
        f"certified ({findings(result)[0].split('certified (', 1)[1]}"
    ]


def test_a_missing_input_is_named_not_skipped(pristine: Certified) -> None:
    pristine.policy.unlink()
    result = pristine.verify("--recheck")
    assert result.exit_code == 1
    assert findings(result) == [f"recheck: missing: {pristine.policy} (policy file): not found — pass --policy FILE"]


@pytest.mark.parametrize("how", ["renamed", "removed"])
def test_a_checkpoint_renamed_or_removed_is_a_finding(pristine: Certified, tmp_path: Path, how: str) -> None:
    """A certified checkpoint no longer under its name is "missing" like any bound input (exit 1,
    its own line), and every other input is still checked: here an edited metrics log."""
    ckpt = pristine.run / "checkpoint-1250"
    moved = pristine.run / "checkpoint-1250.old" if how == "renamed" else tmp_path / "checkpoint-1250"
    ckpt.rename(moved) if how == "renamed" else shutil.move(ckpt, moved)
    try:
        edited = _edit(pristine, "metrics.jsonl")
        result = pristine.verify("--recheck")
    finally:
        shutil.move(moved, ckpt)
    assert result.exit_code == 1, result.output
    lines = findings(result)
    assert lines[0] == (f"recheck: missing: {ckpt} (checkpoint): not found — renamed or removed since certification")
    assert len(lines) == 2 and lines[1].startswith(f"recheck: changed: {edited} (metrics log): digest now ")
    assert result.stderr == (
        f"moeaudit: error: {pristine.cert}: 1 bound input changed, 1 missing since certification (listed above)\n"
    )


def test_a_run_dir_that_is_not_the_run_is_an_input_error(certified: Certified, tmp_path: Path) -> None:
    """A --run-dir that is not there, or holds none of the certified checkpoints and logs, is
    not the run (exit 4, one line): not a list of every input as missing."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "checkpoint-1250.old").mkdir()  # nothing under a certified name
    result = certified.verify("--recheck", "--run-dir", tmp_path / "empty")
    assert result.exit_code == 4, result.output
    assert findings(result) == []
    assert result.stderr == (
        f"moeaudit: error: {tmp_path / 'empty'}: not the certified run (--run-dir): it holds none of the "
        "certified checkpoints and logs (checkpoint-1250, checkpoint-1500, events.jsonl, … (5 in all)) "
        "— pass --run-dir where the run is now\n"
    )
    result = certified.verify("--recheck", "--run-dir", tmp_path / "nowhere")
    assert result.exit_code == 4, result.output
    assert result.stderr == (
        f"moeaudit: error: {tmp_path / 'nowhere'}: run directory not found (--run-dir) "
        "— pass --run-dir where the run is now\n"
    )


def test_the_reference_needs_its_path(certified: Certified) -> None:
    """certify records only the reference's name: without --reference it is missing, not skipped."""
    result = certified.verify("--recheck", reference=False)
    assert result.exit_code == 1
    assert findings(result) == [
        "recheck: missing: reference.json (reference): the certificate records only its name — pass --reference PATH"
    ]


def test_inputs_found_where_they_are_now(pristine: Certified, tmp_path: Path) -> None:
    """--canary / --policy name where a moved input is now; the moved file is what is checked."""
    moved = tmp_path / "p.toml"
    shutil.move(pristine.policy, moved)
    assert pristine.verify("--recheck", "--policy", moved).exit_code == 0
    with moved.open("a") as f:
        f.write("\n")
    result = pristine.verify("--recheck", "--policy", moved)
    assert result.exit_code == 1 and findings(result)[0].startswith(f"recheck: changed: {moved} (")


def test_override_flags_need_recheck_and_a_bound_input(certified: Certified, tmp_path: Path) -> None:
    result = certified.verify("--canary", certified.canary, reference=False)
    assert result.exit_code == 2 and "add --recheck" in result.stderr


def test_run_dir_without_recheck_is_a_usage_error(certified: Certified) -> None:
    """--run-dir alone would otherwise be ignored and the certificate reported valid, as if the
    run there had been rechecked."""
    result = certified.verify("--run-dir", certified.run, reference=False)
    assert result.exit_code == 2, result.output
    assert "--run-dir" in result.stderr and "add --recheck" in result.stderr
    assert "valid:" not in result.stdout


def test_relative_paths_are_found_from_another_directory(
    certified: Certified, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative --canary / --policy are recorded as given (relative to where certify ran);
    verify finds them under the run directory's ancestors from anywhere."""
    monkeypatch.chdir(certified.work)
    out = tmp_path / "rel"
    result = invoke(
        certified.env,
        "certify",
        "run",
        "--key",
        certified.key,
        "--out",
        out,
        "--canary",
        "inputs/canary.safetensors",
        "--policy",
        "inputs/policy.toml",
    )
    assert result.exit_code == 0, result.stderr
    pred = signed_statement(json.loads((out / "certificate.json").read_text()))["predicate"]
    assert pred["policy"]["source"] == "inputs/policy.toml"
    monkeypatch.chdir(tmp_path)
    result = invoke(certified.env, "verify", out / "certificate.json", "--pubkey", f"{certified.key}.pub", "--recheck")
    assert result.exit_code == 0, result.output
    assert str(certified.canary) in result.stdout and str(certified.policy) in result.stdout


def test_a_log_added_since_is_named(certified: Certified, tmp_path: Path) -> None:
    """certify binds every log it finds, so a log the certificate does not bind was added."""
    from moeaudit.attest.certificate import sign_statement, statement
    from moeaudit.attest.signing import load_private_key
    from moeaudit.checkpoint.digest import root_digest
    from moeaudit.jsonio import dumps

    run = tmp_path / "run"
    shutil.copytree(certified.run / "checkpoint-1500", run / "checkpoint-1500")
    shutil.copy(certified.run / "events.jsonl", run / "events.jsonl")
    subject = {"name": "checkpoint-1500", "digest": {"sha256": root_digest(run / "checkpoint-1500")[0]}}
    stmt = statement(
        [subject], {"verdict": "PASS", "gates": [], "inputs": {}, "run": {"name": "run", "path": str(run)}}
    )
    cert = tmp_path / "cert.json"
    cert.write_text(dumps(sign_statement(stmt, load_private_key(certified.key)[0])))
    result = invoke(certified.env, "verify", cert, "--pubkey", f"{certified.key}.pub", "--recheck")
    assert result.exit_code == 1
    assert findings(result) == [
        f"recheck: added: {run / 'events.jsonl'} (events log): not bound by the certificate: added since certification"
    ]


def test_a_checkpoint_added_since_is_named(pristine: Certified) -> None:
    """certify audits every checkpoint directory it discovers, so one the certificate does not
    list was added since: a line each, by step (exit 1); entries certify does not take for a
    checkpoint (a file, a name with no step) are not named; two entries of one step are one line."""
    run = pristine.run
    added = [run / "step-250", run / "checkpoint-1750"]  # torchtitan's name too
    for path in added:
        shutil.copytree(SAMPLES / "resume" / "checkpoint-1000", path)
    (run / "checkpoint-2000").write_text("not a directory")
    (run / "checkpoint-1250.old").mkdir()
    try:
        result = pristine.verify("--recheck")
        (run / "checkpoint-01500").mkdir()
        twice = pristine.verify("--recheck")
    finally:
        for path in added:
            shutil.rmtree(path)
        for name in ("checkpoint-1250.old", "checkpoint-01500"):
            (run / name).rmdir()
        (run / "checkpoint-2000").unlink()
    assert result.exit_code == 1, result.output
    assert findings(result) == [
        f"recheck: added: {path} (checkpoint): not certified: a checkpoint directory added since certification"
        for path in added
    ]
    assert result.stderr == f"moeaudit: error: {pristine.cert}: 2 files added since certification (listed above)\n"
    assert twice.exit_code == 1, twice.output
    assert findings(twice)[-1] == (
        f"recheck: added: {run} (checkpoint directory): checkpoint-01500 and checkpoint-1500 are both step 1500: "
        "certify would refuse the run now"
    )
    assert pristine.verify("--recheck").exit_code == 0  # the certified run again


def test_a_checkpoint_skipped_at_certification_is_not_added(certified: Certified, tmp_path: Path) -> None:
    """A directory the certificate records as skipped (still being written then) was there."""
    from moeaudit.attest.certificate import sign_statement, statement
    from moeaudit.attest.signing import load_private_key
    from moeaudit.checkpoint.digest import root_digest
    from moeaudit.jsonio import dumps

    run = tmp_path / "run"
    shutil.copytree(certified.run / "checkpoint-1500", run / "checkpoint-1500")
    (run / "checkpoint-1750").mkdir()
    (run / "checkpoint-2000").mkdir()
    subject = {"name": "checkpoint-1500", "digest": {"sha256": root_digest(run / "checkpoint-1500")[0]}}
    record = {"name": "run", "path": str(run), "skipped": ["checkpoint-1750"]}
    stmt = statement([subject], {"verdict": "PASS", "gates": [], "inputs": {}, "run": record})
    cert = tmp_path / "cert.json"
    cert.write_text(dumps(sign_statement(stmt, load_private_key(certified.key)[0])))
    result = invoke(certified.env, "verify", cert, "--pubkey", f"{certified.key}.pub", "--recheck")
    assert result.exit_code == 1
    assert findings(result) == [
        f"recheck: added: {run / 'checkpoint-2000'} (checkpoint): not certified: a checkpoint directory added "
        "since certification"
    ]


def test_recheck_of_every_input_stays_torch_free(certified: Certified) -> None:
    from support.torch_free import _modules_after

    argv = [
        "verify",
        str(certified.cert),
        "--pubkey",
        f"{certified.key}.pub",
        "--recheck",
        "--reference",
        str(certified.reference),
    ]
    assert "torch" not in _modules_after([argv])


# ----- verify --require-verdict ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("required", "code"),
    [
        (["{v}"], 0),
        (["{v_lower}"], 0),
        (["{o1},{v}"], 0),
        (["{o1}", "{o2}"], 1),
        (["{o1},{o2}"], 1),
        (["{o2}"], 1),
    ],
)
def test_require_verdict(certified: Certified, required: list[str], code: int) -> None:
    """Spelled relative to the signed verdict (v; o1, o2 the other two), whatever it is."""
    from moeaudit.attest.certificate import VERDICTS

    verdict = signed_statement(json.loads(certified.cert.read_text()))["predicate"]["verdict"]
    o1, o2 = (v for v in VERDICTS if v != verdict)
    required = [r.format(v=verdict, v_lower=verdict.lower(), o1=o1, o2=o2) for r in required]
    args = [a for r in required for a in ("--require-verdict", r)]
    result = certified.verify(*args, reference=False)
    assert result.exit_code == code, result.output
    if code:
        wanted = " or ".join(v for r in required for v in r.split(","))
        assert result.stderr == (
            f"moeaudit: error: {certified.cert}: signed verdict {verdict} is not {wanted} (--require-verdict)\n"
        )


def test_require_verdict_refuses_an_unknown_verdict(certified: Certified) -> None:
    result = certified.verify("--require-verdict", "GREEN", reference=False)
    assert result.exit_code == 2 and "a verdict is one of PASS, FAIL, INCONCLUSIVE" in result.stderr


def test_require_verdict_after_a_bad_signature_is_still_invalid(certified: Certified, tmp_path: Path) -> None:
    envelope = json.loads(certified.cert.read_text())
    envelope["signatures"][0]["sig"] = envelope["signatures"][0]["sig"][::-1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(envelope))
    result = invoke(certified.env, "verify", bad, "--pubkey", f"{certified.key}.pub", "--require-verdict", "PASS")
    assert result.exit_code == 1 and "verdict" not in result.stdout


# ----- certify --fail-on -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verdict", "fail_on", "code"),
    [
        ("PASS", None, 0),
        ("FAIL", None, 0),
        ("INCONCLUSIVE", None, 0),
        ("PASS", "fail", 0),
        ("FAIL", "fail", 1),
        ("INCONCLUSIVE", "fail", 0),
        ("PASS", "inconclusive", 0),
        ("FAIL", "inconclusive", 1),
        ("INCONCLUSIVE", "inconclusive", 3),
    ],
)
def test_certify_fail_on(
    certified: Certified, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verdict: str, fail_on: str | None, code: int
) -> None:
    """The verdict as an exit code, after the certificate is written (the verdict is set on the
    real audit of the sample run: the exit code is the CLI's job, the verdict the judge's)."""
    import moeaudit.certify as certify_mod

    real = certify_mod.audit_run

    def with_verdict(*args, **kwargs):  # type: ignore[no-untyped-def]
        audit = real(*args, **kwargs)
        audit.statement["predicate"]["verdict"] = verdict
        return audit

    monkeypatch.setattr(certify_mod, "audit_run", with_verdict)
    out = tmp_path / "out"
    result = certified.certify(out, *(("--fail-on", fail_on) if fail_on else ()))
    assert result.exit_code == code, result.output
    assert (out / "certificate.json").is_file()  # written whatever the exit code
    assert signed_statement(json.loads((out / "certificate.json").read_text()))["predicate"]["verdict"] == verdict
    if code:
        assert result.stderr.splitlines()[-1] == (
            f"moeaudit: exit {code}: verdict {verdict} (--fail-on {fail_on}); the certificate was written"
        )


def test_fail_on_refuses_other_values(certified: Certified, tmp_path: Path) -> None:
    result = certified.certify(tmp_path / "out", "--fail-on", "yellow")
    assert result.exit_code == 2 and not (tmp_path / "out").exists()


def test_found_canary_and_policy_are_rechecked_where_certify_found_them(
    certified: Certified, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found (not named) inputs: the canary by the path in its origin ("found at P, …"), the
    policy by its source, both relative to where certify ran."""
    work = tmp_path / "w"
    shutil.copytree(certified.run / "checkpoint-1500", work / "run" / "checkpoint-1500")
    shutil.copy(certified.canary, work / "canary.safetensors")
    shutil.copy(certified.policy, work / "policy.toml")
    monkeypatch.chdir(work)
    out = tmp_path / "found"
    result = invoke(certified.env, "certify", "run", "--key", certified.key, "--out", out)
    assert result.exit_code == 0, result.stderr
    pred = signed_statement(json.loads((out / "certificate.json").read_text()))["predicate"]
    assert pred["canary"]["origin"].startswith("found at canary.safetensors, outside the audited run")
    monkeypatch.chdir(tmp_path)
    verify = ["verify", out / "certificate.json", "--pubkey", f"{certified.key}.pub", "--recheck"]
    result = invoke(certified.env, *verify)
    assert result.exit_code == 0, result.output
    (work / "canary.safetensors").write_bytes(certified.canary.read_bytes()[:-8])
    result = invoke(certified.env, *verify)
    assert result.exit_code == 1
    assert [line.split(" (")[0] for line in findings(result)] == [f"recheck: changed: {work / 'canary.safetensors'}"]


# ----- certify / gate --reference: a bad receipts file is refused before any replay ---------------


def _bad_reference(c: Certified, tmp_path: Path, case: str) -> tuple[Path, str]:
    """A reference receipts file that cannot serve, and the error it must get (after its path)."""
    bad = tmp_path / "bad-reference.json"
    raw = c.reference.read_bytes()
    doc = json.loads(raw)
    if case == "truncated":  # a copy cut short
        bad.write_bytes(raw[: len(raw) // 2])
        try:
            json.loads(raw[: len(raw) // 2].decode("utf-8"))
        except ValueError as exc:
            return bad, f"reference is neither a checkpoint directory nor receipts JSON ({exc})"
        raise AssertionError("half a receipts file parsed")
    if case == "not-receipts":  # the certificate named instead of its receipts
        shutil.copy(c.cert, bad)
        return bad, "reference JSON is not a moeaudit.receipts/v1 document"
    if case == "another-canary":
        doc["canary"]["digest"]["sha256"] = "0" * 64
        bad.write_text(json.dumps(doc))
        return bad, (
            "reference receipts were computed on another canary — "
            "recompute them with `moeaudit receipts REF --canary ...`"
        )
    experts = doc["checkpoint"]["experts"]  # another-model: receipts of a model with one more expert
    doc["checkpoint"]["experts"] = experts + 1
    bad.write_text(json.dumps(doc))
    return bad, (
        f"reference checkpoint-1500 and candidate checkpoint-1500 have different MoE structure "
        f"(experts: {experts + 1} vs {experts}) — use a healthy reference checkpoint of the same model"
    )


@pytest.mark.parametrize("command", ["certify", "gate"])
@pytest.mark.parametrize("case", ["truncated", "not-receipts", "another-canary", "another-model"])
def test_a_bad_reference_is_refused_before_any_replay(
    certified: Certified, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, case: str
) -> None:
    """One line, exit 4, nothing written, and no checkpoint replayed (nor served from the cache)
    first: the error used to come after the whole run's replay."""
    import time

    import moeaudit.certify as certify_mod

    def replayed(*_a: object, **_k: object) -> None:
        raise AssertionError("a checkpoint was replayed before the reference was checked")

    monkeypatch.setattr(certify_mod._Replayer, "receipts", replayed)
    bad, message = _bad_reference(certified, tmp_path, case)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    start = time.monotonic()
    if command == "certify":
        result = certified.certify(outputs / "cert", "--reference", bad)
    else:
        ckpts = (certified.run / "checkpoint-1250", certified.run / "checkpoint-1500")
        inputs = ("--canary", certified.canary, "--policy", certified.policy)
        result = invoke(certified.env, "gate", *ckpts, *inputs, "--reference", bad, "--junit", outputs / "j.xml")
    took = time.monotonic() - start
    assert result.exit_code == 4, result.output
    *notes, error = result.stderr.splitlines()  # notes: which policy was used
    assert error == f"moeaudit: error: {bad}: {message}"
    assert not any("error" in line or "Traceback" in line for line in notes), notes
    assert list(outputs.iterdir()) == []  # no certificate, staging directory, lock or JUnit file
    assert took < 10, took  # measured ~0.1 s; the replay it no longer waits for takes seconds
