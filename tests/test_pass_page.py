"""A PASS certificate that agrees with itself, on a run of one's own under the built-in policy.

A small healthy run trained here (mixtral layout, 4 experts, a plain torch loop with moeaudit's
recorder, raw gradient variance far above 000 Table 6's illustrative ε = 1e-5): certify PASSes
it, and the variance bound those constants give is reported, not gated. Every surface says so
and none of them says "not compliant": the signed predicate (``envelope.compliant`` is the gated
rules, ``variance_gated``/``variance_within_bound`` name the reported quantity), the HTML page
(neutral pills and marks, a banner naming the policy), the exports and ``moeaudit envelope``
(exit 0, as certify's envelope check).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
import fresh_runs as fresh  # noqa: E402
from signed import signed_statement  # noqa: E402

from moeaudit.cli import cli  # noqa: E402

RECIPE = fresh.Recipe("healthy", loop="torch", seed=13, steps=240, save_every=60, aux_coef=0.02)
BAD = "#b42318"  # charts.BAD: the colour of a failure


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pass-page")
    env = {"MOEAUDIT_CACHE_DIR": str(root / "cache"), "XDG_CONFIG_HOME": str(root / "config")}
    with fresh.one_thread():
        run = fresh.train(RECIPE, root / "run")
    canary = root / "canary.safetensors"  # outside the run: found without --canary
    canary.write_bytes((run / "canary.safetensors").read_bytes())
    (run / "canary.safetensors").unlink()
    runner = CliRunner(env=env)
    assert runner.invoke(cli, ["keygen", "--out", str(root / "key")]).exit_code == 0
    out = root / "cert"
    result = runner.invoke(cli, ["certify", str(run), "--key", str(root / "key"), "--out", str(out)])
    assert result.exit_code == 0, result.output + result.stderr
    return {"root": root, "run": run, "out": out, "env": env, "stdout": result.output, "stderr": result.stderr}


def _pred(c: dict[str, Any]) -> dict[str, Any]:
    return signed_statement(json.loads((c["out"] / "certificate.json").read_text()))["predicate"]


def test_the_predicate_agrees_with_its_check(certified: dict[str, Any]) -> None:
    pred = _pred(certified)
    assert pred["verdict"] == "PASS", pred["verdict_reason"]
    assert pred["policy"]["source"] == "built-in default" and not pred["policy"]["calibrated"]
    check = next(c for c in pred["checks"] if c["name"] == "envelope")
    env = pred["envelope"]
    assert check["status"] == "PASS" and env["compliant"] is True  # was false beside a PASS
    # the case at issue: the series leaves the illustrative bound, and that is named as reported
    assert env["variance_gated"] is False and env["variance_within_bound"] is False
    assert "variance_compliant" not in env


def test_the_html_page_shows_the_reported_bound_in_neutral_style(certified: dict[str, Any]) -> None:
    html = (certified["out"] / "certificate.html").read_text()
    section = html[html.index('<section id="envelope">') : html.index('<section id="occupancy">')]
    for wrong in ("NOT COMPLIANT", "leaves the envelope", "OUTSIDE</span>", "EXCEEDED</span>", "b-fail", BAD):
        assert wrong not in section, wrong
    assert "REPORTED, NOT GATED</span> above the illustrative bound" in section
    assert "ABOVE, REPORTED</span>" in section and "above the bound (reported, not gated)" in section
    assert "above the illustrative variance bound (reported, not gated); no expert starved" in section
    banner = html[html.index('<header class="verdict') : html.index("</header>")]
    assert "<dt>Policy</dt><dd>built-in default, uncalibrated" in banner
    assert "C2 higher is better" not in html and "higher is better; negative" not in html


@pytest.mark.parametrize(("framework", "cites"), [("eu-ai-act", True), ("nist-ai-600-1", False), ("sr-11-7", True)])
def test_exports_name_the_reported_bound(certified: dict[str, Any], framework: str, cites: bool) -> None:
    out = certified["root"] / f"{framework}.md"
    cert = certified["out"] / "certificate.json"
    pub = certified["root"] / "key.pub"
    args = ["export", str(cert), "--framework", framework, "--format", "md", "--out", str(out), "--pubkey", str(pub)]
    result = CliRunner(env=certified["env"]).invoke(cli, args)
    assert result.exit_code == 0, result.output + result.stderr
    text = out.read_text()
    assert "NOT compliant" not in text
    if cites:  # the frameworks whose items cite the envelope
        assert "variance bound reported, not gated: above the illustrative bound" in text
        assert "; check PASS" in text


def test_the_envelope_command_agrees_with_certify(certified: dict[str, Any]) -> None:
    canary = certified["root"] / "canary.safetensors"
    result = CliRunner(env=certified["env"]).invoke(cli, ["envelope", str(certified["run"]), "--canary", str(canary)])
    assert result.exit_code == 0, result.output + result.stderr  # was 1 on the run certify passed
    text = " ".join(result.output.split())
    assert "compliant: the gated rule (starvation; the variance bound is reported, not gated) holds" in text
    assert "not compliant" not in text and "reported, not gated" in text
