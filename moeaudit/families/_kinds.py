"""Attention per kind of layer (``ModelSpec.attention_kinds``): the rules the families with
``layer_types`` whose attention differs by type share (MiMo-V2-Flash, Mellum)."""

from __future__ import annotations

from pathlib import Path
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


def by_type_and_heads(
    c: Ctx, types: list[str], heads: list[int], kv: int, D: int, params: dict[str, Any]
) -> tuple[tuple[AttentionKind, ...], tuple[int, ...]]:
    """(``attention_kinds``, ``layer_kinds``) with one kind per (layer type, query head count)
    used: that type's RoPE (``params``, ``rope_parameters`` per type), ``heads[i]`` query heads
    over ``kv`` key/value heads of ``D`` (Laguna, Step 3.5)."""
    kinds: dict[str, AttentionKind] = {}
    names = []
    for t, n in zip(types, heads, strict=True):
        if n % kv:
            raise CheckpointError(f"config.json: {n} heads not divisible by {kv} kv heads", path=c.path)
        name = f"{t}/{n}"
        if name not in kinds:
            theta, rotary = type_rope(c, t, params[t], D)
            kinds[name] = AttentionKind(t, n, kv, D, theta, rotary)
        names.append(name)
    return by_layer_type(names, kinds)


def types_and_ropes(
    cfg: dict[str, Any], path: Path | str, family: str, default_rope: dict[str, Any]
) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """(``layer_types``, ``rope_parameters`` per type, the entries of the types used in the order
    of ``default_rope``) of a config whose RoPE is given per layer type (Laguna, Mellum); absent:
    every layer full attention, the family's default RoPE per type."""
    kinds = tuple(default_rope)
    layers = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types") or ["full_attention"] * (layers if isinstance(layers, int) else 0)
    if not isinstance(types, list) or not set(types) <= set(kinds):
        raise CheckpointError("config.json: layer_types must list 'full_attention' / 'sliding_attention'", path=path)
    params = cfg.get("rope_parameters") or default_rope
    if not isinstance(params, dict) or not set(params) <= set(kinds) or not all(t in params for t in set(types)):
        raise CheckpointError(
            f"config.json: {family}'s rope_parameters must be given per layer type "
            f"({' / '.join(kinds)}), for every type layer_types uses",
            path=path,
        )
    return types, params, [params[t] for t in kinds if t in set(types)]


def by_layer_type(
    types: list[str], kinds: dict[str, AttentionKind]
) -> tuple[tuple[AttentionKind, ...], tuple[int, ...]]:
    """(``attention_kinds``, ``layer_kinds``) for ``types`` (one per layer): the kinds the layers
    use, in the order of ``kinds``."""
    used = [name for name in kinds if name in set(types)]
    return tuple(kinds[n] for n in used), tuple(used.index(t) for t in types)
