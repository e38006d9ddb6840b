"""Compliance export (docs/compliance.md): only from a verified certificate, every status computed
from what the certificate holds, items without evidence listed as not covered, deterministic
and script-free output."""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from moeaudit.attest.certificate import (
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    open_certificate,
    sign_statement,
    table4,
)
from moeaudit.attest.signing import SignatureInvalid, generate_key, load_public_key
from moeaudit.errors import InputError, UsageError
from moeaudit.jsonio import atomic_write, dumps
from moeaudit.report.export import (
    COVERED,
    FORMATS,
    FRAMEWORKS,
    NOT_COVERED,
    PARTIAL,
    Aspect,
    Evidence,
    Item,
    assess,
    export,
    run_export,
    to_html,
    to_markdown,
)

FIXTURE = Path(__file__).parent / "fixtures" / "statement_example.json"
ISSUED = "2026-05-02T14:03:11Z"

# The example certificate (INCONCLUSIVE pretraining run, envelope evaluated, no reference, no
# ci95 in the gates): what each item must come out as. One item is "covered", the GPAI Model
# Documentation Form's model authenticity (the subject digests, signed); every other framework
# point asks for something a training-health certificate cannot show (see docs/compliance.md).
EXPECTED = {
    "eu-ai-act-gpai": {
        "MDF 1.1-1.2 provider and model name": NOT_COVERED,
        "MDF 1.3 model authenticity": COVERED,
        "MDF 1.4-1.5 release dates": NOT_COVERED,
        "MDF 1.6 model dependencies": NOT_COVERED,
        "MDF 2 model properties": NOT_COVERED,
        "MDF 3 distribution and licence": NOT_COVERED,
        "MDF 4 use": NOT_COVERED,
        "MDF training process": PARTIAL,
        "MDF data for training, testing and validation": PARTIAL,
        "MDF computational resources": NOT_COVERED,
        "MDF energy consumption": NOT_COVERED,
    },
    "eu-ai-act": {
        "Annex IV 2(b)": PARTIAL,
        "Annex IV 2(c)": NOT_COVERED,
        "Annex IV 2(d)": NOT_COVERED,
        "Annex IV 2(g)": PARTIAL,
        "Annex IV 4": PARTIAL,
        "Annex IV 6": PARTIAL,
        "Annex XI §1.1": NOT_COVERED,
        "Annex XI §1.2(a)": NOT_COVERED,
        "Annex XI §1.2(b)": PARTIAL,
        "Annex XI §1.2(c)": PARTIAL,
        "Annex XI §1.2(d)": NOT_COVERED,
        "Annex XI §1.2(e)": NOT_COVERED,
    },
    "nist-ai-600-1": {
        "MS-2.3-003": PARTIAL,
        "MS-2.7-005": PARTIAL,
        "MS-2.9-002": PARTIAL,
        "MS-2.13-001": PARTIAL,
        "MS-4.2-005": NOT_COVERED,
    },
    "sr-11-7": {"conceptual soundness": PARTIAL, "ongoing monitoring": PARTIAL, "outcomes analysis": PARTIAL},
    "iso-42001": {
        "A.6.2.4 verification and validation": PARTIAL,
        "A.6.2.6 operation and monitoring": PARTIAL,
        "A.6.2.7 technical documentation": PARTIAL,
        "A.6.2.8 recording of event logs": PARTIAL,
        "A.7.5 data provenance": PARTIAL,
    },
}
EXPECTED["eu-ai-act-gpai-authority"] = EXPECTED["eu-ai-act-gpai"]
# every aspect of the Form is flagged for the authorities; downstream providers get the fields the
# Form flags DPs (FORM_FIELDS): no model authenticity, training process, compute or energy, and of
# the data only what the canary cannot show
EXPECTED["eu-ai-act-gpai-downstream"] = {
    **{
        k: v
        for k, v in EXPECTED["eu-ai-act-gpai"].items()
        if k
        not in (
            "MDF 1.3 model authenticity",
            "MDF training process",
            "MDF computational resources",
            "MDF energy consumption",
        )
    },
    "MDF data for training, testing and validation": NOT_COVERED,
}


def minimal_statement() -> dict[str, Any]:
    """A small but realistic statement: one baseline gate, nothing else evaluated."""
    gate = {
        "step": 100,
        "status": "BASELINE",
        "baseline": 100,
        "scalar": "first",
        "reason": "first checkpoint of the run",
        "receipts": {"checkpoint": "checkpoint-100", "nll": 4.1, "c2_mean": 0.05, "dead": 0},
        "claims": {
            "licensed": ["this is the state of the routed model at this point"],
            "not_licensed": ["any preservation claim about training after it"],
        },
    }
    predicate = {
        "verdict": "PASS",
        "run": {"name": "tiny", "stage": "pretraining", "checkpoints": [100], "skipped": [], "events": []},
        "canary": {"digest": {"sha256": "c" * 64}, "windows": 8, "window_len": 16, "domains": ["web"]},
        "policy": {"source": "built-in default", "digest": "d" * 64, "calibrated": False},
        "tool": {"name": "moeaudit", "version": "0.1.0"},
        "environment": {"torch": "2.5.1", "device": "cpu", "dtype": "float32"},
        "gates": [gate],
        "checks": [
            {
                "name": "envelope",
                "evaluated": False,
                "status": None,
                "reason": "no series: no metrics.jsonl and fewer than two checkpoints",
            },
            {"name": "handoff", "evaluated": False, "status": None, "reason": "no --reference given"},
        ],
        "envelope": None,
        "margins": {"refinement": None, "handoff": None},
        "claims": table4(),
    }
    subject = [{"name": "checkpoint-100", "digest": {"sha256": "a" * 64}}]
    return {"_type": STATEMENT_TYPE, "subject": subject, "predicateType": PREDICATE_TYPE, "predicate": predicate}


def example_statement() -> dict[str, Any]:
    if FIXTURE.exists():
        return json.loads(FIXTURE.read_text(encoding="utf-8"))
    return minimal_statement()


@pytest.fixture(scope="module")
def key_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("keys") / "signing-key.pem"
    return generate_key(path), Path(str(path) + ".pub")


def write_certificate(stmt: dict[str, Any], key: Any, path: Path) -> Path:
    atomic_write(path, dumps(sign_statement(stmt, key, issued_at=ISSUED)))
    return path


def verified(stmt: dict[str, Any], key_pair: tuple[Any, Path], tmp_path: Path) -> dict[str, Any]:
    """Sign, write, and reopen through the signature check — the only way to an export."""
    key, pub = key_pair
    cert = write_certificate(stmt, key, tmp_path / "certificate.json")
    return open_certificate(cert, load_public_key(pub))


def by_id(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["id"]: item for item in report["items"]}


# --- through the signed file ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fw", sorted(FRAMEWORKS))
def test_export_from_signed_certificate(fw: str, fmt: str, key_pair, tmp_path: Path) -> None:
    key, pub = key_pair
    cert = write_certificate(example_statement(), key, tmp_path / "certificate.json")
    out = run_export(cert, pub, fw, fmt)
    assert out == run_export(cert, pub, fw, fmt)  # deterministic bytes
    assert FRAMEWORKS[fw].title.split(" — ")[0] in out
    if fmt == "json":
        report = json.loads(out)
        assert report["schema"] == "moeaudit.export/v1" and report["framework"]["key"] == fw
        assert report["certificate"]["keyid"] and report["certificate"]["issued_at"] == ISSUED
        if FIXTURE.exists():
            assert {i["id"]: i["status"] for i in report["items"]} == EXPECTED[fw]
    if fmt == "html":
        assert out.startswith("<!DOCTYPE html>") and "<script" not in out.lower()
        assert "://" not in out  # self-contained: no URL to fetch


def test_tampered_certificate_is_refused(key_pair, tmp_path: Path) -> None:
    key, pub = key_pair
    cert = write_certificate(example_statement(), key, tmp_path / "certificate.json")
    env = json.loads(cert.read_text())
    body = bytearray(base64.b64decode(env["payload"]))
    body[body.index(b"INCONCLUSIVE" if b"INCONCLUSIVE" in body else b"PASS")] ^= 0x01
    env["payload"] = base64.b64encode(bytes(body)).decode()
    cert.write_text(json.dumps(env))
    with pytest.raises(SignatureInvalid):
        run_export(cert, pub, "eu-ai-act", "md")


def test_certificate_signed_by_another_key_is_refused(key_pair, tmp_path: Path) -> None:
    other = generate_key(tmp_path / "other.pem")
    cert = write_certificate(example_statement(), other, tmp_path / "certificate.json")
    with pytest.raises(SignatureInvalid):
        run_export(cert, key_pair[1], "sr-11-7", "json")


def test_default_public_key_is_the_users_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    from moeaudit.attest.signing import default_key_path

    default_key_path().parent.mkdir(parents=True)
    key = generate_key(default_key_path())
    cert = write_certificate(example_statement(), key, tmp_path / "certificate.json")
    assert json.loads(run_export(cert, None, "nist-ai-600-1", "json"))["certificate"]["keyid"]


def test_unverified_statement_is_refused() -> None:
    with pytest.raises(InputError, match="verified certificate"):
        export(example_statement(), "eu-ai-act")


def test_unknown_framework_and_format_are_usage_errors(key_pair, tmp_path: Path) -> None:
    cert = write_certificate(example_statement(), key_pair[0], tmp_path / "certificate.json")
    with pytest.raises(UsageError, match="framework"):
        run_export(cert, key_pair[1], "iso-27001", "md")
    with pytest.raises(UsageError, match="format"):
        run_export(cert, key_pair[1], "sr-11-7", "pdf")


# --- statuses are computed, never claimed ---------------------------------------------------------


def test_status_follows_the_aspects(key_pair, tmp_path: Path) -> None:
    """covered ⇔ nothing is not shown; not covered ⇔ no evidence — every item, every framework."""
    for stmt in (example_statement(), minimal_statement()):
        opened = verified(stmt, key_pair, tmp_path)
        for fw in FRAMEWORKS:
            for item in export(opened, fw)["items"]:
                assert (item["status"] == COVERED) == (not item["not_shown"]), item["id"]
                assert (item["status"] == NOT_COVERED) == (not item["evidence"]), item["id"]


def test_covered_is_reachable_only_with_every_aspect_backed() -> None:
    def there(_: Any) -> Evidence:
        return Evidence("predicate.x", "present")

    def absent(_: Any) -> Evidence:
        return Evidence("predicate.y", "null", False)

    both = Item("x", "r", (Aspect("a", (there,)), Aspect("b", (absent, there))))
    assert assess(both, {})["status"] == COVERED
    half = Item("x", "r", (Aspect("a", (there,)), Aspect("b", (absent,))))
    out = assess(half, {})
    assert out["status"] == PARTIAL and out["not_shown"] == [{"aspect": "b", "reason": "null"}]
    assert assess(Item("x", "r", (Aspect("a"),)), {})["status"] == NOT_COVERED


def test_items_without_evidence_are_not_covered(key_pair, tmp_path: Path) -> None:
    items = by_id(export(verified(example_statement(), key_pair, tmp_path), "eu-ai-act"))
    for name in ("Annex IV 2(c)", "Annex IV 2(d)", "Annex XI §1.2(d)", "Annex XI §1.2(e)"):
        assert items[name]["status"] == NOT_COVERED and items[name]["evidence"] == []
    # the related field is shown as context, never as evidence
    assert [c["field"] for c in items["Annex IV 2(d)"]["context"]] == ["predicate.canary"]
    assert [c["field"] for c in items["Annex IV 2(c)"]["context"]] == ["predicate.environment"]
    nist = by_id(export(verified(example_statement(), key_pair, tmp_path), "nist-ai-600-1"))
    assert nist["MS-4.2-005"]["status"] == NOT_COVERED


def _fields(report: dict[str, Any]) -> set[str]:
    return {e["field"] for item in report["items"] for e in item["evidence"]}


def test_without_envelope_the_envelope_is_never_evidence(key_pair, tmp_path: Path) -> None:
    stmt = example_statement()
    stmt["predicate"]["envelope"] = None
    for c in stmt["predicate"].get("checks") or []:
        if c["name"] == "envelope":
            c.update(evaluated=False, status=None, reason="no series: no metrics.jsonl")
    opened = verified(stmt, key_pair, tmp_path)
    for fw in FRAMEWORKS:
        assert "predicate.envelope" not in _fields(export(opened, fw))
    sr = by_id(export(opened, "sr-11-7"))["ongoing monitoring"]
    gap = next(g for g in sr["not_shown"] if g["aspect"] == "gradient-signal envelope over the run")
    assert "not evaluated: no series" in gap["reason"]
    # with the envelope present but its check not evaluated, it is still not evidence
    stmt2 = example_statement()
    for c in stmt2["predicate"].get("checks") or []:
        if c["name"] == "envelope":
            c.update(evaluated=False, status=None)
    report = export(verified(stmt2, key_pair, tmp_path), "eu-ai-act")
    assert "predicate.envelope" not in _fields(report)


def test_minimal_certificate_drops_monitoring_to_not_covered(key_pair, tmp_path: Path) -> None:
    """One baseline gate and no envelope: nothing was compared or monitored."""
    opened = verified(minimal_statement(), key_pair, tmp_path)
    sr = by_id(export(opened, "sr-11-7"))
    assert sr["ongoing monitoring"]["status"] == NOT_COVERED
    eu = by_id(export(opened, "eu-ai-act"))
    assert "predicate.gates[].structural" not in {e["field"] for e in eu["Annex IV 6"]["evidence"]}
    full = by_id(export(verified(example_statement(), key_pair, tmp_path), "sr-11-7"))
    if FIXTURE.exists():
        assert full["ongoing monitoring"]["status"] == PARTIAL


def test_handoff_is_evidence_only_when_evaluated(key_pair, tmp_path: Path) -> None:
    stmt = minimal_statement()
    stmt["predicate"]["margins"]["handoff"] = {"exact": 0.12, "smooth": 0.1}
    g = lambda s: by_id(export(verified(s, key_pair, tmp_path), "eu-ai-act"))["Annex IV 2(g)"]  # noqa: E731
    assert "predicate.margins.handoff" not in {e["field"] for e in g(stmt)["evidence"]}
    stmt["predicate"]["checks"][1].update(evaluated=True, status="PASS", value=0.12)
    assert "predicate.margins.handoff" in {e["field"] for e in g(stmt)["evidence"]}


def test_ci95_in_the_gates_backs_measurement_variance(key_pair, tmp_path: Path) -> None:
    stmt = example_statement()
    item = by_id(export(verified(stmt, key_pair, tmp_path), "nist-ai-600-1"))["MS-2.13-001"]
    assert "ci95" in item["not_shown"][0]["reason"] and item["status"] == PARTIAL
    stmt["predicate"]["gates"][-1]["receipts"]["ci95"] = {"c2_mean": [0.04, 0.06]}
    item = by_id(export(verified(stmt, key_pair, tmp_path), "nist-ai-600-1"))["MS-2.13-001"]
    assert "predicate.gates[].receipts.*.ci95" in {e["field"] for e in item["evidence"]}
    assert item["status"] == PARTIAL  # bias of the metrics is still not shown


def test_sr_11_7_states_its_supersession(key_pair, tmp_path: Path) -> None:
    report = export(verified(example_statement(), key_pair, tmp_path), "sr-11-7")
    assert "superseded by SR 26-2 in April 2026" in report["framework"]["note"]
    assert "superseded by SR 26-2 in April 2026" in to_markdown(report)
    # and that SR 26-2 leaves generative AI models out of its scope
    scope = "SR 26-2 places generative AI and agentic AI models outside its scope"
    assert scope in report["framework"]["note"] and scope in to_markdown(report)
    assert "not a model under SR 26-2" in to_html(report)


def test_gpai_model_documentation_form(key_pair, tmp_path: Path) -> None:
    """For GPAI providers, the Code of Practice's Model Documentation Form; the
    subject digests answer its model-authenticity item, items without evidence are not covered."""
    stmt = example_statement()
    report = export(verified(stmt, key_pair, tmp_path), "eu-ai-act-gpai")
    assert "Model Documentation Form" in report["framework"]["title"]
    items = by_id(report)
    auth = items["MDF 1.3 model authenticity"]
    assert auth["status"] == COVERED and auth["not_shown"] == []
    digests = next(e for e in auth["evidence"] if e["field"] == "subject[].digest.sha256")
    first = stmt["subject"][0]["digest"]["sha256"][:12]
    assert f"{len(stmt['subject'])} checkpoint(s) pinned" in digests["summary"] and first in digests["summary"]
    assert "verify --recheck" in auth["note"]
    for name in ("MDF 1.4-1.5 release dates", "MDF 3 distribution and licence", "MDF 4 use", "MDF energy consumption"):
        assert items[name]["status"] == NOT_COVERED and items[name]["evidence"] == []
        assert all(n["reason"] for n in items[name]["not_shown"])  # each gap says why
    md = to_markdown(report)
    assert "MDF 1.3 model authenticity" in md and "not covered" in md
    # without subjects there is nothing to authenticate: not covered, never claimed
    bare = copy.deepcopy(stmt)
    bare["subject"] = []
    assert (
        by_id(export(verified(bare, key_pair, tmp_path), "eu-ai-act-gpai"))["MDF 1.3 model authenticity"]["status"]
        == PARTIAL
    )


# --- rendering -----------------------------------------------------------------------------------


def test_untrusted_text_is_escaped(key_pair, tmp_path: Path) -> None:
    stmt = copy.deepcopy(example_statement())
    evil = "<script>alert(1)</script> | **x** [y](http://e.test)"
    stmt["predicate"]["run"]["name"] = evil
    stmt["subject"][0]["name"] = evil
    report = export(verified(stmt, key_pair, tmp_path), "eu-ai-act")
    html, md = to_html(report), to_markdown(report)
    assert "<script" not in html.lower() and "&lt;script&gt;" in html
    assert "<script" not in md.lower() and "&lt;script&gt;" in md
    row = next(line for line in md.splitlines() if line.startswith("| run |"))
    assert row.count(" | ") == 1  # the pipe in the name did not open a new column
    assert "[y](" not in md and "\\[y\\](" in md  # the link is shown as text, not made live


def test_control_characters_are_shown_escaped_in_the_html_export(key_pair, tmp_path: Path) -> None:
    """As on certificate.html: ESC, BEL and a bidi override in a signed name reach the page as
    their escapes, never raw."""
    stmt = copy.deepcopy(example_statement())
    stmt["predicate"]["run"]["name"] = "run\x1b[31m\x07\u202e"
    html = to_html(export(verified(stmt, key_pair, tmp_path), "eu-ai-act"))
    assert not [ch for ch in html if ch in "\x1b\x07\u202e"]
    assert "run\\x1b[31m\\x07\\u202e" in html


def test_renderers_are_pure_functions_of_the_report(key_pair, tmp_path: Path) -> None:
    report = export(verified(example_statement(), key_pair, tmp_path), "nist-ai-600-1")
    again = json.loads(json.dumps(report))
    assert to_markdown(report) == to_markdown(again) and to_html(report) == to_html(again)
    md = to_markdown(report)
    for item in report["items"]:
        assert f"— {item['status']}" in md


def test_docs_explain_every_item() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "compliance.md").read_text(encoding="utf-8")
    assert "superseded by SR 26-2 in April 2026" in doc
    for fw in FRAMEWORKS.values():
        for item in fw.items:
            assert item.id in doc, item.id


def test_html_export_shows_the_verdict_in_colour_and_the_backing_charts(key_pair, tmp_path) -> None:
    """The export page shows the verdict as the certificate page does, and each
    item whose evidence cites gates, the envelope or the occupancy heatmap shows that chart."""
    from moeaudit.attest.certificate import open_certificate

    key, pub = key_pair
    cert = write_certificate(json.loads(FIXTURE.read_text()), key, tmp_path / "c.json")
    stmt = open_certificate(cert, load_public_key(pub))
    for key in ("eu-ai-act", "nist-ai-600-1", "sr-11-7"):
        report = export(stmt, key)
        page = to_html(report, stmt)
        verdict = stmt["predicate"]["verdict"]
        assert f'class="badge v-{verdict}"' in page
        backed = [
            i
            for i in report["items"]
            if any(k in " ".join(e["field"] for e in i["evidence"]) for k in ("gates", "envelope", "heatmaps"))
        ]
        assert backed and page.count("<figure><svg") >= len(backed)
        assert "<script" not in page and "http://" not in page.replace("http://www.w3.org", "")
        assert to_html(report, stmt) == page  # deterministic


def _style_rules(page: str) -> list[tuple[list[str], dict[str, str]]]:
    """The page's top-level CSS rules in order (selectors, declarations); @media blocks dropped."""
    css = "\n".join(re.findall(r"<style>(.*?)</style>", page, flags=re.S))
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    css = re.sub(r"@media[^{]*\{(?:[^{}]*\{[^{}]*\})*[^{}]*\}", "", css)
    rules = []
    for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css):
        decls = dict((k.strip(), v.strip()) for k, _, v in (d.partition(":") for d in body.split(";") if ":" in d))
        rules.append(([s.strip() for s in selectors.split(",")], decls))
    return rules


def _colours(page: str, selector: str) -> tuple[str, str]:
    """(background, color) the page's stylesheet gives ``selector`` alone, var() resolved."""
    rules = _style_rules(page)
    root = {k: v for sels, decls in rules if ":root" in sels for k, v in decls.items()}
    got: dict[str, str] = {}
    for sels, decls in rules:
        if selector in sels:
            got.update(decls)

    def resolve(value: str) -> str:
        m = re.fullmatch(r"var\((--[\w-]+)\)", value)
        return resolve(root[m.group(1)]) if m else value.lower()

    return resolve(got["background"]), resolve(got["color"])


@pytest.mark.parametrize("verdict", ["PASS", "FAIL", "INCONCLUSIVE"])
def test_export_and_certificate_show_a_verdict_in_the_same_colours(verdict: str, key_pair, tmp_path) -> None:
    """The verdict badge of the export page and the verdict band of the
    certificate page get their colours from one stylesheet (templates/verdict.css)."""
    from moeaudit.report.html import render_html

    stmt = minimal_statement()
    stmt["predicate"]["verdict"] = verdict
    cert_page = render_html(stmt, keyid="k" * 64, envelope_sha256="e" * 64)
    export_page = to_html(export(verified(stmt, key_pair, tmp_path), "eu-ai-act"), stmt)
    assert f'class="verdict verdict-{verdict.lower()}"' in cert_page
    assert f'class="badge v-{verdict}"' in export_page
    expected = {"PASS": ("#1a7f37", "#fff"), "FAIL": ("#b42318", "#fff"), "INCONCLUSIVE": ("#f5a623", "#2b1d00")}[
        verdict
    ]
    assert _colours(cert_page, f".verdict-{verdict.lower()}") == expected
    assert _colours(export_page, f".v-{verdict}") == expected


def test_templates_are_found_in_an_installed_package(tmp_path: Path) -> None:
    """A wheel installs templates/ as moeaudit/_templates without an __init__.py (a namespace
    package): both pages must render from there, with the shared verdict.css, in a fresh process."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    site = tmp_path / "site-packages"
    shutil.copytree(root / "moeaudit", site / "moeaudit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "templates", site / "moeaudit" / "_templates")
    code = (
        "import json, sys\n"
        "from moeaudit.resources import templates_dir\n"
        "from moeaudit.report.export import export, to_html\n"
        "from moeaudit.report.html import render_html\n"
        "s = json.load(open(sys.argv[1]))\n"
        "v = {**s, '_keyid': '0' * 64}\n"
        "print(templates_dir())\n"
        "print('.v-INCONCLUSIVE' in render_html(s, keyid='k' * 64, envelope_sha256='e' * 64))\n"
        "print('.v-INCONCLUSIVE' in to_html(export(v, 'eu-ai-act'), v))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(FIXTURE)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[0] == str(site / "moeaudit" / "_templates")
    assert lines[1:] == ["True", "True"]
