"""JSON output: finite numbers only, stable bytes, atomic writes.

SPEC §10: numbers that are not finite are ``null`` with a reason; SPEC §9: NaN/Inf never
enter a signed payload. Every file we write goes to a temp file in the same directory and
is renamed into place, so an interrupted run leaves the old file or none, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from moeaudit.errors import InputError


def sanitize(obj: Any, path: str = "", found: list[dict[str, str]] | None = None) -> Any:
    """Copy of ``obj`` with every non-finite float replaced by None, recorded in ``found``."""
    if found is None:
        found = []
    if isinstance(obj, float) and not math.isfinite(obj):
        found.append({"path": path or "$", "value": repr(obj)})
        return None
    if isinstance(obj, dict):
        return {k: sanitize(v, f"{path}.{k}" if path else str(k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v, f"{path}[{i}]", found) for i, v in enumerate(obj)]
    return obj


def finite_document(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with non-finite numbers nulled and listed under ``nonfinite``."""
    found: list[dict[str, str]] = []
    clean = sanitize(doc, found=found)
    if found:
        clean["nonfinite"] = [
            {**f, "reason": "not a finite number (NaN or Inf) in the computation"} for f in found
        ]
    return clean


def dumps(doc: Any) -> str:
    """Stable, human-readable JSON (keys in insertion order, no NaN allowed)."""
    return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def atomic_write(path: str | Path, data: str | bytes, *, force: bool = True, mode: int | None = None) -> Path:
    path = Path(path)
    if path.exists() and not force:
        raise InputError("output exists", path=path, hint="pass --force to overwrite it")
    if not path.parent.is_dir():
        raise InputError("output directory does not exist", path=path.parent)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
