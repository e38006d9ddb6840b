"""Shared fixtures; model builders live in the ``hfmodels`` package (imported lazily: needs transformers)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory ``(family, seed=0, **config_overrides) -> Path`` of a tiny saved HF checkpoint.

    Saved once per session per argument set and shared between tests: treat it as read-only
    (copy it into ``tmp_path`` before rewriting any file).
    """
    pytest.importorskip("transformers")
    from hfmodels import save_tiny

    cache: dict[str, Path] = {}

    def make(family: str, **kwargs: Any) -> Path:
        key = repr((family, sorted(kwargs.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(family)
            save_tiny(path, family, **kwargs)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def samples_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One receipts cache for every test that audits the shipped sample runs: each sample
    checkpoint is replayed once per session, whichever test needs it first."""
    return tmp_path_factory.mktemp("samples-cache")


@pytest.fixture(scope="session")
def fresh_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``{name: run directory}`` of every recipe in ``tests/fresh_runs.py``: MoE runs
    trained for real, each the first time it is looked up. With ``MOEAUDIT_FRESH_RUNS`` set to
    a directory they are kept there and reused across sessions (keyed by the module's source
    and the recipe); otherwise they live in this session's temporary directory. Shared between
    tests: copy a run into ``tmp_path`` before writing anything into it."""
    pytest.importorskip("transformers")
    import os

    import fresh_runs as fresh

    cache = os.environ.get(fresh.ENV)
    root = Path(cache) if cache else tmp_path_factory.mktemp("fresh-runs")
    root.mkdir(parents=True, exist_ok=True)
    return fresh.FreshRuns(root)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fresh_runs: uses the fresh training runs of tests/fresh_runs.py "
        "(trained once per session, or reused from $MOEAUDIT_FRESH_RUNS)",
    )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the test. Tests that demand bit-identical numbers from
    two storage layouts or code paths use it: in one thread the float kernels are the same;
    with several, a matrix product's blocking (and so its last bits) may follow the operands'
    memory layout. The product claims bit-identity per thread setting, not across them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _subprocesses_check_their_documents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Python subprocesses the tests start (``python -m moeaudit …``) validate what they write
    too: ``tests/schema_site/sitecustomize.py``, put on their ``PYTHONPATH``; each logs what it
    validated to ``MOEAUDIT_SCHEMA_LOG``."""
    site = Path(__file__).resolve().parent / "schema_site"
    log = tmp_path_factory.mktemp("schema-log") / "validated.txt"
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "MOEAUDIT_SCHEMA_CHECK", "MOEAUDIT_SCHEMA_LOG")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), saved["PYTHONPATH"]) if p)
    os.environ["MOEAUDIT_SCHEMA_CHECK"] = "1"
    os.environ["MOEAUDIT_SCHEMA_LOG"] = str(log)
    yield log
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _published_documents_match_their_schemas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every certificate, receipts and gate JSON moeaudit writes in a test is validated against
    its published JSON Schema before the test goes on (``tests/schema_check.py``)."""
    import schema_check

    import moeaudit.jsonio

    monkeypatch.setattr(moeaudit.jsonio, "atomic_write", schema_check.wrap(moeaudit.jsonio.atomic_write))
