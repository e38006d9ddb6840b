"""The certificate page as an operator reads it (docs/decisions.md, "The certificate page is
written for the operator who reads it"): C2 bars coloured by the drop from
the baseline, every reason behind "(and N more)" one click away (<details>, no script), the
lifecycle margins as one plain sentence before their symbols, the domain legend's ×, numbers
near 1 in plain decimals, a neutral mark beside licensed sentences (one may say a loss rose),
and the by-design surprises explained where they show.

The HTML text and structure are checked here on every machine; the same page is loaded in a
real headless Chromium where one is installed (CI), which checks what a reader sees: the
details closed until clicked, the licensed mark, the bar colours.
"""

from __future__ import annotations

import copy
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from moeaudit.report import charts
from moeaudit.report.html import render_html
from moeaudit.report.svg import sig

FIXTURE = Path(__file__).parent / "fixtures" / "statement_example.json"
ORANGE = charts.NEG_HI


@pytest.fixture()
def statement() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def render(stmt: dict[str, Any]) -> str:
    return render_html(stmt, keyid="ab" * 32, envelope_sha256="cd" * 32)


def red_run(stmt: dict[str, Any]) -> dict[str, Any]:
    """The fixture with its last gate RED: protected layer 2's C2 falls from +0.074 to +0.010,
    still positive (the bar used to be green because C2 ≥ 0), and 55 health-floor failures."""
    s = copy.deepcopy(stmt)
    p = s["predicate"]
    p["verdict"], p["verdict_reason"] = "FAIL", "a RED gate at step 2500"
    last = p["gates"][-1]
    last["status"] = "RED"
    for e in last["receipts"]["per_layer"]:
        if e["layer"] == 2:
            e["c2"] = 0.010
    last["structural"] = {
        **last.get("structural", {}),
        "c2_ok": False,
        "ok": False,
        "c2_tolerance": {"1": 0.02, "2": 0.037},
        "c2_fallen_layers": [2],
    }
    problems = [f"checkpoint-{s_}: layer {i}: H_norm 0.41 (floor 0.6)" for s_ in (2000, 2500) for i in range(28)][:55]
    last["health"] = {"ok": False, "problems": problems[28:]}
    p["checks"].insert(
        0,
        {
            "name": "health",
            "evaluated": True,
            "status": "FAIL",
            "reason": "below an absolute health floor — " + "; ".join(problems[:4]) + " (and 51 more)",
            "problems": problems,
        },
    )
    last["claims"]["licensed"].append("expert usage is below an absolute health floor: a; b; c (and 24 more)")
    return s


def post_training(stmt: dict[str, Any]) -> dict[str, Any]:
    """sft-refine's shape: every gate GREEN while the canary NLL worsens 12 %."""
    s = copy.deepcopy(stmt)
    p = s["predicate"]
    p["run"]["stage"] = "post-training"
    nll = 3.0
    for g in p["gates"]:
        g["stage"] = "post-training"
        g["receipts"]["nll"] = nll
        nll *= 1.03
        if g["status"] != "BASELINE":
            g["status"], g["scalar"] = "GREEN", "worsening"
            g["claims"]["licensed"].insert(0, "the canary NLL worsened from 3.0000 to 3.0900")
    p["margins"]["refinement"].update(exact=0.0412, ci95=[0.03, 0.05])
    return s


def test_c2_bars_are_coloured_by_the_drop_not_the_sign(statement: dict[str, Any]) -> None:
    html = render(red_run(statement))
    bars = str(re.search(r'<svg[^>]*aria-label="Per-layer C2.*?</svg>', html, re.S).group(0))  # type: ignore[union-attr]
    row2 = bars.split("layer 2 · protected")[1].split("layer 3")[0]
    assert f'fill="{ORANGE}"' in row2 and "+0.010 (Δ −0.064, fallen)" in row2  # positive, yet fallen
    assert f'fill="{charts.POS}"' not in row2
    row1 = bars.split("layer 1 · protected")[1].split("layer 2")[0]
    assert f'fill="{charts.POS}"' in row1  # held: green
    assert "held or rose" in bars and "fallen" in bars and "C2 ≥ 0" not in bars
    assert charts.drop_fill(0.05, 0.05, 0.02) == (charts.POS, False)
    assert charts.drop_fill(-0.2, -0.3, 0.02) == (charts.POS, False)  # negative but rose: green
    assert charts.drop_fill(0.3, 0.4, 0.05, gated=False)[1] is False  # unprotected: never "fallen"
    assert charts.drop_fill(0.3, None, 0.05)[0] == charts.NO_BASE


def test_every_reason_behind_and_n_more_is_expandable(statement: dict[str, Any]) -> None:
    html = render(red_run(statement))
    assert "(and 51 more)" in html
    block = html.split('<details class="more"><summary>all 55 reasons</summary>')[1].split("</details>")[0]
    assert block.count("<li>") == 55 and "checkpoint-2500: layer 26" in block
    assert "all 27 health-floor failures" in html  # the RED gate's note, and its claim
    assert "<script" not in html.lower()


def test_margin_leads_with_one_plain_sentence(statement: dict[str, Any]) -> None:
    html = render(post_training(statement))
    row = html.split('<tr class="margin"><th scope="row">refinement</th>')[1].split("</tr>")[0]
    plain = "The fine-tune stayed within its drift budget: the protected layers were refined, not repurposed."
    assert row.index(plain) < row.index('<details class="symbols">') < row.index("exact r_ex")
    assert "r_ex" not in row.split('<details class="symbols">')[0]  # no symbol before the details
    s = copy.deepcopy(statement)
    s["predicate"]["margins"]["refinement"].update(exact=-0.4334, ci95=[-0.67, -0.31])
    row = render(s).split('<tr class="margin"><th scope="row">refinement</th>')[1].split("</tr>")[0]
    assert "Reported, not gated." in row and "a negative margin" in row and "expected on a healthy run" in row


def test_domain_legend_says_no_tokens_not_dead_expert(statement: dict[str, Any]) -> None:
    html = render(statement)
    domains = html.split('<section id="domains">')[1].split("</section>")[0]
    occupancy = html.split('<section id="occupancy">')[1].split("</section>")[0]
    assert "no tokens from this domain (π = 0)" in domains and "dead expert" not in domains
    assert "dead expert (π = 0)" in occupancy


def test_values_near_one_are_plain_decimals(statement: dict[str, Any]) -> None:
    s = copy.deepcopy(statement)
    env = s["predicate"]["envelope"]
    env["constants"]["budget"] = 2.3  # a normalized variance budget: ε/δ near 1
    for rows in env["series"].values():
        for r in rows:
            for key in ("value", "bound", "margin"):
                if r.get(key) is not None:
                    r[key] = 1.0 + 1000 * r[key]
    html = render(s)
    near_one = r"\d\.\d+e(?:\+0[0-3]|[−-]0[12])\b"  # 2.3e+00, 1.5e+01, 5.0e−01 …
    assert not re.search(near_one, html), re.findall(".{40}" + near_one, html)[:3]
    assert "budget ε/δ = 2.30" in html and "budget ε/δ = 2.3" in html
    assert sig(2.3) == "2.30" and sig(1.2e-5) == "1.20e−05" and sig(0.0123) == "0.0123"


def test_no_check_mark_beside_a_worsening(statement: dict[str, Any]) -> None:
    html = render(post_training(statement))
    assert "✓" not in html
    assert '<li class="licensed">the canary NLL worsened from 3.0000 to 3.0900</li>' in html
    assert '.licensed::before { content: "• "; color: var(--muted)' in html


def test_by_design_surprises_are_explained_where_they_show(statement: dict[str, Any]) -> None:
    html = render(post_training(statement))
    gates = html.split('<section id="gates">')[1].split("</section>")[0]
    assert "<strong>By design:</strong> The canary NLL worsens at step(s) 1000, 1500, 2000, 2500" in gates
    assert "+12.6 % from the first checkpoint" in gates
    assert gates.count("expected in post-training") == 4  # each GREEN gate's note says why
    assert "By design" not in render(statement)  # a pretraining run whose NLL falls: nothing to explain


def test_a_run_judged_under_two_stages_shows_each_gates_stage(statement: dict[str, Any]) -> None:
    """Each gate signs the stage that judged it; the table shows it under the trend only when a
    declared stage changes within the run."""
    s = copy.deepcopy(statement)
    for g in s["predicate"]["gates"]:
        g["stage"] = "pretraining" if g["step"] <= 1500 else "post-training"
    gates = render(s).split('<section id="gates">')[1].split("</section>")[0]
    rows = gates.split("<tbody>")[1].split("</tbody>")[0].split("</tr>")[:-1]
    said = [re.findall(r'<span class="sub">judged as ([a-z-]+)</span>', row) for row in rows]
    assert said == [["pretraining"]] * 3 + [["post-training"]] * 2
    assert "judged as" not in render(statement)  # one stage: nothing to say per gate


def test_an_abandoned_checkpoint_is_named(statement: dict[str, Any]) -> None:
    s = copy.deepcopy(statement)
    s["predicate"]["run"]["abandoned"] = [
        {"name": "checkpoint-2500", "step": 2500, "resume_step": 1500, "reason": "saved above the resume at step 1500"}
    ]
    html = render(s)
    assert "<strong>Abandoned checkpoints</strong>" in html and "checkpoint-2500 (saved above the resume" in html
    assert "abandoned: left from a branch a resume abandoned" in html.split('<section id="gates">')[1]


READING_FACTS = """JSON.stringify((() => {
  const details = [...document.querySelectorAll('details')];
  const lic = document.querySelector('li.licensed');
  const bars = document.querySelector('svg[aria-label^="Per-layer C2"]');
  const fills = [...bars.querySelectorAll('rect')].map(r => r.getAttribute('fill'));
  // checkVisibility: a closed <details> keeps its content laid out but not rendered in recent
  // Chromium (content-visibility), so a zero bounding box is not the test; opening must show it
  const hidden = details.every(d => {
    const inner = d.querySelector('li, dl');
    const closed = !d.open && !inner.checkVisibility();
    d.open = true;
    const shown = inner.checkVisibility();
    d.open = false;
    return closed && shown;
  });
  const plain = document.querySelector('tr.margin p.plain');
  return {details: details.length, hidden, scripts: document.scripts.length,
          mark: getComputedStyle(lic, '::before').content, fills,
          plainVisible: plain.getBoundingClientRect().height > 0,
          summaries: details.map(d => d.querySelector('summary').innerText)};
})())"""


def test_chromium_shows_the_reading(statement: dict[str, Any], tmp_path: Path) -> None:
    from support.html import DevTools, chromium_binary, requests_and_errors

    if chromium_binary() is None:
        pytest.skip("no chromium (apt-get install chromium); the HTML checks above still run")
    page = tmp_path / "certificate.html"
    page.write_text(render(red_run(statement)), encoding="utf-8")
    (tmp_path / "chromium").mkdir()
    tools = DevTools(chromium_binary() or "", tmp_path / "chromium", time.monotonic() + 30)
    try:
        url = page.resolve().as_uri()
        session = tools.open(url)
        urls, errors = requests_and_errors(tools.events)
        facts = json.loads(
            tools.send("Runtime.evaluate", session, expression=READING_FACTS, returnByValue=True)["result"]["value"]
        )
    finally:
        tools.close()
    assert urls == [url] and errors == [] and facts["scripts"] == 0
    assert facts["details"] >= 4 and facts["hidden"]  # closed until a reader opens them
    assert "all 55 reasons" in facts["summaries"] and "the numbers" in facts["summaries"]
    assert facts["mark"] == '"• "'  # neutral, never ✓
    assert ORANGE in facts["fills"] and charts.POS in facts["fills"]
    assert facts["plainVisible"]
