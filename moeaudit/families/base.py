"""What every family file builds on: the :class:`Family` record and the generic parts of
``config.json`` → :class:`ModelSpec` (getter, RoPE/YaRN parsing, MLA parsing, validation).

A family file (``moeaudit/families/<model_type>.py``) defines ``FAMILY = Family(...)``: its
key templates (a :class:`Layout`), the defaults transformers' configuration class uses, and a
``fields`` function returning the few ModelSpec fields where it differs from the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.spec.blocks import HyperConnection, Layer, Mixer, per_layer_type, uniform
from moeaudit.spec.config import (
    HC_KEYS,
    MAX_COUNT,
    MLA,
    MODEL_FIELDS,
    ROPE_KEYS,
    Gate,
    LayerSettings,
    ModelSpec,
    Rope,
    check_sizes,
    derived_layer,
    getter,
)
from moeaudit.spec.layouts import Layout
from moeaudit.spec.rope_config import llama3_rope, rope
from moeaudit.spec.settings import SAME, AttentionVariant
from moeaudit.spec.torchtitan import HF_LAYER, TT_LAYER, Rules

Getter = Callable[..., Any]

# torchtitan's DeepSeek-V3 state-dict adapter names (DeepSeek's and GLM's ``shared_experts``)
TORCHTITAN_SHARED_EXPERTS: Rules = (
    (TT_LAYER + r"moe\.shared_experts\.w1\.weight", HF_LAYER + "mlp.shared_experts.gate_proj.weight"),
    (TT_LAYER + r"moe\.shared_experts\.w3\.weight", HF_LAYER + "mlp.shared_experts.up_proj.weight"),
    (TT_LAYER + r"moe\.shared_experts\.w2\.weight", HF_LAYER + "mlp.shared_experts.down_proj.weight"),
)
TORCHTITAN_MLA: Rules = (
    (TT_LAYER + r"attention\.wq_a\.weight", HF_LAYER + "self_attn.q_a_proj.weight"),
    (TT_LAYER + r"attention\.q_norm\.weight", HF_LAYER + "self_attn.q_a_layernorm.weight"),
    (TT_LAYER + r"attention\.wq_b\.weight", HF_LAYER + "self_attn.q_b_proj.weight"),
    (TT_LAYER + r"attention\.wkv_a\.weight", HF_LAYER + "self_attn.kv_a_proj_with_mqa.weight"),
    (TT_LAYER + r"attention\.kv_norm\.weight", HF_LAYER + "self_attn.kv_a_layernorm.weight"),
    (TT_LAYER + r"attention\.wkv_b\.weight", HF_LAYER + "self_attn.kv_b_proj.weight"),
    *TORCHTITAN_SHARED_EXPERTS,
)


@dataclass(frozen=True)
class Ctx:
    """The parts of a config every family reads, parsed once, for a family's ``fields``."""

    cfg: dict[str, Any]
    path: Path | str
    get: Getter
    family: str
    num_layers: int
    num_experts: int
    top_k: int
    mla: MLA | None


@dataclass(frozen=True)
class Refuse:
    """A ``config.json`` setting that changes the math and that the replay does not implement:
    refused by name when ``key`` holds a value outside ``replayed`` (absent or null reads as
    transformers' default, which is among them). The message says the reader lacks the feature,
    not that the checkpoint is wrong."""

    key: str
    replayed: tuple[Any, ...]  # the values the replay implements
    what: str  # what the setting changes, for the message

    def check(self, cfg: dict[str, Any], family: str, path: Path | str) -> None:
        value = cfg.get(self.key)
        if value is None or any(type(value) is type(r) and value == r for r in self.replayed):
            return
        shown = json.dumps(value) if isinstance(value, (bool, int, float, str)) else repr(value)
        raise CheckpointError(
            f"moeaudit does not replay {self.key}={shown} for {family} yet ({self.what})",
            path=path,
            hint=f"a limit of moeaudit, not a fault of the checkpoint: the replay implements "
            f"{self.key} = {' or '.join(json.dumps(r) for r in self.replayed)}",
        )


# every family: settings of Llama-style configs whose math no family here implements
REFUSED_EVERYWHERE = (Refuse("mlp_bias", (False,), "biases on the MLP and expert projections"),)
# quantization formats whose weights the reader dequantises exactly (block FP8: DeepSeek-V3's
# ``weight_scale_inv``; MXFP4: gpt-oss's ``_blocks``/``_scales``, checked by the reader)
READ_QUANTIZATION = ("fp8", "mxfp4")


def check_quantization(cfg: dict[str, Any], family: str, path: Path | str) -> None:
    """A ``quantization_config`` the reader does not dequantise (GPTQ, AWQ, bitsandbytes,
    compressed-tensors, …) is refused by its ``quant_method``: its packed integer weights would
    otherwise be missing, misshapen or read as plain numbers."""
    q = cfg.get("quantization_config")
    if q is None:
        return
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in READ_QUANTIZATION:
        shown = f"quant_method={json.dumps(method)}" if isinstance(method, str) else "an unrecognised format"
        raise CheckpointError(
            f"moeaudit does not read {family} weights quantised with quantization_config {shown} yet",
            path=path,
            hint=f"a limit of moeaudit, not a fault of the checkpoint: it reads unquantised "
            f"weights and {' / '.join(READ_QUANTIZATION)}; audit the unquantised checkpoint",
        )


@dataclass(frozen=True)
class Family:
    """One model family: layout data plus its few real differences."""

    name: str  # transformers' model_type
    layout: Layout
    fields: Callable[[Ctx], dict[str, Any]]  # the ModelSpec fields beyond the common ones
    expert_count_keys: tuple[str, ...]  # either name transformers' attribute_map accepts
    expert_dim_key: str = "moe_intermediate_size"
    top_k_key: str = "num_experts_per_tok"  # the name config.json stores top-k under
    # experts the router may pick besides the routed ones (LongCat's zero-computation experts):
    # (config, getter) → their count; top-k may reach routed + these
    selectable_extra: Callable[[dict[str, Any], Callable[..., Any]], int] | None = None
    default_rms_eps: float = 1e-6
    default_rope_theta: float = 1e4  # transformers' ``default_theta`` (1e4 unless overridden)
    mla: Callable[[Ctx], MLA] | None = None  # multi-head latent attention parser
    torchtitan: Rules = ()  # torchtitan DCP name → HF key rules tried before the common ones
    # a vision-language checkpoint: the config of the text decoder it replays (``text_config``)
    decoder_config: Callable[[dict[str, Any], Path | str], dict[str, Any]] | None = None
    # settings that change the math and are not replayed (besides ``REFUSED_EVERYWHERE``)
    refuse: tuple[Refuse, ...] = ()
    # a wrapper or relabelled checkpoint: what is audited ("the text decoder of …"), recorded in
    # the receipts beside the family
    audits: str = ""
    # the decoder layers as typed blocks (``LayerSettings.layer_blocks``), from the config and the
    # spec its ``fields`` give (``with_mixers``, ``spec.blocks.per_layer_type``); None: derived
    # from those fields
    layers: Callable[[Ctx, ModelSpec], tuple[Layer, ...]] | None = None


def build_spec(fam: Family, cfg: dict[str, Any], path: Path | str) -> ModelSpec:
    check_quantization(cfg, fam.name, path)  # top level: a VL checkpoint's too
    if fam.decoder_config is not None:
        cfg = fam.decoder_config(cfg, path)
    for rule in (*REFUSED_EVERYWHERE, *fam.refuse):
        rule.check(cfg, fam.name, path)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":  # the experts and MLPs are SwiGLU, the DeltaNet conv is SiLU
        raise CheckpointError(
            f"model family {fam.name!r} with hidden_act {act!r} cannot be "
            "replayed: the replay implements SiLU (SwiGLU) only",
            path=path,
        )
    get = getter(cfg, path)
    hidden = get("hidden_size", int)
    heads = get("num_attention_heads", int)
    kv_heads = get("num_key_value_heads", int, heads)  # null reads as absent; 0 is refused below
    n_layers = get("num_hidden_layers", int)
    keys = fam.expert_count_keys
    num_experts = get(next((k for k in keys if cfg.get(k) is not None), keys[0]), int)
    top_k = get(fam.top_k_key, int)
    selectable = num_experts + (fam.selectable_extra(cfg, get) if fam.selectable_extra is not None else 0)
    if not 1 <= top_k <= selectable:
        raise CheckpointError(f"{fam.top_k_key}={top_k} not in 1..{selectable}", path=path)
    for key, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value < 1:
            raise CheckpointError(f"config.json: {key!r} must be ≥ 1, got {value}", path=path)
    for key, value in (("num_hidden_layers", n_layers), ("the expert count", num_experts)):
        if value > MAX_COUNT:  # we build per-layer and per-expert tables before reading weights
            raise CheckpointError(f"config.json: {key} {value} is implausible (over {MAX_COUNT})", path=path)
    if hidden % heads and "head_dim" not in cfg and fam.mla is None:
        raise CheckpointError(f"hidden_size {hidden} not divisible by {heads} heads", path=path)
    if heads % kv_heads:
        raise CheckpointError(f"{heads} heads not divisible by {kv_heads} kv heads", path=path)
    ctx = Ctx(cfg, path, get, fam.name, n_layers, num_experts, top_k, None)
    mla = fam.mla(ctx) if fam.mla is not None else None
    ctx = Ctx(cfg, path, get, fam.name, n_layers, num_experts, top_k, mla)
    rope_theta, attention_scale, yarn = rope(cfg, fam.default_rope_theta, path, mla)
    common: dict[str, Any] = dict(
        family=fam.name,
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=mla.qk_rope_dim if mla else head_dim(ctx),
        rope_theta=rope_theta,
        rms_eps=get("rms_norm_eps", float, fam.default_rms_eps),
        num_experts=num_experts,
        top_k=top_k,
        expert_dim=get(fam.expert_dim_key, int),
        tie_embeddings=bool(get("tie_word_embeddings", bool, False)),
        mla=mla,
        attention_scale=attention_scale,
        yarn=yarn,
        llama3_rope=llama3_rope(cfg, path),
    )
    defaults: dict[str, Any] = dict(
        norm_topk_prob=False,
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm="none",
        clip_qkv=None,
        shared_gated=False,
    )
    given = {**common, **defaults, **fam.fields(ctx)}
    rotary = Rope(**{ROPE_KEYS[k][0]: v for k, v in given.items() if k in ROPE_KEYS})
    hc = {HC_KEYS[k]: v for k, v in given.items() if k in HC_KEYS}
    streams = HyperConnection(**hc) if hc.get("streams") else None
    grouped = ROPE_KEYS.keys() | HC_KEYS.keys()
    settings = LayerSettings(**{k: v for k, v in given.items() if k not in MODEL_FIELDS and k not in grouped})
    model = {k: v for k, v in given.items() if k in MODEL_FIELDS}
    spec = ModelSpec(**model, rope=rotary, hc=streams, settings=settings)
    if fam.layers is not None:
        spec = spec.revised(layer_blocks=fam.layers(ctx, spec))
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (
        isinstance(params, dict)
        and params.get("rope_type", params.get("type")) == "longrope"
        and spec.rope.longrope is None
    ):
        raise CheckpointError(f"rope type 'longrope' is read for phimoe only, not {fam.name!r}", path=path)
    check_sizes(spec, cfg, path)
    return spec


# --- shared rules several families use -----------------------------------------------------------


def with_mixers(s: ModelSpec, mixers: Sequence[Mixer | None]) -> tuple[Layer, ...]:
    """The layers of ``s`` with each layer's token mixer as given (None: the attention the spec's
    fields describe for that layer); MLP / MoE blocks and residuals as the fields describe them."""
    if len(mixers) != s.num_layers:
        raise ValueError(f"{len(mixers)} token mixers for {s.num_layers} layers")
    return tuple(derived_layer(s, i, mixer) for i, mixer in enumerate(mixers))


def mixing(s: ModelSpec, types: Sequence[str], kind: str, mixer: Mixer) -> tuple[Layer, ...]:
    """``mixer`` on the layers whose type is ``kind``, the attention the spec's fields describe
    (or Nemotron-H's one block) on the others."""
    return with_mixers(s, [mixer if t == kind else None for t in types])


def layer_types(c: Ctx, kinds: Sequence[str], default: Callable[[int], str] | None = None) -> list[str]:
    """``layer_types``: one of ``kinds`` per layer (absent or null: ``default(i)`` for layer i,
    where the family has a rule)."""
    types = c.cfg.get("layer_types")
    if types is None and default is not None:
        types = [default(i) for i in range(c.num_layers)]
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= set(kinds):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} layers, each " + " or ".join(repr(k) for k in kinds),
            path=c.path,
        )
    return types


def renamed(cfg: dict[str, Any], path: Path | str, aliases: dict[str, str]) -> dict[str, Any]:
    """The config with each alias (a configuration class's ``attribute_map``: the original
    release's name → transformers') under its name; both spelt with different values is refused."""
    out = dict(cfg)
    for alias, name in aliases.items():
        if alias not in cfg:
            continue
        if name in cfg and cfg[name] != cfg[alias]:
            raise CheckpointError(
                f"config.json: {alias!r} ({cfg[alias]!r}) and {name!r} ({cfg[name]!r}) "
                "name the same setting with different values",
                path=path,
                hint="keep one of the two",
            )
        out[name] = out.pop(alias)
    return out


def mlp_layer_types(
    c: Ctx, dense_first: int = 0, default: Callable[[], tuple[int, ...]] | None = None
) -> tuple[int, ...]:
    """The routed layers: ``mlp_layer_types`` ("dense" / "sparse" per layer), else ``default()``
    (the configuration class's rule), else the first ``dense_first`` layers dense."""
    types = c.cfg.get("mlp_layer_types")
    if types is None:
        return default() if default is not None else tuple(range(min(dense_first, c.num_layers), c.num_layers))
    if not isinstance(types, list) or len(types) != c.num_layers or any(t not in ("dense", "sparse") for t in types):
        raise CheckpointError(
            f"config.json: mlp_layer_types must list {c.num_layers} layers, each 'dense' or 'sparse'", path=c.path
        )
    return tuple(i for i, t in enumerate(types) if t == "sparse")


def all_layers(c: Ctx) -> tuple[int, ...]:
    return tuple(range(c.num_layers))


def head_dim(c: Ctx) -> int:
    """``head_dim``, or hidden_size // num_attention_heads when absent (or null). An explicit
    0 is refused, not read as absent (transformers' ``or`` would substitute the quotient)."""
    value = c.get("head_dim", int, None)
    if value is None:
        return int(c.get("hidden_size", int) // c.get("num_attention_heads", int))
    if value < 1:
        raise CheckpointError(
            f"config.json: head_dim must be ≥ 1, got {value}",
            path=c.path,
            hint="remove the key to use hidden_size // num_attention_heads",
        )
    return int(value)


def mtp_count(c: Ctx, default: int) -> int:
    """Multi-token-prediction modules stored after the decoder: ``num_nextn_predict_layers``
    (what save_pretrained writes) or ``num_mtp_layers`` (its attribute_map alias)."""
    key = (
        "num_mtp_layers"
        if "num_nextn_predict_layers" not in c.cfg and "num_mtp_layers" in c.cfg
        else "num_nextn_predict_layers"
    )
    return int(c.get(key, int, default))


def first_k_dense(c: Ctx, default: int) -> tuple[int, ...]:
    """DeepSeek's rule: every layer after the first ``first_k_dense_replace`` is routed."""
    dense = c.get("first_k_dense_replace", int, default)
    return tuple(range(min(dense, c.num_layers), c.num_layers))


def sparse_step_layers(c: Ctx) -> tuple[int, ...]:
    """Qwen-MoE's rule: ``decoder_sparse_step`` and ``mlp_only_layers``."""
    step = c.get("decoder_sparse_step", int, 1)
    only = c.cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError("config.json: mlp_only_layers must be a list of ints", path=c.path)
    return tuple(i for i in range(c.num_layers) if i not in only and step > 0 and (i + 1) % step == 0)


def sliding_window(c: Ctx, switch: str | None = None) -> int | None:
    """``sliding_window`` (and, for Qwen, only when ``use_sliding_window`` is on); null means
    none. Any other value must be a positive integer: a 0 or a negative window would mask every
    key in transformers, so it is refused rather than read as no window."""
    if switch is not None and not c.cfg.get(switch, False):
        return None
    window = c.cfg.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(
            f"config.json: sliding_window must be a positive integer or null, got {window!r}", path=c.path
        )
    return window


def windowed_all(c: Ctx, window: int | None) -> dict[str, Any]:
    """Every layer's attention windowed (``LayerSettings.attention``), where there is a window."""
    return {} if window is None else {"attention": uniform(c.num_layers, AttentionVariant(window=window))}


def attention_by_type(types: Sequence[str], variants: Mapping[str, AttentionVariant]) -> dict[str, Any]:
    """Each layer's attention as its type's variant says (``LayerSettings.attention``, through
    ``per_layer_type``; a type not in ``variants`` is the model's attention)."""
    per_layer = per_layer_type(types, {t: variants.get(t, SAME) for t in set(types)})
    return {"attention": per_layer} if any(v != SAME for v in per_layer) else {}


def attention_by_layer(variants: Sequence[AttentionVariant]) -> dict[str, Any]:
    """``LayerSettings.attention`` given layer by layer (a config that lists layers, not types)."""
    return {"attention": tuple(variants)} if any(v != SAME for v in variants) else {}


def parse_mla(c: Ctx, always_interleave: bool = False) -> MLA:
    get = c.get
    mla = MLA(
        q_lora_rank=get("q_lora_rank", int, 0),
        kv_lora_rank=get("kv_lora_rank", int, 512),
        qk_nope_dim=get("qk_nope_head_dim", int, 128),
        qk_rope_dim=get("qk_rope_head_dim", int, 64),
        v_head_dim=get("v_head_dim", int, 128),
        rope_interleave=always_interleave or bool(get("rope_interleave", bool, True)),
    )
    if mla.kv_lora_rank < 1 or mla.qk_rope_dim < 2 or mla.qk_rope_dim % 2 or mla.v_head_dim < 1:
        raise CheckpointError(
            "config.json: MLA needs kv_lora_rank ≥ 1, an even qk_rope_head_dim ≥ 2 and v_head_dim ≥ 1", path=c.path
        )
    return mla


def grouped_gate(
    c: Ctx,
    *,
    scoring: str,
    selection_bias: bool,
    grouped: bool,
    n_group: int,
    topk_group: int,
    group_score: str,
    scaling: float,
) -> Gate:
    """A DeepSeek-style gate: ``n_group``/``topk_group`` read (with these defaults) and
    validated when ``grouped``; ``routed_scaling_factor`` read with ``scaling`` as default."""
    get = c.get
    n = get("n_group", int, n_group) if grouped else 1
    kg = get("topk_group", int, topk_group) if grouped else 1
    if grouped:
        if n < 1 or c.num_experts % n:
            raise CheckpointError(
                f"config.json: {c.num_experts} experts do not split into n_group={n} equal groups", path=c.path
            )
        if not 1 <= kg <= n:
            raise CheckpointError(f"config.json: topk_group={kg} not in 1..{n}", path=c.path)
        if kg * (c.num_experts // n) < c.top_k:
            raise CheckpointError(
                f"config.json: the best {kg} groups hold fewer than num_experts_per_tok={c.top_k} experts", path=c.path
            )
        if group_score == "top2sum" and c.num_experts // n < 2:
            raise CheckpointError(f"config.json: {c.family} group scores need ≥ 2 experts per group", path=c.path)
    return Gate(
        scoring=scoring,
        selection_bias=selection_bias,
        n_group=n,
        topk_group=kg,
        group_score=group_score if grouped else "none",
        scaling=get("routed_scaling_factor", float, scaling),
    )


def v3_gate(c: Ctx, *, n_group: int, topk_group: int, scaling: float) -> Gate:
    """DeepSeek-V3's gate: sigmoid scores, a selection bias, the best ``topk_group`` of
    ``n_group`` groups by the sum of each group's top two (these the defaults of the config's
    ``n_group``, ``topk_group``, ``routed_scaling_factor``)."""
    return grouped_gate(
        c,
        scoring="sigmoid",
        selection_bias=True,
        grouped=True,
        n_group=n_group,
        topk_group=topk_group,
        group_score="top2sum",
        scaling=scaling,
    )


def partial_rotary_dim(c: Ctx, head_dim: int, factor: float) -> int:
    """transformers' ``int(head_dim * partial_rotary_factor)``, which must be even and ≥ 2
    (``ModelSpec.rotary_dim``; 0 there means the whole head)."""
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise CheckpointError(
            f"config.json: the rotary part of a head must be even and in 2..{head_dim}, "
            f"got {dim} (head_dim {head_dim} × partial_rotary_factor {factor:g})",
            path=c.path,
        )
    return dim


def text_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The text decoder's config of a vision-language checkpoint (``text_config``);
    ``tie_word_embeddings`` is read at the top level, where transformers writes it."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(
            f"config.json: model_type {cfg.get('model_type')!r} needs a text_config object", path=path
        )
    return {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
