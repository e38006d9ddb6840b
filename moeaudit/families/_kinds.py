"""Attention per kind of layer (``ModelSpec.attention_kinds``): the rules the families with
``layer_types`` whose attention differs by type share (MiMo-V2-Flash, Mellum)."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, partial_rotary_dim
from moeaudit.spec.config import AttentionKind


def type_rope(c: Ctx, name: str, params: Any, head_dim: int, default_factor: float = 1.0) -> tuple[float, int]:
    """(θ, rotary_dim) of one layer type's ``rope_parameters`` entry: transformers' default RoPE
    only (``rope_type`` "default"), on the first int(head_dim × partial_rotary_factor) dims of a
    head (rotary_dim 0: the whole head)."""
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope_parameters.{name} must be an object", path=c.path)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise CheckpointError(
            f"config.json: rope_parameters.{name} has rope_type {kind!r}; moeaudit replays default RoPE "
            "per layer type only",
            path=c.path,
            hint="a limit of moeaudit, not a fault of the checkpoint",
        )
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise CheckpointError(
            f"config.json: rope_parameters.{name}.rope_theta must be a positive number, got {theta!r}", path=c.path
        )
    factor = params.get("partial_rotary_factor", default_factor)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(
            f"config.json: rope_parameters.{name}.partial_rotary_factor must be in (0, 1], got {factor!r}",
            path=c.path,
        )
    dim = partial_rotary_dim(c, head_dim, float(factor))
    return float(theta), 0 if dim == head_dim else dim


def by_layer_type(
    types: list[str], kinds: dict[str, AttentionKind]
) -> tuple[tuple[AttentionKind, ...], tuple[int, ...]]:
    """(``attention_kinds``, ``layer_kinds``) for ``types`` (one per layer): the kinds the layers
    use, in the order of ``kinds``."""
    used = [name for name in kinds if name in set(types)]
    return tuple(kinds[n] for n in used), tuple(used.index(t) for t in types)
