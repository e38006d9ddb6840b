"""``config.json``'s RoPE settings → the replay's: θ, YaRN, Llama 3 scaling, and MLA's softmax scale,
read as transformers' ``rope_parameters`` / ``rope_scaling`` (v5 / v4) and validated."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.spec.config import Llama3Rope, Yarn, _is_finite, getter
from moeaudit.spec.geometry import MLA


def rope(
    cfg: dict[str, Any], default_theta: float, path: Path | str, mla: MLA | None
) -> tuple[float, float | None, Yarn | None]:
    """(θ, softmax scale, YaRN): the scale is None (head_dim ** -0.5) except for MLA, whose
    query and key heads are ``qk_nope + qk_rope`` wide, and whose scale YaRN's
    ``mscale_all_dim`` multiplies by mscale² (transformers' ``yarn_apply_mscale``)."""
    theta = _rope_theta(cfg, default_theta, path)
    yarn = _yarn(cfg, path)
    scale = None if mla is None else mla.qk_head_dim**-0.5
    if scale is not None and yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return theta, scale, yarn


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return params if isinstance(params, dict) else {}


def _yarn(cfg: dict[str, Any], path: Path | str) -> Yarn | None:
    """transformers' ``_compute_yarn_parameters`` inputs, validated; None for default RoPE."""
    p = _rope_params(cfg)
    if p.get("rope_type", p.get("type", "default")) != "yarn":
        return None

    def num(key: str, default: float | None) -> float | None:
        value = p.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _is_finite(value):
            raise CheckpointError(f"config.json: rope {key!r} must be a number, got {value!r}", path=path)
        return float(value)

    original = num("original_max_position_embeddings", None)
    if original is None or original <= 0:
        raise CheckpointError("config.json: YaRN RoPE needs original_max_position_embeddings", path=path)
    factor = num("factor", None)
    if factor is None:
        factor = float(getter(cfg, path)("max_position_embeddings", int)) / original
    if factor <= 0:
        raise CheckpointError(f"config.json: YaRN factor must be positive, got {factor!r}", path=path)
    mscale, mscale_all_dim = num("mscale", None), num("mscale_all_dim", None)
    for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value == 0:  # transformers reads 0 as absent, DeepSeek's reference code as 0
            raise CheckpointError(
                f"config.json: YaRN {key}=0 is ambiguous, moeaudit does not replay it",
                path=path,
                hint="remove the key, or give the value the model was trained with",
            )
    attention_factor = num("attention_factor", None)
    if attention_factor is None:
        attention_factor = (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else yarn_mscale(factor)
        )
    beta_fast, beta_slow = num("beta_fast", 32.0), num("beta_slow", 1.0)
    assert beta_fast is not None and beta_slow is not None
    if not (beta_fast > 0 and beta_slow > 0):  # log(0) in the correction range: refused, not defaulted
        raise CheckpointError(
            f"config.json: YaRN beta_fast and beta_slow must be positive, got {beta_fast!r} and {beta_slow!r}",
            path=path,
        )
    return Yarn(
        factor=factor,
        original_max_positions=original,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        attention_factor=attention_factor,
        mscale_all_dim=mscale_all_dim or 0.0,
        truncate=bool(p.get("truncate", True)),
    )


def llama3_rope(cfg: dict[str, Any], path: Path | str) -> Llama3Rope | None:
    """transformers' ``_compute_llama3_parameters`` inputs, validated; None for other RoPE."""
    p = _rope_params(cfg)
    if p.get("rope_type", p.get("type", "default")) != "llama3":
        return None
    values = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        v = p.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _is_finite(v) or v <= 0:
            raise CheckpointError(f"config.json: llama3 RoPE needs a positive {key!r}, got {v!r}", path=path)
        values[key] = float(v)
    if values["high_freq_factor"] < values["low_freq_factor"]:
        raise CheckpointError("config.json: llama3 RoPE needs high_freq_factor ≥ low_freq_factor", path=path)
    return Llama3Rope(
        values["factor"],
        values["low_freq_factor"],
        values["high_freq_factor"],
        values["original_max_position_embeddings"],
    )


def _rope_theta(cfg: dict[str, Any], default_theta: float, path: Path | str) -> float:
    params = _rope_params(cfg)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn", "llama3", "longrope", None):
        raise CheckpointError(f"rope type {rope_type!r} is not supported yet", path=path)
    # the first present: rope_parameters (v5), then the top level (v4); only an absent (or null)
    # key takes the family default — an explicit 0 is refused, never read as "use the default"
    theta = next((t for t in (params.get("rope_theta"), cfg.get("rope_theta")) if t is not None), default_theta)
    number = isinstance(theta, (int, float)) and not isinstance(theta, bool)
    if not (number and _is_finite(theta) and theta > 0):
        raise CheckpointError(
            f"config.json: rope_theta must be a positive number, got {theta!r}",
            path=path,
            hint="remove the key to use the family's default",
        )
    return float(theta)
