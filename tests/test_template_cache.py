"""The compiled certificate template is kept in the receipts cache under its HMAC (docs/decisions.md, "Receipts cache"):
a warm certify does not recompile it, the page is byte-identical either way, and bytes in the
cache that this machine's moeaudit did not write are never unmarshalled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from moeaudit.cache import ReceiptsCache
from moeaudit.report import html

FIXTURE = Path(__file__).parent / "fixtures" / "statement_example.json"


@pytest.fixture()
def statement() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture()
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the templates Jinja2 parsed from source (a bytecode hit parses nothing)."""
    seen: list[str] = []
    real = jinja2.Environment._parse

    def spy(self: jinja2.Environment, source: str, name: str | None, filename: str | None) -> Any:
        seen.append(str(name))
        return real(self, source, name, filename)

    monkeypatch.setattr(jinja2.Environment, "_parse", spy)
    return seen


def render(stmt: dict[str, Any], cache: ReceiptsCache | None) -> str:
    html._environment.cache_clear()  # a fresh process, as far as Jinja2 is concerned
    return html.render_html(stmt, keyid="k" * 64, envelope_sha256="0" * 64, compiled=cache)


def test_second_render_loads_the_compiled_template(
    tmp_path: Path, statement: dict[str, Any], parses: list[str]
) -> None:
    cache = ReceiptsCache(tmp_path)
    plain = render(statement, None)
    assert html.TEMPLATE in parses
    parses.clear()
    first = render(statement, ReceiptsCache(tmp_path))
    assert html.TEMPLATE in parses  # compiled once, and stored
    stored = sorted(tmp_path.rglob("*.bin"))
    assert stored
    parses.clear()
    second = render(statement, cache)
    assert parses == []  # nothing parsed: every template came from the cache
    assert plain == first == second


def test_foreign_bytes_are_recompiled_not_loaded(tmp_path: Path, statement: dict[str, Any], parses: list[str]) -> None:
    expected = render(statement, ReceiptsCache(tmp_path))
    stored = sorted(tmp_path.rglob("*.bin"))
    # bytecode a stranger wrote: Jinja2's own header and a code object, but a MAC made without
    # this cache's key
    for path in stored:
        mac, _, data = path.read_bytes().partition(b"\n")
        path.write_bytes(b"0" * len(mac) + b"\n" + data)
    parses.clear()
    assert render(statement, ReceiptsCache(tmp_path)) == expected
    assert html.TEMPLATE in parses  # the entry was a miss: compiled from source again
    # and the entry was rewritten under this machine's key, so the next run is a hit
    parses.clear()
    assert render(statement, ReceiptsCache(tmp_path)) == expected
    assert parses == []


def test_a_disabled_cache_stores_nothing(tmp_path: Path, statement: dict[str, Any]) -> None:
    render(statement, ReceiptsCache(tmp_path, enabled=False))
    assert list(tmp_path.rglob("*")) == []
