"""``config.json`` → :class:`ModelSpec`: the few numbers the replay needs, validated.

Field names and defaults follow Hugging Face transformers' configuration classes for each
family, so that a ``config.json`` written by ``save_pretrained`` (v4 or v5) reads the same
here as it does there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.jsonio import DuplicateKey, no_duplicate_keys
from moeaudit.spec.blocks import (
    Attention,
    DenseMLP,
    HyperConnection,
    Layer,
    Mixer,
    MLAttention,
    MoE,
    Residual,
    SharedExpert,
)
from moeaudit.spec.geometry import (  # noqa: F401 (re-exported: the ModelSpec fields' types)
    HC_NAMES,
    MAMBA_NAMES,
    MLA,
    MOA_NAMES,
    SECOND_BLOCK,
    SHORT_CONV_NAMES,
    ClampedGLU,
    Gate,
    LinearAttention,
    Mamba,
    SparseIndex,
)
from moeaudit.spec.layouts import Layout
from moeaudit.spec.mixers import KDA, DeltaNet, Lightning, MambaMixer, MoA, ShortConv
from moeaudit.spec.settings import NEW, SAME, AttentionVariant, GLULimits, LayerSettings

# DeepSeek's q_a / kv_a RMSNorms are built without the config's eps (transformers' default).
MLA_NORM_EPS = 1e-6
MAX_COUNT = 1 << 16  # layers or experts; far above any real model


# family name → its Layout, filled by :mod:`moeaudit.families` as it discovers the family files
# (the model description sits below the families and names none of them)
LAYOUTS: dict[str, Layout] = {}


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
class Llama3Rope:
    """Llama 3's RoPE frequency scaling (``rope_type: "llama3"``, Llama 4's released configs):
    wavelengths above ``original / low_freq_factor`` divided by ``factor``, those below
    ``original / high_freq_factor`` kept, a smooth blend between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: float


@dataclass(frozen=True)
class LongRope:
    """Phi's "longrope" RoPE as transformers' Phi-3.5-MoE applies it: frequencies divided by the
    per-dimension ``short_factor``; cos and sin × ``short_mscale``, or × ``long_mscale`` once
    the sequence is longer than ``original_max_positions``."""

    short_factor: tuple[float, ...]
    short_mscale: float
    long_mscale: float
    original_max_positions: float


@dataclass(frozen=True)
class AttentionKind:
    """The attention of one kind of layer where a model's layers differ in it (MiMo-V2-Flash,
    Mellum: ``layer_types``): head counts, head sizes, RoPE and sinks (``ModelSpec.attention_kinds``,
    chosen per layer by ``LayerSettings.layer_kinds``). RoPE is transformers' default (rotate-half,
    θ, the first ``rotary_dim`` dims of a head; 0: all of them); values are ``v_head_dim`` wide
    (0: as the keys) and × ``value_scale`` (MiMo's ``attention_value_scale``)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int = 0
    v_head_dim: int = 0
    sinks: bool = False
    value_scale: float = 1.0

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim


@dataclass(frozen=True)
class Rope:
    """The rotary position embedding the attention layers share (one table; where a model's layer
    kinds differ in it, ``ModelSpec.attention_kinds`` give one per kind): base ``theta``, the first
    ``rotary_dim`` dims of a head rotated (0: all of it; partial rotary), the width the frequencies
    are computed for where it is not the rotated width (``freq_dim``, Mistral 4's MLA: int(head_dim ×
    partial_rotary_factor), its table broadcast over the rotated pairs; 0: the rotated width),
    adjacent pairs (x0, x1), (x2, x3), … instead of rotate-half (``interleaved``, ERNIE 4.5's GQA,
    Llama 4), and one scaling: YaRN (DeepSeek-V2/V3), Llama 3's (Llama 4) or Phi's longrope."""

    theta: float
    rotary_dim: int = 0
    freq_dim: int = 0
    interleaved: bool = False
    yarn: Yarn | None = None
    llama3: Llama3Rope | None = None
    longrope: LongRope | None = None


# the spec's JSON key of each ``HyperConnection`` field (where the field stood; all left out at
# their default)
HC_KEYS: dict[str, str] = {
    "hc_mult": "streams",
    "hc_magnitude": "magnitude",
    "hc_eps": "eps",
    "hc_sinkhorn_iters": "sinkhorn_iters",
}
# and of each ``Rope`` field, and whether it is left out at its default (``NEW``)
ROPE_KEYS: dict[str, tuple[str, bool]] = {
    "rope_theta": ("theta", False),
    "yarn": ("yarn", False),
    "rotary_dim": ("rotary_dim", True),
    "rope_freq_dim": ("freq_dim", True),
    "rope_interleaved": ("interleaved", True),
    "llama3_rope": ("llama3", True),
    "longrope": ("longrope", True),
}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one checkpoint, as the replay sees it: what is the same for the whole model,
    ``settings`` (what the config says about its layers' blocks, as read) and, built from both,
    ``layers`` (typed blocks, which the replay reads)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope
    rms_eps: float
    num_experts: int
    top_k: int
    expert_dim: int  # intermediate size of one routed expert
    routed_layers: tuple[int, ...]
    tie_embeddings: bool
    dense_dim: int = 0  # intermediate size of a dense MLP layer (mlp_only_layers)
    shared_dim: int = 0  # intermediate size of the shared expert (0 = none)
    gate: Gate = Gate()
    mla: MLA | None = None
    mtp_layers: int = 0  # multi-token-prediction modules stored after the decoder (not replayed)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    extra: dict[str, Any] = field(default_factory=dict)
    # Fields added for new families carry ``NEW``: left out of ``to_json`` at their default, so
    # the JSON of the families that predate them stays byte-identical.
    sparse_index: SparseIndex | None = field(default=None, metadata=NEW)  # DSA indexer (DeepSeek-V3.2)
    # zero-centred RMSNorm gains (Qwen3-Next): the norm applies offset + stored w; the checkpoint
    # reader hands the replay the applied gain
    norm_offset: float = field(default=0.0, metadata=NEW)
    # Granite's µP-style multipliers: embeddings × e and logits ÷ s (each block's output × r is the
    # ``Residual.multiplier``, the attention softmax scale ``attention_scale``)
    embedding_multiplier: float = field(default=1.0, metadata=NEW)
    logits_scaling: float = field(default=1.0, metadata=NEW)
    # gpt-oss, HY-V4: the routed experts' GLU clamped (gpt-oss's biases come with the interleaved
    # expert layout, ``Layout.fused_format``); DeepSeek-V4's shared expert clamps at its limit too
    clamped_glu: ClampedGLU | None = field(default=None, metadata=NEW)
    # Phi-3.5-MoE: LayerNorm (mean-centred, with a bias) for the block and final norms, a bias on
    # the LM head; Cohere: LayerNorms without a bias (``norm_bias`` false)
    layer_norm: bool = field(default=False, metadata=NEW)
    lm_head_bias: bool = field(default=False, metadata=NEW)
    norm_bias: bool = field(default=True, metadata=NEW)
    # Nemotron-H: "relu2": the experts, the shared expert and the dense MLPs are non-gated,
    # W2 relu(W1 y)² (up w1, down w2; no w3); "swiglu": W2(silu(W1 y) ⊙ W3 y)
    mlp_act: str = field(default="swiglu", metadata=NEW)
    # the final norm's eps when it is not the decoder layers' (``rms_eps``; JetMoE: 1e-6)
    final_norm_eps: float | None = field(default=None, metadata=NEW)
    # LongCat-Flash: the last ``zero_experts`` of the ``num_experts`` are identity
    # (zero-computation) experts, u_e(y) = y
    zero_experts: int = field(default=0, metadata=NEW)
    # HY-V4, DeepSeek-V4: the residual stream as several streams, mixed around each sub-block and
    # by a head before the final norm (``HyperConnection``; the layers' ``Residual.hc`` is this)
    hc: HyperConnection | None = field(default=None, metadata=NEW)
    # MiMo-V2-Flash, Mellum, Step 3.5, Laguna (docs/decisions.md, "Attention per kind of layer
    # (mimo_v2_flash, step3p5, step3p7, laguna, mellum)"): the attention of each kind of layer —
    # head counts, head sizes, RoPE table, sinks — which a layer's ``Attention.attention_kind``
    # indexes; empty: one attention geometry and one RoPE table for every layer
    attention_kinds: tuple[AttentionKind, ...] = field(default=(), metadata=NEW)
    # the family's description of its decoder layers, as read (``LayerSettings``): ``layers`` is built
    # from it; only ``moeaudit.spec`` and the family files read it (tests/test_layering.py)
    settings: LayerSettings = field(default_factory=lambda: LayerSettings())

    def expert_glu(self, layer: int) -> ClampedGLU | None:
        """The routed experts' activation on ``layer`` when it is not plain SwiGLU: that layer's
        clamp after the activation (``expert_glu_limits``), else ``clamped_glu`` (gpt-oss, HY-V4)."""
        ffn = self.layers[layer].ffn if layer >= 0 else None
        if isinstance(ffn, MoE) and ffn.glu_limit:
            return ClampedGLU(alpha=1.0, limit=ffn.glu_limit, offset=0.0, after=True)
        return self.clamped_glu

    def mlp_glu_limit(self, layer: int) -> float:
        """The shared expert's and dense MLP's clamp bound on ``layer`` (0: none)."""
        if layer < 0:
            return 0.0
        ffn = self.layers[layer].ffn
        if isinstance(ffn, MoE):
            return 0.0 if ffn.shared is None else ffn.shared.glu_limit
        return 0.0 if ffn is None else ffn.glu_limit

    def attention_kind(self, layer: int) -> AttentionKind | None:
        """The attention of ``layer`` where it is given per kind of layer; None otherwise."""
        mixer = self.layers[layer].mixer if layer >= 0 else None
        if not isinstance(mixer, Attention) or mixer.attention_kind is None:
            return None
        return self.attention_kinds[mixer.attention_kind]

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.family]

    @cached_property
    def layers(self) -> tuple[Layer, ...]:
        """One :class:`~moeaudit.spec.blocks.Layer` per decoder layer: the family's own
        (``settings.layer_blocks``), else built from the fields and the settings by
        :func:`derived_layer` (once per spec; ``revised`` makes a new spec, and new layers)."""
        if self.settings.layer_blocks:
            return self.settings.layer_blocks
        return tuple(derived_layer(self, i) for i in range(self.num_layers))

    def revised(self, **changes: Any) -> ModelSpec:
        """``dataclasses.replace`` over the model-wide fields, the RoPE (by its JSON keys:
        ``rope_theta``, ``rotary_dim``, …, ``ROPE_KEYS``), the hyper-connections (``hc_mult``, …,
        ``HC_KEYS``) and the layer settings alike (its layers built anew; a family's own
        ``layer_blocks`` are kept unless replaced)."""
        own = {k: v for k, v in changes.items() if k in MODEL_FIELDS}
        rope = {ROPE_KEYS[k][0]: v for k, v in changes.items() if k in ROPE_KEYS}
        hc = {HC_KEYS[k]: v for k, v in changes.items() if k in HC_KEYS}
        settings = {k: v for k, v in changes.items() if k not in MODEL_FIELDS | ROPE_KEYS.keys() | HC_KEYS.keys()}
        if rope:
            own["rope"] = replace(own.get("rope", self.rope), **rope)
        if hc:
            streams = replace(own.get("hc", self.hc) or HyperConnection(0), **hc)
            own["hc"] = streams if streams.streams else None
        if settings:
            own["settings"] = replace(self.settings, **settings)
        return replace(self, **own)

    def _attending(self, keep: Callable[[Attention | MLAttention], bool]) -> tuple[int, ...]:
        return tuple(
            i
            for i, layer in enumerate(self.layers)
            if isinstance(layer.mixer, (Attention, MLAttention)) and keep(layer.mixer)
        )

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers whose attention sees a causal window of keys (``Attention.window``)."""
        return self._attending(lambda a: isinstance(a, Attention) and a.window is not None)

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers (None: no layer slides)."""
        windows = {a.window for layer in self.layers if isinstance(a := layer.mixer, Attention) and a.window}
        return max(windows) if windows else None

    @property
    def attention_chunk(self) -> int | None:
        """The block size of the chunked layers' local attention (None: no layer is chunked)."""
        chunks = {a.chunk for layer in self.layers if isinstance(a := layer.mixer, Attention) and a.chunk}
        return max(chunks) if chunks else None

    @property
    def nope_layers(self) -> tuple[int, ...]:
        """The attention layers without RoPE (NoPE layers; ``Attention.rope`` false)."""
        return self._attending(lambda a: not a.rope)

    @property
    def chunked_layers(self) -> tuple[int, ...]:
        """The layers of chunked local attention (Llama 4; ``Attention.chunk``)."""
        return self._attending(lambda a: isinstance(a, Attention) and a.chunk is not None)

    @property
    def layer_kinds(self) -> tuple[int, ...]:
        """Each layer's index into ``attention_kinds`` (() : one attention geometry for every layer)."""
        if not self.attention_kinds:
            return ()
        return tuple(
            a.attention_kind if isinstance(a := layer.mixer, Attention) and a.attention_kind is not None else 0
            for layer in self.layers
        )

    @property
    def shared_index_layers(self) -> tuple[int, ...]:
        """HY-V4: the layers that reuse the previous layer's DSA key selection (``MLAttention.shared_index``)."""
        return self._attending(lambda a: isinstance(a, MLAttention) and a.shared_index)

    @property
    def expert_glu_limits(self) -> tuple[float, ...]:
        """Per layer, the routed experts' clamp after the activation (``MoE.glu_limit``; () : none anywhere)."""
        limits = tuple(layer.ffn.glu_limit if isinstance(layer.ffn, MoE) else 0.0 for layer in self.layers)
        return limits if any(limits) else ()

    @property
    def mlp_glu_limits(self) -> tuple[float, ...]:
        """Per layer, the shared expert's and dense MLP's clamp bound (() : none anywhere)."""
        limits = tuple(self.mlp_glu_limit(i) for i in range(self.num_layers))
        return limits if any(limits) else ()

    def _mixing(self, kind: type) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if isinstance(layer.mixer, kind))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers mixing by gated DeltaNet (``DeltaNet`` blocks)."""
        return self._mixing(DeltaNet)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """The layers mixing by Kimi Delta Attention (``KDA`` blocks)."""
        return self._mixing(KDA)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """The layers mixing by a selective state-space scan (``MambaMixer`` blocks)."""
        return self._mixing(MambaMixer)

    @property
    def lightning_layers(self) -> tuple[int, ...]:
        """The layers mixing by MiniMax-01's lightning attention (``Lightning`` blocks)."""
        return self._mixing(Lightning)

    @property
    def conv_layers(self) -> tuple[int, ...]:
        """The layers mixing by LFM2's short convolution (``ShortConv`` blocks)."""
        return self._mixing(ShortConv)

    @cached_property
    def moe(self) -> MoE:
        """The routed layers' MoE block: its router and experts (the same on every routed layer but
        for Step 3.5's per-layer clamp, ``MoE.glu_limit``; ``expert_glu`` gives a layer's)."""
        ffn = self.layers[self.routed_layers[0]].ffn
        assert isinstance(ffn, MoE)
        return ffn

    @property
    def routing(self) -> str:
        g, m = self.gate, self.moe
        if g.scoring == "sparsemixer":  # each weight its own banded softmax: renormalisation does not apply
            return f"sparsemixer top-{self.top_k} of {self.num_experts}, jitter ε {m.sparsemixer_eps or 0:g}"
        renorm = "renormalised" if m.renormalise else "not renormalised"
        out = f"{g.scoring} top-{self.top_k} of {self.num_experts}"
        if self.zero_experts:
            out += f" ({self.zero_experts} zero-computation)"
        if g.grouped:
            out += f" within the best {g.topk_group} of {g.n_group} groups"
        if g.selection_bias:
            out += ", selection bias"
        if m.logit_bias:
            out += ", biased logits"
        out += f", {renorm}"
        if g.scaling != 1.0:
            out += f", ×{g.scaling:g}"
        return out

    @property
    def final_eps(self) -> float:
        """The final norm's eps: ``final_norm_eps``, else the decoder layers' ``rms_eps``."""
        return self.rms_eps if self.final_norm_eps is None else self.final_norm_eps

    @property
    def rope_dim(self) -> int:
        """How many leading dims of a head RoPE rotates (partial rotary: fewer than head_dim)."""
        return self.rope.rotary_dim or self.head_dim

    @property
    def parametric_experts(self) -> int:
        """The experts with weights (all but LongCat's zero-computation experts, which come last)."""
        return self.num_experts - self.zero_experts

    def is_routed(self, layer: int) -> bool:
        return layer in self.routed_layers

    @property
    def block_kinds(self) -> tuple[str, ...]:
        """Nemotron-H: each layer's one block ("mamba", "attention", "mlp" or "moe"), x + f(norm(x))
        with norm its only norm (``input_norm``); () : every layer is a token mixer then an MLP /
        MoE block."""
        if not any(layer.residual.single_block for layer in self.layers):
            return ()
        return tuple(_single_kind(layer) for layer in self.layers)

    def block_kind(self, layer: int) -> str:
        """The one block of a single-block layer (``block_kinds``); "" for a mixer-then-MLP layer."""
        return self.block_kinds[layer] if self.block_kinds else ""

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON object (for people and tests; nothing signs it): the model-wide fields
        and the layer settings in the order they had as one record (``SPEC_ORDER``), the per-layer
        tuples read off ``layers`` where the fields they replace stood (``sliding_layers``,
        ``nope_layers``, ``layer_kinds``, …; left out when empty, as those fields were at their
        default). ``layer_blocks`` is written (each block with its kind) only where those do not say
        it all (a new block kind)."""
        given = asdict(self)
        del given["settings"], given["rope"], given["hc"]
        given.update(asdict(self.settings))
        rope, defaults = asdict(self.rope), {f.name: f.default for f in fields(Rope)}
        for key, (name, omitted) in ROPE_KEYS.items():
            if not (omitted and getattr(self.rope, name) == defaults[name]):
                given[key] = rope[name]
        hc, none = self.hc or HyperConnection(0), HyperConnection(0)
        for key, name in HC_KEYS.items():
            if getattr(hc, name) != getattr(none, name):
                given[key] = getattr(hc, name)
        del given["layer_blocks"], given["attention"], given["glu_limits"]
        out: dict[str, Any] = {}
        for name in SPEC_ORDER:
            if name in DERIVED_WHERE_THEY_STOOD:  # read off the layers
                if (derived := getattr(self, name)) or name in ("sliding_window", "sliding_layers"):
                    out[name] = derived
            elif name in given:
                out[name] = given[name]
            else:
                continue
            follower = DERIVED_AFTER.get(name)
            while follower is not None:
                if derived := getattr(self, follower):
                    out[follower] = derived
                follower = DERIVED_AFTER.get(follower)
        for owner in (self, self.settings):
            for f in fields(owner):
                if f.metadata.get("omit_default") and f.name in out and getattr(owner, f.name) == f.default:
                    del out[f.name]
        out["routed_layers"] = list(self.routed_layers)
        for name in (
            "sliding_layers",
            "linear_layers",
            "kda_layers",
            "nope_layers",
            "chunked_layers",
            "mamba_layers",
            "conv_layers",
            "block_kinds",
            "shared_index_layers",
            "layer_kinds",
            "expert_glu_limits",
            "mlp_glu_limits",
        ):
            if name in out:
                out[name] = list(out[name])
        if "attn_temperature" in out and out["attn_temperature"] is not None:
            out["attn_temperature"] = list(out["attn_temperature"])
        if self.mla is None:
            del out["mla"]
        if self.clamped_glu is not None and self.clamped_glu.offset == 1.0:  # gpt-oss's JSON as before
            del out["clamped_glu"]["offset"]
        if self.clamped_glu is not None and not self.clamped_glu.after:  # as before ``after``
            del out["clamped_glu"]["after"]
        if not self._blocks_said():  # with each block's kind (``asdict`` drops it)
            out["layer_blocks"] = [layer.to_json() for layer in self.settings.layer_blocks]
        out["routing"] = self.routing
        return out

    def _blocks_said(self) -> bool:
        """Whether the settings and the derived per-layer tuples describe ``layer_blocks`` whole."""
        kinds = self.block_kinds
        return all(
            layer
            == derived_layer(
                self, i, layer.mixer if isinstance(layer.mixer, TUPLED) else None, kinds[i] if kinds else ""
            )
            for i, layer in enumerate(self.settings.layer_blocks)
        )


MODEL_FIELDS = frozenset(f.name for f in fields(ModelSpec))
# the order of the spec's JSON keys: the model-wide fields and the layer settings as they stood when
# they were one record
SPEC_ORDER = (
    "family vocab_size hidden_size num_layers num_heads num_kv_heads head_dim rope_theta rms_eps num_experts "
    "top_k expert_dim routed_layers norm_topk_prob attention_bias qk_norm clip_qkv tie_embeddings dense_dim "
    "shared_dim sliding_window sliding_layers gate mla shared_gated mtp_layers attention_scale yarn extra o_bias "
    "rotary_dim rope_freq_dim sparse_index norm_offset gated_attention linear_attention kda_gate_bound "
    "rope_interleaved embedding_multiplier residual_multiplier logits_scaling attention_sinks router_logit_bias "
    "clamped_glu scaled_expert_inputs nope_layers attn_temperature attention_chunk chunked_layers llama3_rope "
    "layer_norm lm_head_bias sparsemixer_eps longrope renorm_min index_rope_interleave parallel_block norm_bias "
    "shared_scale conv_kernel conv_bias renorm_eps mamba lightning_block residual_scales router_softcap "
    "output_gate query_position_scale moe_out_norm mlp_act attn_out_norm dense_out_norm pre_norm moa moe_bias "
    "final_norm_eps shortcut_moe zero_experts mla_lora_scale hc_mult hc_magnitude hc_eps hc_sinkhorn_iters "
    "shared_clamped index_rope_last index_norm_eps shared_index_layers sigmoid_select mla_norm_eps "
    "attention_kinds layer_kinds expert_glu_limits mlp_glu_limits"
).split()
# the per-layer tuples read off the layers, written where the settings they replace stood
DERIVED_WHERE_THEY_STOOD = frozenset(
    "sliding_window sliding_layers nope_layers attention_chunk chunked_layers shared_index_layers layer_kinds "
    "expert_glu_limits mlp_glu_limits".split()
)
# the per-layer tuples the families no longer set (``ModelSpec`` properties derived from ``layers``):
# the key ``to_json`` writes each after (where it stood as a field) → the derived tuple
# the mixer kinds those tuples record
TUPLED = (DeltaNet, KDA, MambaMixer, Lightning, ShortConv)
DERIVED_AFTER: dict[str, str] = {
    "linear_attention": "linear_layers",
    "linear_layers": "kda_layers",
    "shared_scale": "conv_layers",
    "mamba": "mamba_layers",
    "mamba_layers": "lightning_layers",
    "mlp_act": "block_kinds",
}


def derived_layer(s: ModelSpec, i: int, mixer: Mixer | None = None, kind: str = "") -> Layer:
    """Decoder layer ``i`` of ``s`` as typed blocks, its token mixer ``mixer`` where the family
    gives one (None: the attention the settings describe), the rest as the settings describe it;
    ``kind``: the layer is that one block ("mamba", "attention", "mlp", "moe"; Nemotron-H)."""
    ls = s.settings
    if mixer is None and kind in ("", "mamba", "attention"):
        mixer = _mixer(s, i)
    scales = None
    if ls.residual_scales is not None:  # MiniMax-01: (α, β) of full attention, lightning, the MLP / MoE
        scales = (ls.residual_scales[1 if isinstance(mixer, Lightning) else 0], ls.residual_scales[2])
    residual = Residual(
        pre_norm=ls.pre_norm,
        norm_bias=s.layer_norm and s.norm_bias,
        parallel=ls.parallel_block,
        single_block=bool(kind),
        multiplier=ls.residual_multiplier,
        scales=scales,
        hc=s.hc,
        shortcut=DenseMLP(s.dense_dim) if ls.shortcut_moe else None,
    )
    if kind:  # Nemotron-H: the layer is one block
        routed = kind == "moe"
        ffn = (
            None
            if kind in ("mamba", "attention")
            else _moe(s, i, single=True)
            if routed
            else DenseMLP(s.dense_dim, gated=_glu(s))
        )
        return Layer(mixer, ffn, residual)
    ffn = (
        _moe(s, i)
        if s.is_routed(i)
        else DenseMLP(s.dense_dim, glu_limit=_limits(ls, i).mlp, out_norm=ls.dense_out_norm)
    )
    return Layer(mixer, ffn, residual)


def _limits(ls: LayerSettings, i: int) -> GLULimits:
    return ls.glu_limits[i] if ls.glu_limits else GLULimits()


def _variant(ls: LayerSettings, i: int) -> AttentionVariant:
    return ls.attention[i] if ls.attention else SAME


def _single_kind(layer: Layer) -> str:
    if isinstance(layer.mixer, MambaMixer):
        return "mamba"
    if layer.mixer is not None:
        return "attention"
    return "moe" if isinstance(layer.ffn, MoE) else "mlp"


def _glu(s: ModelSpec) -> bool:
    return s.mlp_act != "relu2"


def _moe(s: ModelSpec, i: int, single: bool = False) -> MoE:
    shared, ls = None, s.settings
    if s.shared_dim:  # Granite 4.0: gate and up rows in one ``input_linear``; Nemotron-H: no gate
        fused = "shared_gate_up" in s.layout.layer
        clamp = s.clamped_glu.limit if ls.shared_clamped and s.clamped_glu is not None else 0.0
        shared = SharedExpert(
            s.shared_dim,
            gated=ls.shared_gated and not single,
            fused=fused,
            glu=_glu(s),
            glu_limit=_limits(ls, i).mlp,
            scale=ls.shared_scale,
            clamp=clamp,
        )
    return MoE(
        s.num_experts,
        s.top_k,
        s.expert_dim,
        s.gate,
        logit_bias=ls.router_logit_bias,
        out_norm=ls.moe_out_norm,
        out_bias=ls.moe_bias,
        zero_experts=s.zero_experts,
        shared=shared,
        glu_limit=_limits(ls, i).experts,
        renormalise=ls.norm_topk_prob,
        renorm_min=ls.renorm_min,
        renorm_eps=ls.renorm_eps,
        softcap=ls.router_softcap,
        sigmoid_select=ls.sigmoid_select,
        sparsemixer_eps=ls.sparsemixer_eps,
        scaled_inputs=ls.scaled_expert_inputs,
    )


def _mixer(s: ModelSpec, i: int) -> Mixer:
    layout, ls = s.layout.layer, s.settings
    v = _variant(ls, i)
    if s.mla is not None:
        return MLAttention(
            s.mla,
            s.num_heads,
            rope=v.rope,
            index=s.sparse_index,
            shared_index=v.shared_index,
            sinks=ls.attention_sinks,
            output_gate=ls.output_gate,
            qk_norm=ls.qk_norm,
            head_dim=s.head_dim,
            bias=ls.attention_bias,
            lora_scale=ls.mla_lora_scale,
            norm_eps=ls.mla_norm_eps,
            position_scale=ls.query_position_scale,
            index_rope_interleave=ls.index_rope_interleave,
            index_rope_last=ls.index_rope_last,
            index_norm_eps=ls.index_norm_eps,
        )
    if ls.moa:
        return MoA(s.num_experts, s.top_k, s.num_kv_heads, s.head_dim)
    kind = v.kind
    a = None if kind is None else s.attention_kinds[kind]
    return Attention(
        heads=s.num_heads if a is None else a.num_heads,
        kv_heads=s.num_kv_heads if a is None else a.num_kv_heads,
        head_dim=s.head_dim if a is None else a.head_dim,
        v_head_dim=0 if a is None else a.v_head_dim,
        rope=v.rope,
        attention_kind=kind,
        window=v.window,
        chunk=v.chunk,
        sinks=ls.attention_sinks if a is None else a.sinks,
        value_scale=1.0 if a is None else a.value_scale,
        gated_q=ls.gated_attention,
        output_gate=ls.output_gate,
        qk_norm=ls.qk_norm,
        bias=ls.attention_bias,
        o_bias=ls.o_bias,
        fused_qkv="qkv" in layout,
        out_norm=ls.attn_out_norm,
        clip=ls.clip_qkv,
        temperature=ls.attn_temperature,
    )


def parse_config(raw: bytes, cfg_path: Path) -> dict[str, Any]:
    """The bytes of a ``config.json`` as a JSON object; a repeated key is an error (which of
    the two values counts would be up to the reader)."""
    try:
        cfg = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:
        raise CheckpointError(
            f"config.json: repeats the key {exc.key!r}", path=cfg_path, hint="keep one of the two values"
        ) from exc
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, huge ints
        raise CheckpointError(f"not valid JSON ({exc})", path=cfg_path) from exc
    if not isinstance(cfg, dict):
        raise CheckpointError("not a JSON object", path=cfg_path)
    return cfg


def check_sizes(spec: ModelSpec, cfg: dict[str, Any], path: Path | str) -> None:
    """Sizes the replay divides by or loops over: zero (or odd, for RoPE) would be a crash
    or a silently empty audit later, so they are errors here, naming the config key."""

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"config.json: {what}", path=path)

    for key, value in (
        ("num_hidden_layers", spec.num_layers),
        ("vocab_size", spec.vocab_size),
        ("the expert intermediate size", spec.expert_dim),
    ):
        if value < 1:
            raise fail(f"{key} must be ≥ 1, got {value}")
    if spec.head_dim < 2 or spec.head_dim % 2:
        given = cfg.get("head_dim")
        source = (
            f"head_dim {given}"
            if given
            else f"hidden_size {spec.hidden_size} // {spec.num_heads} heads = {spec.head_dim}"
        )
        if spec.mla is not None:
            source = f"qk_rope_head_dim {spec.head_dim}"
        raise fail(f"the attention head size must be even and ≥ 2 (RoPE rotates pairs); {source}")
    if (rd := spec.rope.rotary_dim) and not (2 <= rd <= spec.head_dim and rd % 2 == 0):
        raise fail(
            f"the rotary part of a head must be even and in 2..{spec.head_dim}, got "
            f"{rd} (head_dim × partial_rotary_factor)"
        )
    if spec.rms_eps < 0:
        raise fail(f"rms_norm_eps must be ≥ 0, got {spec.rms_eps}")
    for what, per_layer in (("attention variants", spec.settings.attention), ("GLU limits", spec.settings.glu_limits)):
        if per_layer and len(per_layer) != spec.num_layers:
            raise fail(f"the family gives {len(per_layer)} layers' {what}, num_hidden_layers is {spec.num_layers}")
    if (given := spec.settings.layer_blocks) and len(given) != spec.num_layers:
        raise fail(f"the family describes {len(given)} layers, num_hidden_layers is {spec.num_layers}")
    if spec.settings.shared_clamped and spec.clamped_glu is None:
        raise fail("a clamped shared expert needs the experts' clamp (swiglu_limit)")
    if not spec.routed_layers:
        raise CheckpointError(
            f"config.json: none of the {spec.num_layers} decoder layers is a routed MoE layer",
            path=path,
            hint="check decoder_sparse_step, mlp_only_layers or first_k_dense_replace; moeaudit audits MoE routing",
        )


def getter(cfg: dict[str, Any], path: Path | str) -> Callable[..., Any]:
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


def _is_finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        return False
