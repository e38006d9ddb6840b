"""The shipped sample runs show what they were made to show (sample_checkpoints/README.md): certify verdicts
and gates, the CI gate's exit codes, refinement/handoff margins — computed, not read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from signed import signed_statement

from moeaudit.cli import cli

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"
pytestmark = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


@pytest.fixture(scope="module")
def env(tmp_path_factory, samples_cache) -> dict[str, str]:
    root = tmp_path_factory.mktemp("samples")
    return {"MOEAUDIT_CACHE_DIR": str(samples_cache), "XDG_CONFIG_HOME": str(root / "config")}


@pytest.fixture(scope="module")
def key(tmp_path_factory, env) -> Path:
    path = tmp_path_factory.mktemp("key") / "key"
    assert CliRunner(env=env).invoke(cli, ["keygen", "--out", str(path)]).exit_code == 0
    return path


def certify(run: str, tmp: Path, env: dict[str, str], key: Path) -> dict:
    out = tmp / run
    result = CliRunner(env=env).invoke(cli, ["certify", str(SAMPLES / run), "--key", str(key), "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    envelope = json.loads((out / "certificate.json").read_text())
    return signed_statement(envelope)["predicate"]


def statuses(pred: dict) -> list[tuple[int, str]]:
    return [(g["step"], g["status"]) for g in pred["gates"]]


def check(pred: dict, name: str) -> dict:
    return next(c for c in pred["checks"] if c["name"] == name)


def test_healthy_passes_with_every_gate_green(tmp_path, env, key) -> None:
    pred = certify("healthy", tmp_path, env, key)
    assert pred["verdict"] == "PASS"
    assert [s for _, s in statuses(pred)] == ["BASELINE"] + ["GREEN"] * (len(pred["gates"]) - 1)
    assert check(pred, "envelope")["status"] == "PASS"
    assert pred["policy"]["calibrated"] is True


def test_collapse_fails_on_occupancy_and_envelope(tmp_path, env, key) -> None:
    pred = certify("collapse", tmp_path, env, key)
    assert pred["verdict"] == "FAIL"
    last = pred["gates"][-1]
    assert last["status"] == "RED" and not last["structural"]["occupancy_ok"]
    assert last["structural"]["layers_with_more_dead"]
    assert check(pred, "envelope")["status"] == "FAIL"


def test_frozen_drift_escalates_yellow_to_red(tmp_path, env, key) -> None:
    pred = certify("frozen-drift", tmp_path, env, key)
    # 003 Table 13's Distill-640 progression was YELLOW at 500, 1000, 1500, RED at 2000. Here
    # the π_min ratio at 500 (0.44) is within the canary's noise of the 0.5 floor (the range
    # over both bootstrap intervals reaches 0.83), so 500 is GREEN; from 1000 on occupancy
    # narrows beyond noise while the canary NLL shows no change: YELLOW at 1000, 1500, 2000
    assert statuses(pred) == [(0, "BASELINE"), (500, "GREEN"), (1000, "YELLOW"), (1500, "YELLOW"), (2000, "YELLOW")]
    at_500 = pred["gates"][1]["structural"]
    assert at_500["pi_min_ratio"] < 0.5 < at_500["ratio_ci95"]["pi_min"][1]
    assert [g["scalar"] for g in pred["gates"][1:]] == ["no change"] * 4
    assert pred["verdict"] == "FAIL"
    # the training loss fell while the canary NLL stalled: the claim names the training loss
    claim = "training-loss improvement without geometric recovery"
    assert sum(any(c.startswith(claim) for c in g["claims"]["licensed"]) for g in pred["gates"]) >= 2
    assert not any("canary NLL fell" in c for g in pred["gates"] for c in g["claims"]["licensed"])
    last = pred["gates"][-1]
    assert not last["structural"]["occupancy_ok"] and last["consecutive_bad"] == 3
    assert last["structural"]["below_floor"]["π_min ratio"] == [0, 2]
    # layer 2's π_min and H_norm end below the absolute health floors: never GREEN, and said
    assert not last["health"]["ok"] and any("absolute health floor" in c for c in last["claims"]["licensed"])
    assert next(c for c in pred["checks"] if c["name"] == "health")["status"] == "FAIL"
    # the HTML gate notes give each number with the policy's threshold
    html = (tmp_path / "frozen-drift" / "certificate.html").read_text()
    assert "occupancy narrowed (π_min ratio 0.24, floor 0.5; entropy ratio 0.85, floor 0.9)" in html


def test_deepseek_certificate_names_its_biased_gate(tmp_path, env, key) -> None:
    """The deepseek_v3 run (aux-loss-free bias balancing) passes, says per layer that its gate
    is outside the atlas theorem's assumption, and its bias telemetry shows the balancer at
    work: between checkpoints the bias moves against each expert's excess load."""
    pred = certify("deepseek", tmp_path, env, key)
    assert pred["verdict"] == "PASS"
    router = pred["router"]
    assert router["bias_free_linear"] is False and "selection bias" in router["why"]
    assert [layer["layer"] for layer in router["layers"]] == [1, 2, 3]
    drift = [c["bias_drift"] for layer in router["layers"] for c in layer["checkpoints"][1:]]
    assert all(d > 0 for d in drift)
    pairs = sorted((tmp_path / "deepseek" / "receipts").glob("pair-*.json"))
    assert pairs
    for path in pairs:
        for layer in json.loads(path.read_text())["layers"]:
            assert layer["selection_bias"]["corr_delta_bias_vs_load_excess"] < 0
    receipts = json.loads((tmp_path / "deepseek" / "receipts" / "checkpoint-1500.json").read_text())
    assert all(layer["gate"]["selection_bias"]["values"] for layer in receipts["layers"])
    html = (tmp_path / "deepseek" / "certificate.html").read_text()
    assert "Router: biased or group-limited gate" in html
    out = tmp_path / "sr-11-7.md"
    result = CliRunner(env=env).invoke(
        cli,
        [
            "export",
            str(tmp_path / "deepseek" / "certificate.json"),
            "--framework",
            "sr-11-7",
            "--out",
            str(out),
            "--pubkey",
            f"{key}.pub",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "outside 003 Theorem 1's bias-free linear assumption" in out.read_text()
    healthy = certify("healthy", tmp_path, env, key)
    assert "router" not in healthy  # a bias-free softmax gate needs no such statement


def test_resume_is_a_new_baseline(tmp_path, env, key) -> None:
    pred = certify("resume", tmp_path, env, key)
    events = pred["run"]["events"]
    resume = next(e["step"] for e in events if e["event"] == "resume")
    by_step = dict(statuses(pred))
    assert by_step[resume] == "BASELINE"
    after = [g for g in pred["gates"] if g["step"] > resume]
    assert after and after[0]["baseline"] == resume and after[0]["status"] in ("GREEN", "YELLOW", "RED")
    assert (
        "any preservation claim about training after this point (needs the next gate)"
        in next(g for g in pred["gates"] if g["step"] == resume)["claims"]["not_licensed"]
    )


@pytest.mark.parametrize(
    "candidate, code",
    [
        ("sft-refine", 0),
        ("sft-repurpose", 1),
        ("collapse", 1),
    ],
)
def test_ci_gate_exit_codes(tmp_path, env, candidate: str, code: int) -> None:
    last = sorted((SAMPLES / candidate).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    junit = tmp_path / "gate.xml"
    result = CliRunner(env=env).invoke(
        cli, ["gate", str(SAMPLES / "healthy" / "checkpoint-1500"), str(last), "--junit", str(junit)]
    )
    assert result.exit_code == code, result.output + result.stderr
    assert ('failures="0"' in junit.read_text()) == (code != 1)


def test_compare_margins_on_samples(tmp_path, env) -> None:
    base = SAMPLES / "healthy" / "checkpoint-1500"
    runner = CliRunner(env=env)
    margins = {}
    for run in ("sft-refine", "sft-repurpose"):
        out = tmp_path / f"{run}.json"
        cand = SAMPLES / run / "checkpoint-1000"
        assert runner.invoke(cli, ["compare", str(base), str(cand), "--json", str(out)]).exit_code == 0
        margins[run] = json.loads(out.read_text())["margins"]["refinement"]["exact"]
    assert margins["sft-refine"] > 0 > margins["sft-repurpose"]
    out = tmp_path / "collapse.json"
    result = runner.invoke(
        cli,
        [
            "compare",
            str(base),
            str(SAMPLES / "collapse" / "checkpoint-1500"),
            "--reference",
            str(base),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0
    assert json.loads(out.read_text())["margins"]["handoff"]["exact"] < 0


def test_a_policy_calibrated_on_the_canary_probe_gates_on_it(tmp_path, env, key) -> None:
    """calibrate --source probe on healthy → a policy whose envelope reads canary_probe.jsonl:
    healthy complies, collapse does not, in `envelope` and in `certify`."""
    policy = tmp_path / "probe-policy.toml"
    result = CliRunner(env=env).invoke(
        cli,
        [
            "calibrate",
            str(SAMPLES / "healthy"),
            "--source",
            "probe",
            "--variant",
            "normalized",
            "--since",
            "200",
            "--out",
            str(policy),
        ],
    )
    assert result.exit_code == 0, result.output + result.stderr
    assert 'source = "probe"' in policy.read_text()
    for run, code in (("healthy", 0), ("collapse", 1)):
        out = tmp_path / f"{run}-envelope.json"
        result = CliRunner(env=env).invoke(
            cli, ["envelope", str(SAMPLES / run), "--policy", str(policy), "--json", str(out)]
        )
        assert result.exit_code == code, result.output + result.stderr
        assert json.loads(out.read_text())["source"] == "probe"
        cert = tmp_path / f"{run}-cert"
        result = CliRunner(env=env).invoke(
            cli, ["certify", str(SAMPLES / run), "--policy", str(policy), "--key", str(key), "--out", str(cert)]
        )
        assert result.exit_code == 0, result.stderr
        pred = signed_statement(json.loads((cert / "certificate.json").read_text()))
        assert check(pred["predicate"], "envelope")["status"] == ("PASS" if code == 0 else "FAIL")
        assert pred["predicate"]["envelope"]["source"] == "probe"


def _readme_verdicts() -> list[list[str]]:
    """The rows of sample_checkpoints/README.md's verdict table: run, gates, health, envelope,
    refinement, verdict."""
    text = (SAMPLES / "README.md").read_text(encoding="utf-8")
    table = text.split("| run | gates | health | envelope | refinement | verdict |", 1)[1].split("\n\n", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()[1:]]


@pytest.mark.parametrize("row", _readme_verdicts(), ids=lambda row: row[0])
def test_the_readme_verdict_table_is_what_certify_says(tmp_path, env, key, row: list[str]) -> None:
    run, gates, health, envelope, refinement, verdict = row
    pred = certify(run, tmp_path, env, key)
    assert " ".join(s[0] for _, s in statuses(pred)) == gates
    assert verdict == f"**{pred['verdict']}**"
    for cell, name in ((health, "health"), (envelope, "envelope"), (refinement, "refinement")):
        c = check(pred, name)
        shown = c["status"] if c["evaluated"] else "reported" if c.get("value") is not None else "n/e"
        assert cell.split(" ")[0] == shown, (name, c["reason"])
