"""What a checkpoint must hold: the weight files a loader reads, each decoder layer's canonical
tensors and their shapes (read off the layer's typed blocks, ``spec.blocks``), and the
architecture fields two compared checkpoints must share, and which layer a tensor key is of."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Protocol

from moeaudit.errors import InputError
from moeaudit.spec.config import ModelSpec

# transformers' pickled and other frameworks' weight names (a loader told not to use safetensors
# reads them); any ``*.safetensors`` is a weight file too
_OTHER_WEIGHTS = re.compile(r"(pytorch_model|tf_model|flax_model)(-\d+-of-\d+)?\.(bin|h5|msgpack)(\.index\.json)?")


def weight_files(path: Path) -> list[str]:
    """The weight files at the top of a checkpoint directory, where a loader looks for them:
    ``*.safetensors``, and ``pytorch_model*.bin`` (with its index), ``tf_model.h5``,
    ``flax_model.msgpack``. Subdirectories are not read by ``from_pretrained``; their files are
    still covered by the digest and the signed file list."""
    return sorted(
        e.name
        for e in os.scandir(path)
        if not e.is_dir() and (e.name.endswith(".safetensors") or _OTHER_WEIGHTS.fullmatch(e.name))
    )


def expected_layer_names(s: ModelSpec, layer: int) -> list[str]:
    """The canonical per-layer tensors a checkpoint of ``s`` holds for ``layer``: its blocks'
    (``spec.blocks.Layer.names``)."""
    return s.layers[layer].names()


def expected_shapes(s: ModelSpec, fused_format: str | None = None, layer: int = -1) -> dict[str, tuple[int, ...]]:
    """The shape of each of ``layer``'s canonical tensors and of its routed experts' under ``s``
    (``spec.blocks.Layer.shapes``); ``layer`` −1: those of every layer (the first layer's where
    two layers differ)."""
    fused = fused_format or s.layout.fused_format
    layers = s.layers if layer < 0 else (s.layers[layer],)
    shapes: dict[str, tuple[int, ...]] = {}
    for one in reversed(layers):
        shapes.update(one.shapes(s.hidden_size, fused))
    return shapes


ARCH_FIELDS = (
    "family",
    "num_layers",
    "routed_layers",
    "num_experts",
    "top_k",
    "hidden_size",
    "vocab_size",
    "expert_dim",
    "num_heads",
    "num_kv_heads",
    "head_dim",
)


def _layer_index(key: str) -> int | None:
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


class _Described(Protocol):
    """What :func:`check_compatible` reads of a checkpoint."""

    @property
    def path(self) -> Path: ...

    @property
    def spec(self) -> ModelSpec: ...


def check_compatible(a: _Described, b: _Described) -> None:
    for name in ARCH_FIELDS:
        va, vb = getattr(a.spec, name), getattr(b.spec, name)
        if va != vb:
            raise InputError(
                f"{a.path} and {b.path} have different architectures ({name}: {va} vs {vb})",
                hint="compare checkpoints of the same model",
            )
