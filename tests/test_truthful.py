"""Every signed sentence agrees with the numbers it names; one decision path; no PASS
without evidence. One test (or more) per claim, on the real sample runs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from signed import signed_statement

from moeaudit.canary import load
from moeaudit.certify import audit_run
from moeaudit.cli import cli
from moeaudit.errors import InputError
from moeaudit.judge import envelope as env
from moeaudit.judge.decide import Evidence, decide, envelope_check, margin_status
from moeaudit.judge.gates import nll_change, scalar_trend
from moeaudit.metrics import read_metrics
from moeaudit.policy import EnvelopeSettings, load_policy, policy_from_dict

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
RUNS = ("healthy", "collapse", "frozen-drift", "sft-refine", "sft-repurpose", "resume", "deepseek")

pytestmark = pytest.mark.skipif(not (SAMPLES / "healthy").is_dir(), reason="sample runs not built")


@pytest.fixture(scope="module")
def cache_dir(samples_cache: Path) -> Path:
    return samples_cache


@pytest.fixture(scope="module")
def canary():
    return load(SAMPLES / "canary.safetensors")


@pytest.fixture(scope="module")
def policy():
    return load_policy(SAMPLES / "policy.toml")


@pytest.fixture(scope="module")
def audits(cache_dir: Path, canary, policy) -> dict[str, Any]:
    """Every sample run certified once (receipts and pairs then come from the cache)."""
    from moeaudit.cache import ReceiptsCache

    cache = ReceiptsCache(cache_dir)
    return {run: audit_run(SAMPLES / run, canary, policy, cache=cache) for run in RUNS}


def _audit(path: Path, canary, policy, cache_dir: Path, **kw: Any):
    from moeaudit.cache import ReceiptsCache

    return audit_run(path, canary, policy, cache=ReceiptsCache(cache_dir), **kw)


def _gates(audit) -> dict[int, dict[str, Any]]:
    return {g["step"]: g for g in audit.statement["predicate"]["gates"]}


# --- 1. the trend and its claims name the canary NLL ---------------------------------------------


def test_sft_refine_canary_nll_rose_and_the_claims_say_so(audits) -> None:
    gates = _gates(audits["sft-refine"])
    for step in (250, 500):
        g = gates[step]
        assert g["receipts"]["nll"] > gates[step - 250]["receipts"]["nll"]
        assert g["scalar"] == "worsening"
        assert not any("canary NLL fell" in c for c in g["claims"]["licensed"])
        assert any(c.startswith("canary NLL worsening beyond noise: rose") for c in g["claims"]["licensed"])
    assert gates[500]["nll_change"]["from"] == pytest.approx(0.7319, abs=1e-4)
    assert gates[500]["nll_change"]["to"] == pytest.approx(0.7634, abs=1e-4)


def test_healthy_and_collapse_1250_fell_and_are_not_called_worsening(audits) -> None:
    for run in ("healthy", "collapse"):
        g = _gates(audits[run])[1250]
        assert g["nll_change"]["delta"] < 0 and g["scalar"] == "improving"


def test_sft_repurpose_500_rose_and_is_not_improving(audits) -> None:
    g = _gates(audits["sft-repurpose"])[500]
    assert (g["nll_change"]["from"], g["nll_change"]["to"]) == pytest.approx((4.983, 6.344), abs=1e-3)
    assert g["scalar"] == "worsening"


def test_no_change_is_a_change_inside_tolerance_or_noise() -> None:
    prev = {"nll": 1.0, "nll_windows": [1.0, 1.2, 0.8, 1.0]}
    noisy = {"nll": 0.99, "nll_windows": [1.1, 1.0, 0.9, 0.96]}  # −0.01 on average, ±0.1 per window
    change = nll_change(prev, noisy, 1000, 0)
    assert change["ci95"][0] < 0 < change["ci95"][1]
    assert scalar_trend(change, 1e-3) == "no change"
    steady = {"nll": 0.99, "nll_windows": [0.99, 1.19, 0.79, 0.99]}  # −0.01 in every window
    assert scalar_trend(nll_change(prev, steady, 1000, 0), 1e-3) == "improving"
    assert scalar_trend(nll_change(prev, steady, 1000, 0), 0.05) == "no change"


def test_compare_prints_the_claim_its_numbers_license() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "compare",
            str(SAMPLES / "sft-repurpose" / "checkpoint-0"),
            str(SAMPLES / "sft-repurpose" / "checkpoint-1000"),
        ],
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "canary NLL worsening beyond noise: rose from 0.7007 to 6.6152" in text
    assert "objective improved" not in text and "canary NLL improved" not in text


CLAIM = re.compile(
    r"canary NLL (?:improving|worsening) beyond noise: (fell|rose) from (\d+\.\d+) to "
    r"(\d+\.\d+) \(Δ ([+-]\d+\.\d+)"
)
NO_CHANGE = re.compile(
    r"canary NLL: no change beyond tolerance and bootstrap noise, from (\d+\.\d+) to "
    r"(\d+\.\d+) \(Δ ([+-]\d+\.\d+)"
)


@pytest.mark.parametrize("run", RUNS)
def test_every_claim_sentence_agrees_in_sign_with_its_receipts(audits, run: str) -> None:
    """Property over every sample certificate: a sentence naming canary NLL carries the two
    receipts' values and a direction that matches their difference; no sentence about the
    canary rests on the training loss."""
    gates = audits[run].statement["predicate"]["gates"]
    seen = 0
    for prev, g in zip(gates, gates[1:], strict=False):
        for sentence in g["claims"]["licensed"] + g["claims"]["not_licensed"]:
            for verb, a, b, delta in CLAIM.findall(sentence):
                seen += 1
                assert float(a) == pytest.approx(prev["receipts"]["nll"], abs=5e-5)
                assert float(b) == pytest.approx(g["receipts"]["nll"], abs=5e-5)
                assert (verb == "fell") == (float(b) < float(a)) == (float(delta) < 0)
            for _a, b, _delta in NO_CHANGE.findall(sentence):
                seen += 1
                assert g["scalar"] == "no change" and float(b) == pytest.approx(g["receipts"]["nll"], abs=5e-5)
            assert "did not fall" not in sentence and "stalling" not in sentence
            if "training loss" in sentence and "canary" in sentence:
                assert "not the canary" in sentence or "canary NLL: " in sentence
        if g["scalar"] == "improving":
            assert g["nll_change"]["ci95"][1] < 0 and g["receipts"]["nll"] < prev["receipts"]["nll"]
        if g["scalar"] == "worsening":
            assert g["nll_change"]["ci95"][0] > 0 and g["receipts"]["nll"] > prev["receipts"]["nll"]
    assert seen >= len(gates) - 1  # every gate after the first names its canary NLL change


# --- 2. no PASS without evidence -----------------------------------------------------------------


def _run_of(
    tmp: Path, run: str, steps: list[int], events: list[dict[str, Any]] | None = None, logs: bool = True
) -> Path:
    out = tmp / f"{run}-{'-'.join(map(str, steps))}"
    out.mkdir()
    for s in steps:
        shutil.copytree(SAMPLES / run / f"checkpoint-{s}", out / f"checkpoint-{s}")
    for name in ("metrics.jsonl", "canary_probe.jsonl", "events.jsonl"):
        if logs and (SAMPLES / run / name).is_file():
            shutil.copy(SAMPLES / run / name, out / name)
    if events is not None:
        (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return out


def test_one_collapsed_checkpoint_is_not_a_pass(tmp_path, canary, policy, cache_dir) -> None:
    audit = _audit(_run_of(tmp_path, "collapse", [1500]), canary, policy, cache_dir)
    pred = audit.statement["predicate"]
    assert pred["verdict"] == "FAIL"
    checks = {c["name"]: c for c in pred["checks"]}
    assert checks["health"]["status"] == "FAIL" and "dead expert" in checks["health"]["reason"]
    assert checks["comparison"]["status"] == "INCONCLUSIVE"


def test_one_healthy_checkpoint_is_baseline_only_not_pass(tmp_path, canary, policy, cache_dir) -> None:
    pred = _audit(_run_of(tmp_path, "healthy", [1500]), canary, policy, cache_dir).statement["predicate"]
    assert pred["verdict"] == "INCONCLUSIVE" and "comparison inconclusive" in pred["verdict_reason"]
    comparison = next(c for c in pred["checks"] if c["name"] == "comparison")
    assert comparison["basis"] == "baseline-only"


def test_resumes_at_every_checkpoint_do_not_turn_collapse_into_pass(tmp_path, canary, policy, cache_dir) -> None:
    steps = [250, 500, 750, 1000, 1250, 1500]
    events = [{"step": s, "event": "resume", "note": "restarted"} for s in steps[1:]]
    pred = _audit(_run_of(tmp_path, "collapse", steps, events), canary, policy, cache_dir).statement["predicate"]
    assert pred["verdict"] == "FAIL"
    gates = pred["gates"]
    assert all(g.get("new_baseline") for g in gates)
    assert all("continuity" in g for g in gates[1:])  # each still compared with the one before
    assert next(c for c in pred["checks"] if c["name"] == "health")["status"] == "FAIL"


def test_a_resume_cannot_erase_a_regression(tmp_path, canary, policy, cache_dir) -> None:
    """frozen-drift with a resume declared at its worst checkpoint: still bad there (YELLOW,
    as without the resume: its fourth gate is its third bad one), and the run still FAILs."""
    events = [
        {"step": 0, "event": "regime_change", "note": "sft", "stage": "post-training"},
        {"step": 2000, "event": "resume", "note": "restarted"},
    ]
    pred = _audit(
        _run_of(tmp_path, "frozen-drift", [0, 500, 1000, 1500, 2000], events), canary, policy, cache_dir
    ).statement["predicate"]
    last = pred["gates"][-1]
    assert last["new_baseline"] and last["status"] == "YELLOW" and last["consecutive_bad"] == 3
    assert not last["continuity"]["ok"] and last["continuity"]["against"] == "checkpoint-0"
    assert pred["verdict"] == "FAIL"


def test_envelope_reason_with_two_checkpoints_names_the_real_cause(tmp_path, canary, cache_dir) -> None:
    policy = policy_from_dict({"envelope": {"source": "logs"}})
    run = _run_of(tmp_path, "healthy", [1250, 1500], logs=False)
    pred = _audit(run, canary, policy, cache_dir).statement["predicate"]
    check = next(c for c in pred["checks"] if c["name"] == "envelope")
    # the policy's logs are absent: never "not evaluated" (a pass by omission); the built-in
    # rules are evaluated on the two checkpoints' replays instead, and the reason says so
    assert check["evaluated"] and "fewer than two checkpoints" not in check["reason"]
    assert "does not apply here" in check["reason"] and "metrics.jsonl" in check["reason"]
    assert pred["envelope"]["source"] == "replay" and pred["envelope"]["window"] == {"from": 1250, "to": 1500}


# --- 3. a falsifiable envelope -------------------------------------------------------------------


def _starved_metrics(path: Path, steps: range) -> Path:
    lines = [
        json.dumps(
            {"step": s, "loss": 1.0, "expert_grad_norms": {str(layer): [1.0] + [1e-5] * 7 for layer in range(4)}}
        )
        for s in steps
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_shipped_policy_rejects_one_expert_carrying_the_gradient(tmp_path, policy) -> None:
    series = env.from_metrics(read_metrics(_starved_metrics(tmp_path / "m.jsonl", range(200, 1510, 10))), "normalized")
    report = env.evaluate(series, policy.envelope)
    assert not report["compliant"]
    assert report["constants"]["budget"] < (8 - 1) / 2  # ε/δ well below the largest V, E − 1
    assert report["starvation"] and {s["layer"] for s in report["starvation"]} == {"0", "1", "2", "3"}
    assert envelope_check(report, None)["status"] == "FAIL"


def test_calibration_is_falsifiable_and_infers_the_warmup(tmp_path) -> None:
    out = tmp_path / "policy.toml"
    result = CliRunner().invoke(cli, ["calibrate", str(SAMPLES / "healthy"), "--out", str(out)])
    assert result.exit_code == 0, result.output + result.stderr
    assert "learning-rate peak at step 100" in result.stderr
    fitted = load_policy(out).envelope
    assert fitted.warmup_steps == 100 and 2 <= fitted.calibration_c <= 5
    assert fitted.window >= 3 / fitted.delta  # 000 Eq. 17
    healthy = env.from_metrics(read_metrics(SAMPLES / "healthy" / "metrics.jsonl"), "normalized").since(100)
    check = env.falsifiability(healthy, fitted)
    assert check["known_bad_rejected"] and check["budget"] < 7
    assert env.evaluate(healthy, fitted)["compliant"]


def test_a_vacuous_fit_is_reported_as_such(policy) -> None:
    healthy = env.from_metrics(read_metrics(SAMPLES / "healthy" / "metrics.jsonl"), "normalized").since(200)
    loose = EnvelopeSettings(variant="normalized", delta=0.01, epsilon=0.4, starve_share=0.0, sampling_interval=10)
    check = env.falsifiability(healthy, loose)
    assert not check["known_bad_rejected"] and check["variance_side_falsifiable"] is False


def test_policy_refuses_a_window_shorter_than_three_time_constants() -> None:
    with pytest.raises(InputError, match="3/δ"):
        policy_from_dict({"envelope": {"delta": 0.001, "window": 1000}})


# --- 4. gate and certify agree -------------------------------------------------------------------


def _pairs() -> list[tuple[str, int, int]]:
    out = []
    for run in RUNS:
        steps = sorted(int(p.name.split("-")[1]) for p in (SAMPLES / run).glob("checkpoint-*"))
        out += [(run, steps[0], s) for s in steps[1:]]
    return out


@pytest.mark.slow
def test_gate_promotes_what_certify_passes_within_one_run(tmp_path, cache_dir) -> None:
    env_ = {"MOEAUDIT_CACHE_DIR": str(cache_dir)}
    result = CliRunner(env=env_).invoke(
        cli,
        [
            "gate",
            str(SAMPLES / "healthy" / "checkpoint-250"),
            str(SAMPLES / "healthy" / "checkpoint-1500"),
            "--json",
            str(tmp_path / "g.json"),
        ],
    )
    assert result.exit_code == 0, result.output + result.stderr
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["decision"] == "PROMOTE" and doc["stage"] == "pretraining"
    envelope = doc["envelope"]
    # the whole bound log up to the candidate (after the policy's warm-up), not only the
    # steps after the first kept checkpoint: rotated-away checkpoints do not shorten it
    assert envelope["window"]["from"] < 250 and envelope["window"]["to"] == 1500
    # the same two checkpoints as a post-training promotion: refinement is gated and holds it
    result = CliRunner(env=env_).invoke(
        cli,
        [
            "gate",
            str(SAMPLES / "healthy" / "checkpoint-250"),
            str(SAMPLES / "healthy" / "checkpoint-1500"),
            "--stage",
            "post-training",
        ],
    )
    assert result.exit_code == 1 and "refinement" in result.output


# --- 5. margins are intervals -------------------------------------------------------------------


def test_handoff_on_healthy_is_inconclusive_not_a_coin_flip(audits, policy) -> None:
    from moeaudit.margins import handoff

    docs = {
        int(n.split("-")[1].split(".")[0]): d
        for n, d in audits["healthy"].receipts.items()
        if n.startswith("checkpoint-")
    }
    protected = audits["healthy"].statement["predicate"]["protected_layers"]
    statuses = []
    for cand in (1000, 1250, 1500):
        for ref in (1000, 1250, 1500):
            if cand != ref:
                m = handoff(docs[cand], docs[ref], protected, policy.margins)
                assert m["ci95"][0] <= m["exact"] <= m["ci95"][1]
                statuses.append(margin_status(m, policy.gates.inconclusive_band))
    assert statuses.count("FAIL") == 0  # healthy checkpoints never "fail" each other's handoff
    assert "INCONCLUSIVE" in statuses


def test_separate_betas_keep_the_smooth_margin_defined_for_many_experts() -> None:
    from moeaudit.margins import beta_pi, pi_tail

    m = policy_from_dict({}).margins
    E, k = 64, 2
    balanced = [k / E] * E
    assert pi_tail(balanced, m.beta_h) <= 0  # one β = 50 for everything: undefined
    assert pi_tail(balanced, beta_pi(m, E, k)) >= 0.9 * k / E
    with pytest.raises(InputError, match="split into beta_pi"):
        policy_from_dict({"margins": {"beta": 50.0}})


def test_a_margin_whose_interval_straddles_zero_is_inconclusive() -> None:
    assert margin_status({"exact": 0.1, "ci95": [-0.05, 0.25]}, 0.01) == "INCONCLUSIVE"
    assert margin_status({"exact": 0.1, "ci95": [0.02, 0.18]}, 0.01) == "PASS"
    assert margin_status({"exact": -0.1, "ci95": [-0.18, -0.02]}, 0.01) == "FAIL"
    assert margin_status({"exact": 0.005, "ci95": None}, 0.01) == "INCONCLUSIVE"


# --- 6. the page shows the check that decided -------------------------------------------------


def test_html_names_the_deciding_envelope_check(tmp_path, cache_dir) -> None:
    from moeaudit.report.html import render_html

    env_ = {"MOEAUDIT_CACHE_DIR": str(cache_dir), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    out = tmp_path / "out"
    result = CliRunner(env=env_).invoke(cli, ["certify", str(SAMPLES / "collapse"), "--out", str(out)])
    assert result.exit_code == 0, result.output + result.stderr

    stmt = signed_statement(json.loads((out / "certificate.json").read_text()))
    check = next(c for c in stmt["predicate"]["checks"] if c["name"] == "envelope")
    assert check["status"] == "FAIL"
    html = render_html(stmt, keyid="k", envelope_sha256="0" * 64)
    fv = stmt["predicate"]["envelope"]["first_violation"]
    assert fv["check"] in ("discrete", "starvation")
    assert check["reason"].replace("—", "&mdash;")[:40] in html or check["reason"][:40] in html
    assert "EXCEEDED" in html or "STARVED" in html  # the per-series row shows the failing check
    assert "negative is below the random-partner reference" not in html


def test_sigmoid_router_boundary_mass_uses_score_units(audits) -> None:
    doc = audits["deepseek"].receipts["checkpoint-1500.json"]
    for entry in doc["layers"]:
        b = entry["boundary"]
        assert "σ'(0)" in b["boundary_mass_units"]
        assert b["boundary_mass"]["0.1"] < 0.6  # a logit grid on sigmoid scores gave 0.92
    healthy = audits["healthy"].receipts["checkpoint-1500.json"]
    assert all("boundary_mass_units" not in e["boundary"] for e in healthy["layers"])


# --- 7. every input the verdict used is bound ----------------------------------------------------


def test_inputs_and_drifts_are_in_the_signed_predicate(audits) -> None:
    import hashlib

    pred = audits["resume"].statement["predicate"]
    for name, file in (
        ("metrics", "metrics.jsonl"),
        ("events", "events.jsonl"),
        ("probe", "canary_probe.jsonl"),
        ("policy_file", None),
    ):
        assert name in pred["inputs"]
        path = SAMPLES / "resume" / file if file else Path(pred["policy"]["source"])
        assert pred["inputs"][name]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    compared = [g for g in pred["gates"] if "structural" in g or "continuity" in g]
    assert compared and all(
        set(g["drift"]["layers"][0]) >= {"coordinate", "boundary", "transition", "content"} for g in compared
    )


def test_the_handoff_reference_is_digested(tmp_path, canary, policy, cache_dir) -> None:
    ref = SAMPLES / "healthy" / "checkpoint-1500"
    pred = _audit(_run_of(tmp_path, "healthy", [1250, 1500]), canary, policy, cache_dir, reference=ref).statement[
        "predicate"
    ]
    from moeaudit.checkpoint.digest import root_digest

    assert pred["inputs"]["reference"]["root_sha256"] == root_digest(ref)[0]


# --- design: the decision half is torch-free ----------------------------------------------------


def test_decision_and_report_modules_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import moeaudit.judge.decide, moeaudit.judge.gates, moeaudit.margins, "
        "moeaudit.judge.envelope, moeaudit.policy, moeaudit.judge.promote, "
        "moeaudit.report.html, moeaudit.report.ci, moeaudit.report.export, moeaudit.attest.certificate, "
        "moeaudit.attest.signing; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_decide_is_the_only_verdict(audits) -> None:
    """Re-deciding a certificate's own evidence reproduces its verdict and checks."""
    for run in RUNS:
        pred = audits[run].statement["predicate"]
        ev = Evidence(
            stage=pred["run"]["stage"],
            gates=pred["gates"],
            margins=pred["margins"],
            envelope=pred["envelope"],
            envelope_reason=next(c["reason"] for c in pred["checks"] if c["name"] == "envelope"),
            band=pred["policy"]["gates"]["inconclusive_band"],
        )
        again = decide(ev)
        assert again["verdict"] == pred["verdict"], run
        assert [c["status"] for c in again["checks"]] == [c["status"] for c in pred["checks"]], run


def test_margin_intervals_are_paired_bootstraps_and_narrower(audits, policy) -> None:
    """The receipts carry bootstrap replicates drawn on the same windows at every checkpoint, so a
    margin's interval is a paired bootstrap of the margin itself; sft-refine's refinement is then
    certified (its interval excludes 0), which the independent-terms interval could not do."""
    from moeaudit.margins import INDEPENDENT, PAIRED, refinement

    pred = audits["sft-refine"].statement["predicate"]
    r = pred["margins"]["refinement"]
    assert r["ci_method"] == PAIRED and 0 < r["ci95"][0] <= r["exact"] <= r["ci95"][1]
    assert next(c for c in pred["checks"] if c["name"] == "refinement")["status"] == "PASS"
    docs = audits["sft-refine"].receipts
    base, cand = docs["checkpoint-0.json"], docs["checkpoint-1000.json"]
    drift = {e["layer"]: e["drift"] for e in docs["pair-1000-vs-0.json"]["layers"]}
    protected = pred["protected_layers"]
    stripped = {k: {kk: vv for kk, vv in v.items() if kk != "replicates"} for k, v in drift.items()}
    loose = refinement(base, cand, stripped, protected, policy.margins)  # no replicates: fallback
    assert loose["ci_method"] == INDEPENDENT and loose["exact"] == r["exact"]
    assert loose["ci95"][0] < 0 < loose["ci95"][1]  # the conservative interval straddles 0
    assert (r["ci95"][1] - r["ci95"][0]) < 0.6 * (loose["ci95"][1] - loose["ci95"][0])
