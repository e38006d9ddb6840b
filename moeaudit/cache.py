"""Receipts cache: re-auditing an unchanged run costs almost nothing (issue 6).

Entries are JSON documents keyed by SHA-256 of (kind, checkpoint root digest(s), canary digest,
tool version, receipt settings). They live under ``$MOEAUDIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/moeaudit``, else ``~/.cache/moeaudit``. Writes are atomic (temp + rename), so
concurrent runs at worst compute the same entry twice; a corrupt or foreign entry is ignored
and recomputed, never trusted.

Tensor entries (safetensors, never pickle) hold a baseline's anchor states, so that adding one
checkpoint to a run replays only that checkpoint: its pair receipts need the baseline's states
(SPEC §5), which the baseline's cached receipts do not carry. They are N·H floats per routed
layer, so entries above ``TENSORS_MAX_BYTES`` are not written (the baseline is then replayed).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit import __version__
from moeaudit.jsonio import atomic_write, dumps

if TYPE_CHECKING:
    import torch

TENSORS_MAX_BYTES = 1 << 30  # z and y of a 4096-token canary at H = 4096 over 8 routed layers


def cache_dir() -> Path:
    if os.environ.get("MOEAUDIT_CACHE_DIR"):
        return Path(os.environ["MOEAUDIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moeaudit"


class ReceiptsCache:
    def __init__(self, root: Path | None = None, enabled: bool = True):
        self.root = root or cache_dir()
        self.enabled = enabled
        self.hits = self.misses = 0

    @staticmethod
    def key(kind: str, *parts: Any) -> str:
        material = json.dumps([kind, __version__, *parts], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(material.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        try:
            entry = json.loads(self._path(key).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            self.misses += 1
            return None
        if not isinstance(entry, dict) or entry.get("key") != key or "document" not in entry:
            self.misses += 1
            return None
        self.hits += 1
        return entry["document"]

    def put(self, key: str, document: dict[str, Any]) -> None:
        if not self.enabled:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, dumps({"key": key, "document": document}))
        except OSError:
            pass  # a cache that cannot be written is a slower run, not a failed one

    def _tensor_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def get_tensors(self, key: str) -> dict[str, torch.Tensor] | None:
        """Tensors stored under ``key``, or None (disabled, absent, corrupt or foreign)."""
        if not self.enabled:
            return None
        from moeaudit.checkpoint.safetensors import SafetensorsFile
        from moeaudit.errors import MoeauditError

        try:
            f = SafetensorsFile(self._tensor_path(key))
            if f.metadata.get("key") != key:
                raise ValueError("foreign entry")
            tensors = {name: f.read(name) for name in f.tensors}
        except (OSError, ValueError, MoeauditError):
            self.misses += 1
            return None
        self.hits += 1
        return tensors

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Store ``tensors`` under ``key`` unless disabled or larger than TENSORS_MAX_BYTES."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if not self.enabled or size > TENSORS_MAX_BYTES:
            return False
        from moeaudit.checkpoint.safetensors import write_safetensors

        path = self._tensor_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(path, tensors, metadata={"key": key})
        except OSError:
            return False
        return True
