"""Helpers of tests/test_naming.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import re
from typing import Any

from moeaudit.attest.naming import DATA_MAPS, snake

LOWER_CAMEL = re.compile(r"[a-z][a-zA-Z0-9]*")


def _field_names(value: Any, path: str = "") -> list[tuple[str, str]]:
    """(path, name) of every field name, data maps' keys left out."""
    out: list[tuple[str, str]] = []
    if isinstance(value, list):
        for v in value:
            out += _field_names(v, f"{path}[]")
    elif isinstance(value, dict):
        data = path in DATA_MAPS
        for key, v in value.items():
            if not data:
                out.append((path, key))
            out += _field_names(v, f"{path}.*" if data else f"{path}.{snake(key)}".lstrip("."))
    return out
