"""Field names of the signed predicate: lowerCamelCase on the wire, snake_case inside.

in-toto asks predicates for lowerCamelCase field names (its new-predicate guidelines); the
receipts, the envelope report and the policy keep the snake_case names README.md, "Schemas" fixes for them.
The certificate's predicate (``…/training-health/v2``) therefore carries the camelCase form of
each name (``pi_min`` → ``piMin``, ``issued_at`` → ``issuedAt``), one to one, and everything
that reads a verified statement converts it back, so the renderers, the export and ``verify``
see the names the rest of moeaudit uses. A v1 predicate (snake_case on the wire) is read as it is.

Keys that are data rather than field names — layer indices, series names, domain names — are
never converted: the maps that hold them are listed in ``DATA_MAPS`` by their path.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from moeaudit.records import Predicate, data_map_paths

# Paths (from the predicate; ``[]`` for a list's items, ``*`` for a data map's keys) of the
# maps whose keys are data, read from the predicate's record type: every map typed
# ``Annotated[dict[str, ...], DATA_KEYS]`` in :mod:`moeaudit.records` (``envelope.series``,
# ``gates[].structural.c2_tolerance``, ``heatmaps.domains.layers.*``, …). A new map of data is
# marked there; tests/test_naming.py checks the golden certificate both ways and a canary whose
# domain names look like field names, and test_certify_families checks every family's wire names.
DATA_MAPS: frozenset[str] = data_map_paths(Predicate)

# snake_case whose every part starts with a letter: exactly the names camel() can undo
_SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z][a-z0-9]*)+")
_CAMEL = re.compile(r"[a-z][a-z0-9]*(?:[A-Z][a-z0-9]*)+")


def camel(name: str) -> str:
    """``pi_min`` → ``piMin``; a name without an underscore is unchanged."""
    if not _SNAKE.fullmatch(name):
        return name
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def snake(name: str) -> str:
    """``piMin`` → ``pi_min``: the inverse of :func:`camel` on every name it converts."""
    if not _CAMEL.fullmatch(name):
        return name
    return re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), name)


def _convert(value: Any, rename: Callable[[str], str], path: str) -> Any:
    if isinstance(value, list):
        return [_convert(v, rename, f"{path}[]") for v in value]
    if not isinstance(value, dict):
        return value
    data = path in DATA_MAPS
    out = {}
    for key, v in value.items():
        inner = f"{path}.*" if data else f"{path}.{snake(key)}".lstrip(".")  # paths in snake_case
        out[key if data else rename(key)] = _convert(v, rename, inner)
    return out


def to_wire(predicate: dict[str, Any]) -> dict[str, Any]:
    """The predicate as signed: every field name lowerCamelCase."""
    wire: dict[str, Any] = _convert(predicate, camel, "")
    return wire


def from_wire(predicate: dict[str, Any]) -> dict[str, Any]:
    """A signed v2 predicate with moeaudit's own (snake_case) names."""
    own: dict[str, Any] = _convert(predicate, snake, "")
    return own


def wire_path(field: str) -> str:
    """A field reference (``predicate.gates[].receipts.nll_by_domain``, or several joined by
    commas) in wire names, for reports that point into the signed statement."""
    return _SNAKE.sub(lambda m: camel(m.group(0)), field)
