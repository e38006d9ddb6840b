"""Tiny transformers models of every family moeaudit replays, for the oracle and end-to-end tests.

One module per family group holds its table of tiny configurations (``TINY``: family → the
keyword arguments that differ from ``core.COMMON``) and, where ``save_tiny`` cannot build the
checkpoint, its savers (``SAVERS``: model type → ``save(path)``). This module merges them
explicitly: ``REGISTRY`` (every tiny configuration ``tiny_config`` / ``tiny_model`` /
``save_tiny`` build) and ``SAVERS``; importing a group registers nothing. ``save_any`` saves a
tiny seeded checkpoint of any family in ``moeaudit.families.FAMILIES`` (``ALL``).

Importing this package needs transformers; test modules guard with
``pytest.importorskip("transformers")`` first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hfmodels import (
    afmoe,
    aliases,
    aliases2,
    base,
    famc,
    famd,
    fame,
    flex_olmo,
    hy_v4,
    jetmoe,
    kda,
    llama4,
    longcat,
    mamba,
    mimo,
    more,
    nemotron,
    step,
    wrap,
)
from hfmodels.base import DEEPSEEK, FAMILIES, NEW_FAMILIES
from hfmodels.core import COMMON, VOCAB, load, random_tokens, redraw, save_tiny, tiny_config, tiny_model
from moeaudit.families import FAMILIES as _REPLAYED


def _merged(*tables: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for table in tables:
        twice = set(out) & set(table)
        assert not twice, f"tiny configurations given twice: {sorted(twice)}"
        out.update(table)
    return out


REGISTRY: dict[str, dict[str, Any]] = _merged(
    base.TINY,
    famc.TINY,
    famd.TINY,
    fame.TINY,
    aliases.TINY,
    aliases2.TINY,
    afmoe.TINY,
    flex_olmo.TINY,
    hy_v4.TINY,
    jetmoe.TINY,
    kda.TINY,
    longcat.TINY,
    mamba.TINY,
    mimo.TINY,
    more.TINY,
    nemotron.TINY,
)

# model types whose tiny checkpoint is not ``save_tiny(path, model_type)``: wrappers, relabelled
# types, causal-LM classes AutoModelForCausalLM does not map, and longcat_flash (its sub-block norm
# gains drawn near 1 in the file)
SAVERS: dict[str, Callable[[Path], None]] = _merged(
    aliases2.SAVERS,
    wrap.SAVERS,
    step.SAVERS,
    {
        "qwen3_5_moe": lambda p: famc.save_tiny_qwen3_5_moe(p),
        "llama4": llama4.save_llama4,
        "longcat_flash": lambda p: longcat.save_longcat(p),
    },
)

ALL = tuple(_REPLAYED)


def save_any(path: Path, family: str) -> Path:
    """Save a tiny seeded checkpoint of ``family`` at ``path``; return ``path``."""
    if family in SAVERS:
        SAVERS[family](path)
    else:
        save_tiny(path, family)
    return path


__all__ = [
    "ALL",
    "COMMON",
    "DEEPSEEK",
    "FAMILIES",
    "NEW_FAMILIES",
    "REGISTRY",
    "SAVERS",
    "VOCAB",
    "load",
    "random_tokens",
    "redraw",
    "save_any",
    "save_tiny",
    "tiny_config",
    "tiny_model",
]
