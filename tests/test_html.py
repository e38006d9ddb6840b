"""The HTML certificate (README.md, "What a certificate proves, and what it does not"): deterministic, self-contained,
escaped — and checked in a real headless Chromium: no network request, no console error, a screenshot that shows the
verdict.

The browser is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: NUL-
separated JSON on fds 3/4), so the test reads Chromium's own account of the page load — every
``Network.requestWillBeSent``, console message, log entry and exception — instead of parsing
stderr. A control page with an ``<img src=http…>`` and a ``console.error`` is loaded in the same
session to show the harness does see requests and errors when there are some.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import struct
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.html import DevTools, chromium_binary, requests_and_errors  # noqa: E402

from moeaudit.report import charts
from moeaudit.report.html import VERIFY, render_html

FIXTURE = Path(__file__).parent / "fixtures" / "statement_example.json"
GOLDEN = Path(__file__).parent / "fixtures" / "certificate_example.html"
KEYID = "3f1c0e5a9b2d4c6e8f0a1b3c5d7e9f1a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e"
ENVELOPE_SHA = "9c2e4a6b8d0f1e3c5a7b9d1f3e5c7a9b1d3f5e7c9a1b3d5f7e9c1a3b5d7f9e1c"
HEADINGS = (
    "Checks",
    "Gate progression",
    "Per-layer C2",
    "Loss and C2 over steps",
    "Gradient-variance envelope",
    "Expert occupancy",
    "Domain routing",
    "Claims",
    "How to verify this certificate",
    "What this certificate proves — and what it does not",
)
AMBER = (245, 166, 35)  # --amber in templates/verdict.css: the INCONCLUSIVE band


@pytest.fixture()
def statement() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def render(stmt: dict[str, Any]) -> str:
    return render_html(stmt, keyid=KEYID, envelope_sha256=ENVELOPE_SHA)


# --- the page as text ----------------------------------------------------------------------------


def test_fixture_is_the_run_it_claims_to_be(statement: dict[str, Any]) -> None:
    p = statement["predicate"]
    assert [g["status"] for g in p["gates"]] == ["BASELINE", "GREEN", "YELLOW", "GREEN", "GREEN"]
    assert p["verdict"] == "INCONCLUSIVE"
    assert sorted(p["envelope"]["series"]) == ["0", "1", "2", "3", "pooled"]
    assert "NaN" not in FIXTURE.read_text(encoding="utf-8")


def test_same_statement_same_bytes(statement: dict[str, Any]) -> None:
    first = render(statement).encode("utf-8")
    assert render(copy.deepcopy(statement)).encode("utf-8") == first


def test_golden_page(statement: dict[str, Any]) -> None:
    """Byte-for-byte across processes and hash seeds; after a deliberate template change run
    ``MOEAUDIT_UPDATE_GOLDEN=1 pytest tests/test_html.py`` and review the diff."""
    html = render(statement)
    if os.environ.get("MOEAUDIT_UPDATE_GOLDEN"):
        GOLDEN.write_text(html, encoding="utf-8")
    assert html == GOLDEN.read_text(encoding="utf-8")


@pytest.mark.parametrize("verdict", ["PASS", "FAIL", "INCONCLUSIVE"])
def test_minimal_statement_renders(verdict: str) -> None:
    """Only what a certificate must hold (verdict, gates): every section says what is missing."""
    gates = [{"step": 0, "status": "BASELINE"}, {"step": 10, "status": "GREEN"}]
    stmt = {"_type": "t", "subject": [], "predicateType": "p", "predicate": {"verdict": verdict, "gates": gates}}
    html = render(stmt)
    assert f'class="verdict verdict-{verdict.lower()}"' in html
    assert "— not evaluated: no envelope series" in html and "— no per-layer receipts" in html


def test_self_contained_and_complete(statement: dict[str, Any]) -> None:
    html = render(statement)
    assert "<script" not in html.lower()
    assert not re.search(r"https?://", html.replace(statement["_type"], "").replace(statement["predicateType"], ""))
    assert 'href="http' not in html and " src=" not in html and "url(" not in html
    assert "default-src 'none'" in html and "@media print" in html
    assert "NaN" not in html and "Infinity" not in html
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in html, heading
    assert "INCONCLUSIVE" in html and "YELLOW gate at step 1500" in html
    assert VERIFY in html and KEYID in html and ENVELOPE_SHA in html
    for subject in statement["subject"]:
        assert subject["digest"]["sha256"] in html
    assert statement["predicate"]["canary"]["digest"]["sha256"] in html
    assert statement["predicate"]["policy"]["digest"] in html
    # C2 bars, loss/C2, 5 envelope panels, occupancy + legend, 4 domain panels + legend
    assert html.count("<svg") == 1 + 1 + 5 + 2 + 4 + 1


def test_text_is_escaped(statement: dict[str, Any]) -> None:
    stmt = copy.deepcopy(statement)
    evil = "<b>ckpt</b>"
    stmt["predicate"]["gates"][1]["receipts"]["checkpoint"] = evil
    stmt["subject"][1]["name"] = evil
    stmt["predicate"]["run"]["name"] = evil
    stmt["predicate"]["heatmaps"]["domains"]["names"][0] = "<i>web</i>"
    stmt["predicate"]["heatmaps"]["domains"]["layers"]["0"]["<i>web</i>"] = stmt["predicate"]["heatmaps"]["domains"][
        "layers"
    ]["0"]["web"]
    html = render(stmt)
    assert "<b>" not in html and "<i>" not in html
    assert "&lt;b&gt;ckpt&lt;/b&gt;" in html and "&lt;i&gt;web&lt;/i&gt;" in html


def test_control_characters_are_shown_escaped(statement: dict[str, Any]) -> None:
    """A canary domain or checkpoint name with ESC, BEL or a bidi override reaches the page (SVG
    text, attributes and prose) as its escape, as on the terminal and in the CI outputs."""
    stmt = copy.deepcopy(statement)
    evil = "web\x1b[31m\x07\u202e"
    dom = stmt["predicate"]["heatmaps"]["domains"]
    dom["layers"]["0"][evil] = dom["layers"]["0"]["web"]
    dom["names"][0] = evil
    stmt["predicate"]["canary"]["domains"][0] = evil
    stmt["subject"][1]["name"] = "checkpoint-1500\x1b]0;owned\x07"
    stmt["predicate"]["run"]["name"] = "run\x00\x08"
    html = render(stmt)
    assert not [ch for ch in html if ch in "\x1b\x07\x00\x08\u202e"]
    assert "web\\x1b[31m\\x07\\u202e" in html  # in the heatmap's SVG text and in the digests table
    assert html.count("web\\x1b[31m") >= 2
    assert "checkpoint-1500\\x1b]0;owned\\x07" in html and "run\\x00\\x08" in html


def test_nulls_are_dashes_with_reasons(statement: dict[str, Any]) -> None:
    stmt = copy.deepcopy(statement)
    p = stmt["predicate"]
    p["gates"][0]["receipts"]["c2_mean"] = None
    p["envelope"]["series"]["pooled"][3].update(value=None, margin=None, compliant=False, reason="value is non-finite")
    p["margins"]["refinement"] = None
    html = render(stmt)
    assert "pooled at step 300: — (value is non-finite)" in html
    # illustrative constants: the variance bound is reported, not gated, and shown so
    assert "ABOVE, REPORTED</span> at step(s) 300" in html and "OUTSIDE</span>" not in html
    p["envelope"]["variance_gated"] = True
    assert "OUTSIDE</span> at step(s) 300" in render(stmt)
    assert "not computed" in html
    p["envelope"], p["heatmaps"] = None, {}
    html = render(stmt)
    assert "— not evaluated: every sample" in html  # the envelope check's own reason
    assert "— no occupancy heatmap" in html and "— no domain routing" in html


def test_it_proves_says_what_is_signed_and_what_recheck_covers(statement: dict[str, Any]) -> None:
    """The "It proves" list must not overclaim: the signature covers certificate.json, not
    receipts/ or this page (docs/security.md, "What the signature binds"), and --recheck
    re-hashes every bound input, the run's logs, canary and policy as well as the checkpoints."""
    html = render(statement)
    proves = html.split("<h3>It proves</h3>", 1)[1].split("<h3>It does not prove</h3>", 1)[0]
    items = [re.sub(r"<[^>]+>", "", li) for li in re.findall(r"<li>(.*?)</li>", proves, re.S)]
    signed, recheck = items[0], items[1]
    assert "signed these receipts" not in html
    assert "certificate.json" in signed and "receipts/ folder beside it are not signed" in signed
    for bound in ("checkpoints", "metrics.jsonl", "events.jsonl", "canary_probe.jsonl", "canary", "policy"):
        assert bound in recheck, bound
    assert "--recheck re-hashes all of them" in recheck
    assert "checkpoint files are still the same" not in html
    verify = html.split('<section id="verify">', 1)[1].split("</section>", 1)[0]
    assert "to re-hash the checkpoints named below and the other inputs the certificate binds" in re.sub(
        r"<[^>]+>", "", verify
    )


def test_envelope_chart_marks_samples_outside_the_bound() -> None:
    samples = [
        {"step": 0, "value": 1e-3, "bound": 1.2e-3, "compliant": True, "window": 0},
        {"step": 100, "value": 5e-4, "bound": 3e-4, "compliant": False, "window": 0},
        {"step": 200, "value": 1e-5, "bound": 2e-4, "compliant": True, "window": 0},
    ]
    svg = str(charts.envelope_chart(samples, [], 2e-4, "test"))
    assert svg.count(f'stroke="{charts.BAD}"') == 2  # the marked sample and its legend entry
    assert "10⁻⁵" in svg and "10⁻³" in svg  # log axis: the values span two decades


# --- the page in a browser -----------------------------------------------------------------------


PAGE_FACTS = """JSON.stringify((() => {
  const band = document.querySelector('header.verdict');
  const r = band.getBoundingClientRect();
  return {verdict: band.querySelector('h1').innerText, band: [r.x, r.y, r.width, r.height],
          color: getComputedStyle(band).backgroundColor, scripts: document.scripts.length,
          resources: performance.getEntriesByType('resource').length,
          svgs: [...document.querySelectorAll('svg')]
                  .filter(s => s.getBoundingClientRect().width > 100).length,
          height: document.documentElement.scrollHeight};
})())"""


def browse(html_path: Path, workdir: Path, screenshot: Path, *, full_page: bool = False) -> dict[str, Any]:
    """Load the page and a control page in one Chromium; return what the browser saw."""
    binary = chromium_binary()
    assert binary is not None
    workdir.mkdir(parents=True, exist_ok=True)
    tools = DevTools(binary, workdir, time.monotonic() + 30)
    try:
        url = html_path.resolve().as_uri()
        session = tools.open(url)
        urls, errors = requests_and_errors(tools.events)
        facts = json.loads(
            tools.send("Runtime.evaluate", session, expression=PAGE_FACTS, returnByValue=True)["result"]["value"]
        )
        height = facts["height"] if full_page else 2000
        shot = tools.send(
            "Page.captureScreenshot",
            session,
            format="png",
            captureBeyondViewport=full_page,
            clip={"x": 0, "y": 0, "width": 1280, "height": height, "scale": 1},
        )
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        small = tools.send(
            "Page.captureScreenshot",
            session,
            format="png",
            clip={"x": 0, "y": 0, "width": 1280, "height": 2000, "scale": 0.25},
        )
        pdf = tools.send("Page.printToPDF", session, printBackground=True)["data"]
        control = workdir / "control.html"
        control.write_text(
            '<!DOCTYPE html><img src="http://example.invalid/pixel.png"><script>console.error("control")</script>'
        )
        tools.open(control.as_uri())
        control_urls, control_errors = requests_and_errors(tools.events)
    finally:
        tools.close()
    return {
        "url": url,
        "requests": urls,
        "errors": errors,
        "facts": facts,
        "small_png": base64.b64decode(small["data"]),
        "pdf": base64.b64decode(pdf),
        "control": (control_urls, control_errors),
    }


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Rows of RGB pixels of an 8-bit, non-interlaced RGB/RGBA PNG (pure Python + zlib)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    assert header is not None
    w, h, depth, ctype, _, _, interlace = header
    assert depth == 8 and ctype in (2, 6) and interlace == 0, header
    bpp = 3 if ctype == 2 else 4
    raw, stride, prev, rows = zlib.decompress(b"".join(idat)), w * bpp, bytearray(w * bpp), []
    for y in range(h):
        start = y * (stride + 1)
        line = unfilter(raw[start], bytearray(raw[start + 1 : start + 1 + stride]), prev, bpp)
        rows.append(bytes(line) if bpp == 3 else bytes(v for i, v in enumerate(line) if i % 4 < 3))
        prev = line
    return w, h, rows


def unfilter(kind: int, line: bytearray, prev: bytearray, bpp: int) -> bytearray:
    for i in range(len(line)):
        a = line[i - bpp] if i >= bpp else 0
        b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
        if kind == 1:
            line[i] = (line[i] + a) & 255
        elif kind == 2:
            line[i] = (line[i] + b) & 255
        elif kind == 3:
            line[i] = (line[i] + (a + b) // 2) & 255
        elif kind == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return line


def pixels(rows: list[bytes], x0: int, y0: int, x1: int, y1: int) -> Counter[tuple[int, int, int]]:
    found: Counter[tuple[int, int, int]] = Counter()
    for row in rows[y0:y1]:
        found.update(tuple(row[3 * x : 3 * x + 3]) for x in range(x0, x1))  # type: ignore[misc]
    return found


@pytest.mark.skipif(chromium_binary() is None, reason="no chromium (apt-get install chromium)")
def test_chromium_loads_offline_cleanly_and_shows_the_verdict(statement: dict[str, Any], tmp_path: Path) -> None:
    page = tmp_path / "certificate.html"
    page.write_text(render(statement), encoding="utf-8")
    seen = browse(page, tmp_path / "chromium", tmp_path / "certificate.png")

    # the harness sees requests and errors when a page makes them …
    control_urls, control_errors = seen["control"]
    assert any(u.startswith("http://example.invalid/") for u in control_urls), control_urls
    assert any("control" in e for e in control_errors), control_errors
    # … and the certificate makes none: its own navigation is the only request
    assert seen["requests"] == [seen["url"]], seen["requests"]
    assert seen["errors"] == [], seen["errors"]
    facts = seen["facts"]
    assert facts["verdict"] == "INCONCLUSIVE"
    assert facts["scripts"] == 0 and facts["resources"] == 0
    assert facts["svgs"] >= 12  # every chart laid out at a readable width
    assert facts["color"] == "rgb({}, {}, {})".format(*AMBER)

    w, h, rows = decode_png(seen["small_png"])  # the 1280×2000 viewport at 1/4 scale
    assert (w, h) == (320, 500)
    everything = pixels(rows, 0, 0, w, h)
    assert len(everything) > 50, "screenshot is (nearly) one flat color"
    assert sum(n for px, n in everything.items() if px != (255, 255, 255)) > 0.2 * w * h
    x, y, bw, bh = (round(v / 4) for v in facts["band"])
    band = pixels(rows, x + 1, y + 1, x + bw - 1, y + bh - 1)
    color, count = band.most_common(1)[0]
    assert max(abs(a - b) for a, b in zip(color, AMBER, strict=True)) <= 2, color
    assert count > 0.5 * sum(band.values())  # the band is amber, text on top of it
    assert len(band) > 10  # and it has the verdict written on it
    assert seen["pdf"].startswith(b"%PDF") and len(seen["pdf"]) > 50_000  # it prints


def test_occupancy_heatmaps_share_one_fixed_scale(statement: dict[str, Any]) -> None:
    """Two runs with very different π ranges get the same colour scale and
    legend, in units of the uniform share k/E."""
    import copy

    from moeaudit.report.html import _occupancy, _shares

    narrow = copy.deepcopy(statement["predicate"]["heatmaps"]["occupancy"])
    wide = copy.deepcopy(narrow)
    E = len(narrow["pi"][0])
    wide["pi"] = [[2.0] + [0.0] * (E - 1) for _ in wide["pi"]]  # one expert takes all (k = 2)
    a, b = _occupancy(narrow, [1]), _occupancy(wide, [1])
    assert a is not None and b is not None and a["legend"] == b["legend"]
    assert "fixed scale 0–2" in str(a["legend"]) and "uniform share" in str(a["legend"])
    assert _shares([0.25, 0.25, 0.25, 0.25]) == [1.0, 1.0, 1.0, 1.0]
    assert _shares([0.5, 0.0, 1.0, 0.5]) == [1.0, 0.0, 2.0, 1.0]


EXPORT_FACTS = """JSON.stringify((() => {
  const badge = document.querySelector('.badge[class*="v-"]');
  return {verdict: badge.innerText, color: getComputedStyle(badge).backgroundColor,
          ink: getComputedStyle(badge).color,
          scripts: document.scripts.length, resources: performance.getEntriesByType('resource').length,
          figures: [...document.querySelectorAll('figure svg')]
                     .filter(s => s.getBoundingClientRect().width > 100).length};
})())"""


@pytest.mark.skipif(chromium_binary() is None, reason="no chromium (apt-get install chromium)")
def test_chromium_renders_the_export_page_with_its_verdict_and_charts(
    statement: dict[str, Any], tmp_path: Path
) -> None:
    """The compliance export, as a browser shows it: verdict badge in colour,
    the backing charts laid out, nothing fetched, no script."""
    from moeaudit.report.export import export, to_html

    verified = {**statement, "_keyid": "0" * 64}  # as open_certificate returns it
    page = tmp_path / "export.html"
    page.write_text(to_html(export(verified, "eu-ai-act"), verified), encoding="utf-8")
    (tmp_path / "chromium").mkdir()
    tools = DevTools(chromium_binary() or "", tmp_path / "chromium", time.monotonic() + 30)
    try:
        url = page.resolve().as_uri()
        session = tools.open(url)
        urls, errors = requests_and_errors(tools.events)
        facts = json.loads(
            tools.send("Runtime.evaluate", session, expression=EXPORT_FACTS, returnByValue=True)["result"]["value"]
        )
    finally:
        tools.close()
    assert urls == [url] and errors == []
    assert facts["verdict"] == statement["predicate"]["verdict"] == "INCONCLUSIVE"
    assert facts["color"] == "rgb({}, {}, {})".format(*AMBER)  # verdict.css: as the certificate's band
    assert facts["ink"] == "rgb(43, 29, 0)"  # --amber-ink: dark text on amber, as on the certificate
    assert facts["scripts"] == 0 and facts["resources"] == 0 and facts["figures"] >= 2
