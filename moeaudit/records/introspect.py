"""Introspection of the record types: what the schema generator (:mod:`moeaudit.schemas`) and
the wire naming (:mod:`moeaudit.attest.naming`) read (:mod:`moeaudit.records`)."""

import sys
import types
import typing
from collections.abc import Iterator
from typing import Any

from moeaudit.records.common import DATA_KEYS

if sys.version_info >= (3, 11):
    _NOT_REQUIRED: tuple[Any, ...] = (typing.NotRequired, typing.Required)
else:  # pragma: no cover - Python 3.10
    import typing_extensions

    _NOT_REQUIRED = (typing_extensions.NotRequired, typing_extensions.Required)


def is_record(tp: Any) -> bool:
    return isinstance(tp, type) and typing.is_typeddict(tp)


def fields(record: type) -> dict[str, Any]:
    """Field name → type of a record (``NotRequired`` unwrapped; ``Annotated`` kept)."""
    hints = typing.get_type_hints(record, include_extras=True)
    return {name: _unwrap(tp) for name, tp in hints.items()}


def required(record: type) -> frozenset[str]:
    return frozenset(getattr(record, "__required_keys__", frozenset()))


def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) in _NOT_REQUIRED:
        (tp,) = typing.get_args(tp)
    return tp


def is_data_map(tp: Any) -> bool:
    """``Annotated[dict[str, X], DATA_KEYS]``: a map whose keys are data, not field names."""
    return typing.get_origin(tp) is typing.Annotated and any(a is DATA_KEYS for a in tp.__metadata__)


def data_map_paths(record: type) -> frozenset[str]:
    """Paths (``a.b``, ``[]`` for a list's items, ``*`` for a map's keys) of every data map under
    ``record``: what :mod:`moeaudit.attest.naming` keeps unrenamed."""
    return frozenset(p for p, tp in _walk(record, "") if is_data_map(tp))


def _walk(tp: Any, path: str, seen: tuple[type, ...] = ()) -> Iterator[tuple[str, Any]]:
    yield path, tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        inner = args[0]
        for p, t in _walk(inner, path, seen):
            if p != path:
                yield p, t
    elif is_record(tp):
        if tp in seen:
            return
        for name, ftp in fields(tp).items():
            yield from _walk(ftp, f"{path}.{name}".lstrip("."), (*seen, tp))
    elif origin is list:
        yield from _walk(args[0], f"{path}[]", seen)
    elif origin is dict:
        yield from _walk(args[1], f"{path}.*", seen)
    elif origin in (typing.Union, types.UnionType):
        for arm in args:
            for p, t in _walk(arm, path, seen):
                if p != path:
                    yield p, t
