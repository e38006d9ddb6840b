"""``config.json`` → :class:`ModelSpec`: the few numbers the replay needs, validated.

Field names and defaults follow Hugging Face transformers' configuration classes for each
family, so that a ``config.json`` written by ``save_pretrained`` (v4 or v5) reads the same
here as it does there.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moeaudit.checkpoint.layouts import FAMILIES, Layout
from moeaudit.errors import CheckpointError

# transformers' ``default_theta`` per family (RotaryEmbeddingConfigMixin falls back to 1e4).
DEFAULT_ROPE_THETA = {"mixtral": 1e6}
DEFAULT_RMS_EPS = {"mixtral": 1e-5, "olmoe": 1e-5, "qwen2_moe": 1e-6, "qwen3_moe": 1e-6}
# The expert count under either name transformers' ``attribute_map`` accepts, canonical first:
# v5 writes Qwen3-MoE's as ``num_local_experts``, the hub's v4 configs as ``num_experts``.
MAX_COUNT = 1 << 16  # layers or experts; far above any real model
EXPERT_COUNT_KEYS = {
    "mixtral": ("num_local_experts", "num_experts"),
    "olmoe": ("num_experts", "num_local_experts"),
    "qwen2_moe": ("num_experts",),
    "qwen3_moe": ("num_experts", "num_local_experts"),
}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one checkpoint, as the replay sees it."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    num_experts: int
    top_k: int
    expert_dim: int  # intermediate size of one routed expert
    routed_layers: tuple[int, ...]
    norm_topk_prob: bool
    attention_bias: bool
    qk_norm: str  # "none" | "full" (OLMoE, over all heads) | "head" (Qwen3, per head)
    clip_qkv: float | None
    tie_embeddings: bool
    dense_dim: int = 0  # intermediate size of a dense MLP layer (mlp_only_layers)
    shared_dim: int = 0  # intermediate size of the shared expert (0 = none)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layers whose attention uses the window
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        return FAMILIES[self.family]

    @property
    def routing(self) -> str:
        renorm = "renormalised" if self.norm_topk_prob else "not renormalised"
        return f"softmax top-{self.top_k} of {self.num_experts}, {renorm}"

    def is_routed(self, layer: int) -> bool:
        return layer in self.routed_layers

    def attention_window(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["routed_layers"] = list(self.routed_layers)
        out["sliding_layers"] = list(self.sliding_layers)
        out["routing"] = self.routing
        return out


def read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(
            "no config.json", path=path, hint="a checkpoint is a save_pretrained directory"
        )
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, huge ints
        raise CheckpointError(f"config.json is not valid JSON ({exc})", path=cfg_path) from exc
    if not isinstance(cfg, dict):
        raise CheckpointError("config.json is not a JSON object", path=cfg_path)
    return cfg


def spec_from_config(cfg: dict[str, Any], path: Path | str = "config.json") -> ModelSpec:
    family = cfg.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        known = ", ".join(FAMILIES)
        raise CheckpointError(
            f"unknown model family {family!r}", path=path, hint=f"supported: {known}"
        )
    get = _getter(cfg, path)
    hidden = get("hidden_size", int)
    heads = get("num_attention_heads", int)
    kv_heads = get("num_key_value_heads", int, heads) or heads
    n_layers = get("num_hidden_layers", int)
    window = _sliding_window(cfg, family)
    keys = EXPERT_COUNT_KEYS[family]
    num_experts = get(next((k for k in keys if cfg.get(k) is not None), keys[0]), int)
    top_k = get("num_experts_per_tok", int)
    if not 1 <= top_k <= num_experts:
        raise CheckpointError(f"num_experts_per_tok={top_k} not in 1..{num_experts}", path=path)
    for key, value in (("hidden_size", hidden), ("num_attention_heads", heads)):
        if value < 1:
            raise CheckpointError(f"config.json: {key!r} must be ≥ 1, got {value}", path=path)
    for key, value in (("num_hidden_layers", n_layers), ("the expert count", num_experts)):
        if value > MAX_COUNT:  # we build per-layer and per-expert tables before reading weights
            raise CheckpointError(f"config.json: {key} {value} is implausible (over {MAX_COUNT})",
                                  path=path)
    if hidden % heads and "head_dim" not in cfg:
        raise CheckpointError(f"hidden_size {hidden} not divisible by {heads} heads", path=path)
    if heads % kv_heads:
        raise CheckpointError(f"{heads} heads not divisible by {kv_heads} kv heads", path=path)
    return ModelSpec(
        family=family,
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=get("head_dim", int, None) or hidden // heads,
        rope_theta=_rope_theta(cfg, family, path),
        rms_eps=get("rms_norm_eps", float, DEFAULT_RMS_EPS[family]),
        num_experts=num_experts,
        top_k=top_k,
        expert_dim=get("intermediate_size" if family in ("mixtral", "olmoe") else "moe_intermediate_size", int),
        routed_layers=_routed_layers(cfg, family, n_layers, path),
        norm_topk_prob=True if family == "mixtral" else bool(get("norm_topk_prob", bool, False)),
        attention_bias=_attention_bias(cfg, family),
        qk_norm={"olmoe": "full", "qwen3_moe": "head"}.get(family, "none"),
        clip_qkv=get("clip_qkv", float, None) if family == "olmoe" else None,
        tie_embeddings=bool(get("tie_word_embeddings", bool, False)),
        dense_dim=get("intermediate_size", int, 0) if family.startswith("qwen") else 0,
        shared_dim=get("shared_expert_intermediate_size", int, 0) if family == "qwen2_moe" else 0,
        sliding_window=window,
        sliding_layers=_sliding_layers(cfg, family, n_layers, window, path),
    )


def _getter(cfg: dict[str, Any], path: Path | str):
    missing = object()

    def get(key: str, kind: type, default: Any = missing) -> Any:
        value = cfg.get(key, missing)
        if value is missing or (value is None and default is not missing):
            if default is missing:
                raise CheckpointError(f"config.json has no {key!r}", path=path)
            return default
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        if kind in (int, float) and isinstance(value, bool):
            ok = False
        if kind is float and ok:
            ok = _is_finite(value)
        if not ok:
            what = "a finite number" if kind is float else kind.__name__
            raise CheckpointError(f"config.json: {key!r} must be {what}, got {value!r}", path=path)
        if kind is int and value < 0:
            raise CheckpointError(f"config.json: {key!r} must be non-negative, got {value}", path=path)
        return kind(value)

    return get


def _rope_theta(cfg: dict[str, Any], family: str, path: Path | str) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise CheckpointError(f"rope type {rope_type!r} is not supported yet", path=path)
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta or cfg.get("rope_theta") or DEFAULT_ROPE_THETA.get(family, 1e4)
    number = isinstance(theta, (int, float)) and not isinstance(theta, bool)
    if not (number and _is_finite(theta) and theta > 0):
        raise CheckpointError(f"config.json: rope_theta must be a positive number, got {theta!r}",
                              path=path)
    return float(theta)


def _is_finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        return False


def _routed_layers(cfg: dict[str, Any], family: str, n_layers: int, path: Path | str) -> tuple[int, ...]:
    """Which decoder layers carry a routed MoE block (transformers' Qwen2-MoE rule)."""
    if family in ("mixtral", "olmoe"):
        return tuple(range(n_layers))
    step = _getter(cfg, path)("decoder_sparse_step", int, 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError("config.json: mlp_only_layers must be a list of ints", path=path)
    return tuple(
        i for i in range(n_layers) if i not in only and step > 0 and (i + 1) % step == 0
    )


def _attention_bias(cfg: dict[str, Any], family: str) -> bool:
    if family == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True))
    return bool(cfg.get("attention_bias", False))


def _sliding_window(cfg: dict[str, Any], family: str) -> int | None:
    if family.startswith("qwen") and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if isinstance(window, int) and window > 0 else None


def _sliding_layers(cfg: dict[str, Any], family: str, n_layers: int, window: int | None,
                    path: Path | str) -> tuple[int, ...]:
    """Mixtral and Qwen3-MoE window every layer; Qwen2-MoE only its ``layer_types`` ones.

    A config without ``layer_types`` gets transformers v5's rule for it: every other layer,
    starting with the first, below ``max_window_layers``.
    """
    if window is None:
        return ()
    if family != "qwen2_moe":
        return tuple(range(n_layers))
    types = cfg.get("layer_types")
    if types is None:
        below = _getter(cfg, path)("max_window_layers", int, 28)
        return tuple(i for i in range(n_layers) if i % 2 == 0 and i < below)
    if not isinstance(types, list) or len(types) != n_layers:
        raise CheckpointError(f"config.json: layer_types must list {n_layers} layers", path=path)
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
