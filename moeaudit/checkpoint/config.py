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
from moeaudit.checkpoint.safetensors import DuplicateKey, no_duplicate_keys
from moeaudit.errors import CheckpointError

# transformers' ``default_theta`` per family (RotaryEmbeddingConfigMixin falls back to 1e4).
DEFAULT_ROPE_THETA = {"mixtral": 1e6}
DEFAULT_RMS_EPS = {"mixtral": 1e-5, "olmoe": 1e-5, "qwen2_moe": 1e-6, "qwen3_moe": 1e-6,
                   "deepseek_v2": 1e-6, "deepseek_v3": 1e-6}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
# DeepSeek's q_a / kv_a RMSNorms are built without the config's eps (transformers' default).
MLA_NORM_EPS = 1e-6
# The expert count under either name transformers' ``attribute_map`` accepts, canonical first:
# v5 writes Qwen3-MoE's as ``num_local_experts``, the hub's v4 configs as ``num_experts``.
MAX_COUNT = 1 << 16  # layers or experts; far above any real model
EXPERT_COUNT_KEYS = {
    "mixtral": ("num_local_experts", "num_experts"),
    "olmoe": ("num_experts", "num_local_experts"),
    "qwen2_moe": ("num_experts",),
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "deepseek_v2": ("n_routed_experts", "num_experts", "num_local_experts"),
    "deepseek_v3": ("n_routed_experts", "num_local_experts", "num_experts"),
}


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and a shared kv latent."""

    q_lora_rank: int  # 0: a plain q_proj
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs (x0, x1), (x2, x3), … as DeepSeek lays them out

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (the released DeepSeek-V2/V3 configs use it)."""

    factor: float
    original_max_positions: float
    beta_fast: float
    beta_slow: float
    attention_factor: float  # multiplies cos and sin
    mscale_all_dim: float  # MLA: the softmax scale gets yarn_mscale(factor, this)² (0: none)
    truncate: bool


@dataclass(frozen=True)
class Gate:
    """How a router turns scores into an active set, beyond softmax-then-top-k.

    ``scoring`` "softmax" or "sigmoid"; ``selection_bias``: a per-expert bias added to the
    scores for choosing experts only (DeepSeek-V3 ``e_score_correction_bias``); groups: the
    experts split into ``n_group`` equal groups, each scored by ``group_score`` ("top2sum" of
    its selection scores, V3; "max", V2), and only the ``topk_group`` best groups compete;
    ``scaling`` multiplies the combine weights (``routed_scaling_factor``)."""

    scoring: str = "softmax"
    selection_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "none"
    scaling: float = 1.0

    @property
    def grouped(self) -> bool:
        return self.n_group > 1 and self.topk_group < self.n_group


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
    gate: Gate = Gate()
    mla: MLA | None = None
    shared_gated: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert; DeepSeek: none
    mtp_layers: int = 0  # multi-token-prediction modules stored after the decoder (not replayed)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    yarn: Yarn | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        return FAMILIES[self.family]

    @property
    def routing(self) -> str:
        g = self.gate
        renorm = "renormalised" if self.norm_topk_prob else "not renormalised"
        out = f"{g.scoring} top-{self.top_k} of {self.num_experts}"
        if g.grouped:
            out += f" within the best {g.topk_group} of {g.n_group} groups"
        if g.selection_bias:
            out += ", selection bias"
        out += f", {renorm}"
        if g.scaling != 1.0:
            out += f", ×{g.scaling:g}"
        return out

    def is_routed(self, layer: int) -> bool:
        return layer in self.routed_layers

    def attention_window(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["routed_layers"] = list(self.routed_layers)
        out["sliding_layers"] = list(self.sliding_layers)
        if self.mla is None:
            del out["mla"]
        out["routing"] = self.routing
        return out


def read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(
            "no config.json", path=path, hint="a checkpoint is a save_pretrained directory"
        )
    try:
        raw = cfg_path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=cfg_path) from exc
    return parse_config(raw, cfg_path)


def parse_config(raw: bytes, cfg_path: Path) -> dict[str, Any]:
    """The bytes of a ``config.json`` as a JSON object; a repeated key is an error (which of
    the two values counts would be up to the reader)."""
    try:
        cfg = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:
        raise CheckpointError(f"config.json: repeats the key {exc.key!r}", path=cfg_path,
                              hint="keep one of the two values") from exc
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, huge ints
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
    deepseek = family in DEEPSEEK
    if hidden % heads and "head_dim" not in cfg and not deepseek:
        raise CheckpointError(f"hidden_size {hidden} not divisible by {heads} heads", path=path)
    if heads % kv_heads:
        raise CheckpointError(f"{heads} heads not divisible by {kv_heads} kv heads", path=path)
    mla = _mla(cfg, family, path) if deepseek else None
    rope_theta, attention_scale, yarn = _rope(cfg, family, path, mla)
    spec = ModelSpec(
        family=family,
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=mla.qk_rope_dim if mla else get("head_dim", int, None) or hidden // heads,
        rope_theta=rope_theta,
        rms_eps=get("rms_norm_eps", float, DEFAULT_RMS_EPS[family]),
        num_experts=num_experts,
        top_k=top_k,
        expert_dim=get("intermediate_size" if family in ("mixtral", "olmoe") else "moe_intermediate_size", int),
        routed_layers=_routed_layers(cfg, family, n_layers, path),
        norm_topk_prob=_norm_topk_prob(cfg, family, path),
        attention_bias=_attention_bias(cfg, family),
        qk_norm={"olmoe": "full", "qwen3_moe": "head"}.get(family, "none"),
        clip_qkv=get("clip_qkv", float, None) if family == "olmoe" else None,
        tie_embeddings=bool(get("tie_word_embeddings", bool, False)),
        dense_dim=get("intermediate_size", int, 0) if family.startswith(("qwen", "deepseek")) else 0,
        shared_dim=_shared_dim(cfg, family, path),
        sliding_window=window,
        sliding_layers=_sliding_layers(cfg, family, n_layers, window, path),
        gate=_gate(cfg, family, num_experts, top_k, path),
        mla=mla,
        shared_gated=family == "qwen2_moe",
        mtp_layers=get("num_nextn_predict_layers", int, 0) if deepseek else 0,
        attention_scale=attention_scale,
        yarn=yarn,
    )
    _check_sizes(spec, cfg, path)
    return spec


def _check_sizes(spec: ModelSpec, cfg: dict[str, Any], path: Path | str) -> None:
    """Sizes the replay divides by or loops over: zero (or odd, for RoPE) would be a crash
    or a silently empty audit later, so they are errors here, naming the config key."""
    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"config.json: {what}", path=path)

    for key, value in (("num_hidden_layers", spec.num_layers), ("vocab_size", spec.vocab_size),
                       ("the expert intermediate size", spec.expert_dim)):
        if value < 1:
            raise fail(f"{key} must be ≥ 1, got {value}")
    if spec.head_dim < 2 or spec.head_dim % 2:
        given = cfg.get("head_dim")
        source = (f"head_dim {given}" if given else
                  f"hidden_size {spec.hidden_size} // {spec.num_heads} heads = {spec.head_dim}")
        if spec.mla is not None:
            source = f"qk_rope_head_dim {spec.head_dim}"
        raise fail(f"the attention head size must be even and ≥ 2 (RoPE rotates pairs); "
                   f"{source}")
    if spec.rms_eps < 0:
        raise fail(f"rms_norm_eps must be ≥ 0, got {spec.rms_eps}")
    if not spec.routed_layers:
        raise CheckpointError(
            f"config.json: none of the {spec.num_layers} decoder layers is a routed MoE layer",
            path=path, hint="check decoder_sparse_step, mlp_only_layers or first_k_dense_replace; "
                            "moeaudit audits MoE routing")


def _norm_topk_prob(cfg: dict[str, Any], family: str, path: Path | str) -> bool:
    """Mixtral always renormalises; transformers' DeepSeek-V2 never does (its router has no
    such step, whatever the config says); V3 defaults to it; the others default to not."""
    if family == "mixtral":
        return True
    if family == "deepseek_v2":
        return False
    return bool(_getter(cfg, path)("norm_topk_prob", bool, family == "deepseek_v3"))


def _shared_dim(cfg: dict[str, Any], family: str, path: Path | str) -> int:
    get = _getter(cfg, path)
    if family == "qwen2_moe":
        return get("shared_expert_intermediate_size", int, 0)
    if family in DEEPSEEK:
        n_shared = get("n_shared_experts", int, 1 if family == "deepseek_v3" else 2)
        return n_shared * get("moe_intermediate_size", int)
    return 0


def _mla(cfg: dict[str, Any], family: str, path: Path | str) -> MLA:
    get = _getter(cfg, path)
    mla = MLA(
        q_lora_rank=get("q_lora_rank", int, 0),
        kv_lora_rank=get("kv_lora_rank", int, 512),
        qk_nope_dim=get("qk_nope_head_dim", int, 128),
        qk_rope_dim=get("qk_rope_head_dim", int, 64),
        v_head_dim=get("v_head_dim", int, 128),
        # transformers' V2 applies RoPE to complex pairs: the interleaved layout, always.
        rope_interleave=family == "deepseek_v2" or bool(get("rope_interleave", bool, True)),
    )
    if mla.kv_lora_rank < 1 or mla.qk_rope_dim < 2 or mla.qk_rope_dim % 2 or mla.v_head_dim < 1:
        raise CheckpointError("config.json: MLA needs kv_lora_rank ≥ 1, an even "
                              "qk_rope_head_dim ≥ 2 and v_head_dim ≥ 1", path=path)
    return mla


def _gate(cfg: dict[str, Any], family: str, num_experts: int, top_k: int,
          path: Path | str) -> Gate:
    if family not in DEEPSEEK:
        return Gate()
    get = _getter(cfg, path)
    v3 = family == "deepseek_v3"
    method = "noaux_tc" if v3 else get("topk_method", str, "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise CheckpointError(f"config.json: topk_method {method!r} is not supported", path=path,
                              hint="supported: greedy, group_limited_greedy (V2), noaux_tc (V3)")
    scoring = "sigmoid" if v3 else "softmax"
    grouped = v3 or method == "group_limited_greedy"
    n_group = get("n_group", int, 8 if v3 else 1) if grouped else 1
    topk_group = get("topk_group", int, 4 if v3 else 1) if grouped else 1
    if grouped:
        if n_group < 1 or num_experts % n_group:
            raise CheckpointError(f"config.json: {num_experts} experts do not split into "
                                  f"n_group={n_group} equal groups", path=path)
        if not 1 <= topk_group <= n_group:
            raise CheckpointError(f"config.json: topk_group={topk_group} not in 1..{n_group}",
                                  path=path)
        if topk_group * (num_experts // n_group) < top_k:
            raise CheckpointError(f"config.json: the best {topk_group} groups hold fewer than "
                                  f"num_experts_per_tok={top_k} experts", path=path)
        if v3 and num_experts // n_group < 2:
            raise CheckpointError("config.json: DeepSeek-V3 group scores need ≥ 2 experts per "
                                  "group", path=path)
    return Gate(
        scoring=scoring,
        selection_bias=v3,
        n_group=n_group,
        topk_group=topk_group,
        group_score=("top2sum" if v3 else "max") if grouped else "none",
        scaling=get("routed_scaling_factor", float, 2.5 if v3 else 1.0),
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


def _rope(cfg: dict[str, Any], family: str, path: Path | str,
          mla: MLA | None) -> tuple[float, float | None, Yarn | None]:
    """(θ, softmax scale, YaRN): the scale is None (head_dim ** -0.5) except for MLA, whose
    query and key heads are ``qk_nope + qk_rope`` wide, and whose scale YaRN's
    ``mscale_all_dim`` multiplies by mscale² (transformers' ``yarn_apply_mscale``)."""
    theta = _rope_theta(cfg, family, path)
    yarn = _yarn(cfg, path)
    scale = None if mla is None else mla.qk_head_dim ** -0.5
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
            raise CheckpointError(f"config.json: rope {key!r} must be a number, got {value!r}",
                                  path=path)
        return float(value)

    original = num("original_max_position_embeddings", None)
    if original is None or original <= 0:
        raise CheckpointError("config.json: YaRN RoPE needs original_max_position_embeddings",
                              path=path)
    factor = num("factor", None)
    if factor is None:
        factor = float(_getter(cfg, path)("max_position_embeddings", int)) / original
    if factor <= 0:
        raise CheckpointError(f"config.json: YaRN factor must be positive, got {factor!r}",
                              path=path)
    mscale, mscale_all_dim = num("mscale", None), num("mscale_all_dim", None)
    attention_factor = num("attention_factor", None)
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return Yarn(factor=factor, original_max_positions=original,
                beta_fast=num("beta_fast", None) or 32.0, beta_slow=num("beta_slow", None) or 1.0,
                attention_factor=attention_factor, mscale_all_dim=mscale_all_dim or 0.0,
                truncate=bool(p.get("truncate", True)))


def _rope_theta(cfg: dict[str, Any], family: str, path: Path | str) -> float:
    params = _rope_params(cfg)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn", None):
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
    """Which decoder layers carry a routed MoE block (transformers' Qwen2-MoE rule; DeepSeek:
    all after the first ``first_k_dense_replace``)."""
    if family in ("mixtral", "olmoe"):
        return tuple(range(n_layers))
    if family in DEEPSEEK:
        dense = _getter(cfg, path)("first_k_dense_replace", int, 3 if family == "deepseek_v3" else 0)
        return tuple(range(min(dense, n_layers), n_layers))
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
