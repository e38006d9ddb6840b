"""How many independent units a canary holds: distinct windows and distinct token contexts.

Every interval a gate reads resamples the canary's windows, and the health floors read its
tokens as draws of the router's input (docs/decisions.md, "A canary of repeated content"). A
window that repeats another adds no draw, and neither does a token whose causal context the
canary already holds: the replay is deterministic, so the same context routes the same way.

A context is the window's prefix up to and including the token. A prefix of one repeated token
id counts once per id, whatever its length: causal attention over identical values returns that
value whatever its weights, and rotary positions enter the weights only, so every position of such
a prefix reaches the router as the same state (exact for the softmax-attention families; for a
recurrent mixer it undercounts, which errs toward an unresolved floor, never toward a failure).
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, TypedDict

from moeaudit.canary import DIGEST_PREFIX


class CanaryUnits(TypedDict, total=False):
    """The receipts canary record's repeat counts (``moeaudit.records.CanaryRecord``)."""

    distinct_windows: int
    distinct_contexts: int


def _rows(canary: Any) -> list[bytes]:
    """Each window's tokens as little-endian int32 bytes, read off the digest's own encoding:
    no numpy, so a fully cached ``certify`` stays light (tests/test_torch_free.py)."""
    W, T = canary.num_windows, canary.window_len
    start = len(DIGEST_PREFIX) + struct.calcsize("<QQ")
    tokens = canary.canonical_bytes()[start : start + 4 * W * T]
    return [tokens[4 * T * w : 4 * T * (w + 1)] for w in range(W)]


def distinct_windows(canary: Any) -> int:
    """The number of distinct windows (token rows) of ``canary``."""
    return len(set(_rows(canary)))


def distinct_contexts(canary: Any) -> int:
    """The number of distinct causal contexts over every position of every window."""
    nodes: dict[Any, int] = {}  # a trie of the prefixes: (parent node, token) → node
    counted: set[Any] = set()
    for raw in dict.fromkeys(_rows(canary)):  # a repeated window adds no context
        row = array("i", raw)
        if sys.byteorder == "big":
            row.byteswap()
        node, first, uniform = -1, row[0], True
        for tok in row:
            uniform = uniform and tok == first
            node = nodes.setdefault((node, tok), len(nodes))  # the prefix itself, length included
            counted.add(("same", first) if uniform else node)  # a repeated-id prefix: one context
    return len(counted)


def canary_units(canary: Any) -> CanaryUnits:
    """The receipts' record of repeated content: ``distinct_windows`` when some window repeats
    another, ``distinct_contexts`` when some context repeats; empty for a canary of distinct
    content (the record, and every digest over it, is then unchanged)."""
    out: CanaryUnits = {}
    windows, tokens = distinct_windows(canary), distinct_contexts(canary)
    if windows < canary.num_windows:
        out["distinct_windows"] = windows
    if tokens < canary.num_windows * canary.window_len:
        out["distinct_contexts"] = tokens
    return out
