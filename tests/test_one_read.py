"""Every input is parsed from the bytes that are hashed (docs/security.md, "One read per input").

A certificate signs, next to each input's SHA-256, numbers and statements taken from that input:
the events and stage (events.jsonl), the training losses and the envelope (metrics.jsonl), the
policy's settings (the policy file) and the handoff margin (a ``--reference`` receipts file).
Were the digest taken from a second read, a file renamed over another while the checkpoints are
replayed would give a certificate that signs one file's content beside the other's digest.

The test runs a real ``moeaudit certify`` and, when its first replay starts (a progress line on
stderr), stops it, renames a B version over every input (the run's three logs, the policy and
the reference) and lets it go on. Two control certificates, of all-A and all-B inputs, say what
each input's content puts in a certificate; in the swapped one, each signed part must be the
one of the version whose digest is signed beside it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from signed import signed_statement

from moeaudit.cli import cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
pytestmark = pytest.mark.skipif(not (SAMPLES / "resume").is_dir(), reason="sample runs not built")
LOGS = ("events", "metrics", "probe")
FILES = {"events": "events.jsonl", "metrics": "metrics.jsonl", "probe": "canary_probe.jsonl"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _b_metrics(text: str) -> str:
    """Other training losses and norms: every loss + 1, every norm × 2 (still float32-exact)."""
    out = []
    for line in text.splitlines():
        obj = json.loads(line)
        for loss in ("loss", "lm_loss"):
            if isinstance(obj.get(loss), float):
                obj[loss] += 1.0
        obj["expert_grad_norms"] = {k: [2 * g for g in v] for k, v in obj["expert_grad_norms"].items()}
        out.append(json.dumps(obj))
    return "\n".join(out) + "\n"


def _b_events(text: str) -> str:
    return "\n".join(json.dumps({**json.loads(line), "note": "B"}) for line in text.splitlines()) + "\n"


def _b_probe(text: str) -> str:
    return _b_metrics(text)


def _args(run: Path, out: Path, files: dict[str, Path], key: Path, *extra: str) -> list[str]:
    return [
        "certify",
        str(run),
        "--key",
        str(key),
        "--out",
        str(out),
        "--canary",
        str(SAMPLES / "canary.safetensors"),
        "--policy",
        str(files["policy"]),
        "--reference",
        str(files["reference"]),
        *extra,
    ]


def _predicate(out: Path) -> dict[str, Any]:
    return signed_statement(json.loads((out / "certificate.json").read_text()))["predicate"]


def _part(pred: dict[str, Any], name: str) -> Any:
    """What the certificate takes from input ``name``."""
    if name == "events":
        return pred["run"]["events"]
    if name == "metrics":  # the envelope without its origin (the log's path differs between runs)
        envelope = {k: v for k, v in (pred["envelope"] or {}).items() if k != "origin"}
        return [(g["step"], g["receipts"]["training_loss"]) for g in pred["gates"]], envelope
    if name == "policy":
        return {k: v for k, v in pred["policy"].items() if k not in ("source", "origin")}
    if name == "reference":
        return pred["margins"]["handoff"]
    return None  # the probe: bound, not parsed unless the envelope's source is "probe"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, samples_cache: Path) -> dict[str, Any]:
    from moeaudit.attest.signing import generate_key

    work = tmp_path_factory.mktemp("one-read")
    env = {**os.environ, "MOEAUDIT_CACHE_DIR": str(samples_cache), "OMP_NUM_THREADS": "1"}
    key = work / "key"
    generate_key(key)
    variants: dict[str, dict[str, Path]] = {}
    for v in "AB":
        run = work / f"run-{v}"
        run.mkdir()
        for step in (1250, 1500):
            shutil.copytree(SAMPLES / "resume" / f"checkpoint-{step}", run / f"checkpoint-{step}")
        files = {name: run / FILES[name] for name in LOGS}
        for name, change in (("events", _b_events), ("metrics", _b_metrics), ("probe", _b_probe)):
            text = (SAMPLES / "resume" / FILES[name]).read_text()
            files[name].write_text(change(text) if v == "B" else text)
        files["policy"] = work / f"policy-{v}.toml"
        # constants for any model, so that the envelope is evaluated on this run's log
        policy = re.sub(
            r'(?m)^calibrated_model = ".*"$', 'calibrated_model = ""', (SAMPLES / "policy.toml").read_text()
        )
        files["policy"].write_text(policy if v == "A" else policy.replace("nll_tol = 0.001", "nll_tol = 0.002"))
        variants[v] = {"run": run, **files}
    assert variants["A"]["policy"].read_text() != variants["B"]["policy"].read_text()
    first = CliRunner(env=env).invoke(
        cli,
        _args(
            variants["A"]["run"],
            work / "first",
            {"policy": variants["A"]["policy"], "reference": SAMPLES / "policy.toml"},
            key,
        )[:-2],
    )
    assert first.exit_code == 0, first.stderr
    for v, step in (("A", 1500), ("B", 1250)):  # two receipts files: two handoff margins
        variants[v]["reference"] = work / f"reference-{v}.json"
        shutil.copy(work / "first" / "receipts" / f"checkpoint-{step}.json", variants[v]["reference"])
    controls = {}
    for v in "AB":
        result = CliRunner(env=env).invoke(cli, _args(variants[v]["run"], work / f"out-{v}", variants[v], key))
        assert result.exit_code == 0, result.stderr
        controls[v] = _predicate(work / f"out-{v}")
    for name in ("events", "metrics", "policy", "reference"):
        assert _part(controls["A"], name) != _part(controls["B"], name), name  # each B is visible
    assert controls["A"]["envelope"] and controls["A"]["envelope"] != controls["B"]["envelope"]
    return {"work": work, "env": env, "key": key, "variants": variants, "controls": controls}


def test_an_input_swapped_mid_replay_is_signed_with_its_own_content(setup: dict[str, Any]) -> None:
    work, variants, controls = setup["work"], setup["variants"], setup["controls"]
    run = work / "run-swapped"
    shutil.copytree(variants["A"]["run"], run)
    a = {name: (run / FILES[name]) if name in FILES else work / f"swapped-{name}" for name in (*LOGS, "policy")}
    a["reference"] = work / "swapped-reference.json"
    for name in ("policy", "reference"):
        shutil.copy(variants["A"][name], a[name])
    b = {}
    for name, path in a.items():  # each B beside its A, ready to be renamed over it
        b[name] = path.with_name(path.name + ".B")
        shutil.copy(variants["B"][name], b[name])
    digests = {v: {name: _sha(variants[v][name]) for name in a} for v in "AB"}
    out = work / "out-swapped"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeaudit", *_args(run, out, a, setup["key"], "--no-cache")],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=setup["env"],
    )
    assert proc.stderr is not None
    swapped = False
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("replaying ") and not swapped:
            proc.send_signal(signal.SIGSTOP)  # hold it inside the first replay while we swap
            for name in a:
                os.replace(b[name], a[name])
            swapped = True
            proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=120) == 0, "".join(lines)
    assert swapped, "".join(lines)
    pred = _predicate(out)
    key = {
        "events": "events",
        "metrics": "metrics",
        "probe": "probe",
        "policy": "policy_file",
        "reference": "reference",
    }
    for name in a:
        signed = pred["inputs"][key[name]]["sha256"]
        version = next((v for v in "AB" if digests[v][name] == signed), None)
        assert version is not None, f"{name}: the signed digest is of neither version"
        assert _part(pred, name) == _part(controls[version], name), (
            f"{name}: the certificate signs version {version}'s digest beside the other version's content"
        )
    # every input was read before the replays, a receipts reference too (checked before any replay)
    assert {n: digests["A"][n] == pred["inputs"][key[n]]["sha256"] for n in a} == {
        "events": True,
        "metrics": True,
        "probe": True,
        "policy": True,
        "reference": True,
    }
    # the files now on disk are the B versions: recheck names each one the certificate did not read
    result = CliRunner(env=setup["env"]).invoke(
        cli,
        [
            "verify",
            str(out / "certificate.json"),
            "--pubkey",
            f"{setup['key']}.pub",
            "--recheck",
            "--policy",
            str(a["policy"]),
            "--reference",
            str(a["reference"]),
        ],
    )
    assert result.exit_code == 1, result.stdout
    changed = {
        line.split(" (")[0].removeprefix("recheck: changed: ")
        for line in result.stdout.splitlines()
        if line.startswith("recheck: changed: ")
    }
    assert changed == {str(a[n]) for n in ("events", "metrics", "probe", "policy", "reference")}, result.stdout
