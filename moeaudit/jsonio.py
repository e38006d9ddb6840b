"""JSON output: finite numbers only, stable bytes, atomic writes.

Numbers that are not finite are ``null`` with a reason (README.md, "Schemas"); NaN/Inf never
enter a signed payload (docs/security.md, "What the signature binds"). Every file we write goes to a temp file in the
same directory and is renamed into place, so an interrupted run leaves the old file or none, never half of one.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from moeaudit.errors import InputError, from_os_error
from moeaudit.limits import kind_of


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


Document = TypeVar("Document", bound=Mapping[str, Any])


def finite_document(doc: Document) -> Document:
    """The document with non-finite numbers nulled and listed under ``nonfinite``."""
    found: list[dict[str, str]] = []
    clean: Any = sanitize(doc, found=found)
    if found:
        clean["nonfinite"] = [{**f, "reason": "not a finite number (NaN or Inf) in the computation"} for f in found]
    return clean


def dumps(doc: Any) -> str:
    """Stable, human-readable JSON (keys in insertion order, no NaN allowed). Lists of plain
    numbers (per-expert vectors, bootstrap replicates) sit on one line each: more readable, and
    encoded by the C encoder — with ``indent`` Python's json falls back to its pure-Python
    encoder, which spent ~0.4 s per warm certify on the replicates alone."""
    packed: list[str] = []
    try:
        shell = _pack_numbers(doc, packed)
    except _HasNul:  # a string could look like a placeholder: the plain (slower) path
        return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    text = json.dumps(shell, indent=2, ensure_ascii=False, allow_nan=False)
    if packed:
        text = _PACKED.sub(lambda m: packed[int(m.group(1))], text)
    return text + "\n"


_PACKED = re.compile(r'"\\u0000(\d+)\\u0000"')


_NUMBERS = {int, float}


class _HasNul(Exception):
    pass


def _pack_numbers(value: Any, packed: list[str]) -> Any:
    if isinstance(value, str):
        if "\x00" in value:
            raise _HasNul
        return value
    if isinstance(value, dict):
        if any("\x00" in str(k) for k in value):
            raise _HasNul
        return {k: _pack_numbers(v, packed) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > 1 and set(map(type, value)) <= _NUMBERS:  # bools are not numbers here
            packed.append(json.dumps(list(value), separators=(", ", ": "), allow_nan=False))
            return f"\u0000{len(packed) - 1}\u0000"
        return [_pack_numbers(v, packed) for v in value]
    return value


class NotStrictJSON(ValueError):
    """Valid for Python's json module but refused by :func:`strict_loads` (the message says why)."""


def strict_loads(raw: bytes | str, *, nonfinite: bool = False) -> Any:
    """JSON as every reader would read it: a key named twice in one object is refused (parsers
    disagree on which one wins), and so are ``NaN``, ``Infinity`` and numbers that overflow to
    them (not JSON; Python alone accepts them) unless ``nonfinite``, when the caller reports them
    as findings. Raises :class:`NotStrictJSON`, or ``ValueError`` for what is not JSON at all."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    try:
        if nonfinite:
            return json.loads(text, object_pairs_hook=no_duplicate_keys)
        return json.loads(
            text, object_pairs_hook=no_duplicate_keys, parse_constant=_no_constant, parse_float=_finite_float
        )
    except DuplicateKey as exc:
        raise NotStrictJSON(f"key {exc.key!r} appears twice in one object") from exc


class DuplicateKey(NotStrictJSON):
    """A JSON object names ``key`` twice (raised by :func:`no_duplicate_keys`)."""

    def __init__(self, key: str):
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The one ``object_pairs_hook`` of every JSON moeaudit reads (certificates, checkpoint
    headers and configs, canaries, logs, receipts): an object that names a key twice is refused
    with :class:`DuplicateKey` — parsers disagree on which value wins, so two readers of the same
    bytes (a signed "verdict" shadowed by another, a tensor name describing different bytes)
    could see different documents."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise NotStrictJSON(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotStrictJSON(f"{text[:40]} overflows to {value}")
    return value


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def check_output_target(path: str | Path, *, force: bool) -> None:
    """Refuse to write over anything but a regular file, and over that only with ``force``.

    ``lstat``, so a symbolic link is refused rather than followed: writing "through" a link
    (or replacing a device such as /dev/null, a FIFO or a socket with a regular file) is never
    what an output option means.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise from_os_error(exc, "cannot check the output path", path) from exc
    if not stat.S_ISREG(mode):
        raise InputError(
            f"output is {kind_of(mode)}, not a regular file",
            path=path,
            hint="moeaudit writes only regular files: choose another path",
        )
    if not force:
        raise InputError("output exists", path=path, hint="pass --force to overwrite it")


def atomic_write(path: str | Path, data: str | bytes, *, force: bool = True, mode: int | None = None) -> Path:
    """Write ``data`` to a temp file beside ``path``, flush, and move it into place.

    Without ``force`` the temp file is hard-linked into place, which fails if ``path`` appeared
    in the meantime (O_EXCL semantics). An operating-system error (full disk, permission) is
    re-raised as an OSError naming ``path``, not the temp file.
    """
    path = Path(path)
    check_output_target(path, force=force)
    if not path.parent.is_dir():
        raise InputError("output directory does not exist", path=path.parent)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        _move_into_place(tmp, path, force)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def _move_into_place(tmp: str, path: Path, force: bool) -> None:
    if not force:
        try:
            os.link(tmp, path)  # fails if path exists, whatever appeared there since the check
            return
        except FileExistsError:
            check_output_target(path, force=False)  # says what is there now
            raise
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise  # a file system without hard links falls back to replace below
    check_output_target(path, force=True)  # it may have become a link or a FIFO since the check
    os.replace(tmp, path)
