"""Shared fixtures; model builders live in ``hf_models`` (imported lazily: needs transformers)."""

from __future__ import annotations

from collections.abc import Callable
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
    from hf_models import save_tiny

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
