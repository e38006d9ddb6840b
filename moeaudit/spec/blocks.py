"""A decoder layer as typed blocks: ``Layer(mixer, ffn, residual)``.

The token mixer (:class:`Attention`, :class:`MLAttention`, :class:`DeltaNet`, :class:`KDA`,
:class:`MambaMixer`, :class:`Lightning`, :class:`ShortConv`, :class:`MoA`), the MLP / MoE block
(:class:`DenseMLP`, :class:`MoE` with its :class:`Gate` and optional :class:`SharedExpert`) and the
way the two are wired into the residual stream (:class:`Residual`: pre- or post-norm, parallel,
single-block, DeepNorm scales, hyper-connections, LongCat's shortcut) are frozen records. Each
block kind owns what every consumer used to switch on flags for:

* ``names()``: its canonical tensor names (``spec.layouts``), in the order a layer lists them;
* ``shapes(H)``: the shape of each of those tensors for hidden size ``H``;
* its part of the gradient groups (docs/glossary.md, "Gradient norms / var_grad"), in the order their squared norms are
  summed (that order is part of the receipts' bits; ``replay.groups`` merges them): a mixer's
  ``grads(inputs)`` (the attention norm, with the residual's pre-norm gains in place),
  ``MoE.GRADS`` and ``SharedExpert.GRADS`` (router, shared expert), ``Residual.grads()``;
* ``sharded``: why the expert-parallel replay (``replay.sharded``) does not replay it, or None.

``ModelSpec.layers`` gives one :class:`Layer` per decoder layer; the checkpoint reader's names and
shapes, the gradient groups, the sharded replay's refusals and the replay's forward registry
(``replay.blocks``) read these records. docs/guides/block-kind.md says how to add a kind.
Torch-free, below ``spec.config``; the sizes the records hold are :mod:`.geometry`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, TypeVar

from moeaudit.spec.geometry import (
    HC_NAMES,
    MLA,
    SECOND_BLOCK,
    Gate,
    SparseIndex,
)
from moeaudit.spec.mixers import KDA, DeltaNet, Lightning, MambaMixer, MoA, ShortConv, _Mixer  # noqa: F401 (re-exported)

# group names of ``GRADS`` (``replay.groups``): the router, the always-on expert (the token mixer's
# group is each mixer kind's ``grads``)
ROUTER, SHARED = "router", "shared"
Shapes = dict[str, tuple[int, ...]]
Grads = dict[str, tuple[str, ...]]

# ----- token mixers (the attention kinds; the others are in :mod:`.mixers`) -------------------------


@dataclass(frozen=True)
class Attention:
    """Softmax attention (``replay.blocks.attention``): ``heads`` query heads over ``kv_heads`` key
    and value heads of ``head_dim`` (values ``v_head_dim`` wide where they differ, MiMo-V2-Flash);
    RoPE unless ``rope`` is false (NoPE layers), from the RoPE table of ``attention_kind`` where a model
    has one per kind of layer (``ModelSpec.attention_kinds``); a causal ``window`` or a ``chunk`` of
    local attention; learned ``sinks``; the query also emitting a gate (``gated_q``, Qwen3-Next), an
    output gate (``output_gate``), a q/k norm (``qk_norm``, as ``LayerSettings.qk_norm``), biases,
    one fused ``qkv`` projection, a norm on the output (``out_norm``, AFMoE); q, k and v clamped to
    ±``clip`` (DBRX's ``clip_qkv``); on NoPE layers the query × 1 + s·log(1 + ⌊(pos + 1) / f⌋) with
    (s, f) = ``temperature`` (Llama 4's ``attn_scale``, ``floor_scale``)."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int = 0
    rope: bool = True
    attention_kind: int | None = None
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False
    value_scale: float = 1.0
    gated_q: bool = False
    output_gate: str = ""
    qk_norm: str = "none"
    bias: bool = False
    o_bias: bool = True
    fused_qkv: bool = False
    out_norm: bool = False
    clip: float | None = None
    temperature: tuple[float, float] | None = None

    KIND: ClassVar[str] = "attention"
    # in the mixer group before the pre-norm's gains, then after them (``Residual.INPUTS``)
    HEAD: ClassVar[tuple[str, ...]] = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm")
    TAIL: ClassVar[tuple[str, ...]] = ("attn_out_norm", "sinks", "qkv", "qkv_bias", "g_proj")

    @property
    def sharded(self) -> str | None:
        if self.attention_kind is not None:
            return "attention per kind of layer (head counts, head sizes, RoPE tables and sinks by layer type)"
        return None

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def has_qk_norm(self) -> bool:
        return self.qk_norm not in ("none", "l2")

    def names(self) -> list[str]:
        names = [*(["qkv"] if self.fused_qkv else ["q", "k", "v"]), "o"]
        names += ["sinks"] if self.sinks else []
        names += ["g_proj"] if self.output_gate else []
        names += ["attn_out_norm"] if self.out_norm else []
        if self.bias:
            names += ["qkv_bias"] if self.fused_qkv else ["q_bias", "k_bias", "v_bias"]
            names += ["o_bias"] if self.o_bias else []
        return names

    def late_names(self) -> list[str]:
        """Listed after the residual's norm biases (``Layer.names``)."""
        return ["q_norm", "k_norm"] if self.has_qk_norm else []

    def shapes(self, H: int) -> Shapes:
        nh, D = self.heads, self.head_dim
        q_dim, kv_dim, v_dim = nh * D, self.kv_heads * D, self.kv_heads * self.value_dim
        q_rows = 2 * q_dim if self.gated_q else q_dim  # q_proj emits [query | gate] per head
        full = self.qk_norm == "full"
        return {
            "q": (q_rows, H),
            "k": (kv_dim, H),
            "v": (v_dim, H),
            "o": (H, nh * self.value_dim),
            "q_bias": (q_rows,),
            "k_bias": (kv_dim,),
            "v_bias": (v_dim,),
            "o_bias": (H,),
            "qkv": (q_dim + 2 * kv_dim, H),
            "qkv_bias": (q_dim + 2 * kv_dim,),
            "q_norm": (q_dim,) if full else (D,),
            "k_norm": (kv_dim,) if full else (D,),
            "sinks": (nh,),
            "g_proj": (nh if self.output_gate in ("head", "head_sigmoid") else q_dim, H),
            "attn_out_norm": (H,),
        }

    @classmethod
    def grads(cls, inputs: tuple[str, ...]) -> tuple[str, ...]:
        """The mixer group's order with the residual's ``inputs`` (its pre-norm gains) in place."""
        return (*cls.HEAD, *inputs, *cls.TAIL)


@dataclass(frozen=True)
class MLAttention:
    """Multi-head latent attention (DeepSeek-V2/V3, ``replay.blocks.mla``): ``heads`` heads over a
    low-rank query and one shared kv latent (``mla``); RoPE on the rope dims unless ``rope`` is
    false (Kimi Linear); DeepSeek Sparse Attention's indexer (``index``; None on a layer that reuses
    the previous layer's selection, HY-V4); sinks, an output gate and biases as :class:`Attention`'s.
    LongCat-Flash's LoRA scales (``lora_scale``: the query × √(H / q_lora_rank), the normed kv latent ×
    √(H / kv_lora_rank)); the latents' RMSNorm eps (``norm_eps``; None: ``MLA_NORM_EPS``, as DeepSeek
    builds them); Mistral 4's query × 1 + β·log(1 + ⌊pos / L⌋) with (β, L) = ``position_scale``; the
    DSA indexer's RoPE on adjacent pairs (``index_rope_interleave``, GLM-5) or on the last rope dims
    of its heads (``index_rope_last``, HY-V4) and its key norm's eps (``index_norm_eps``; None: 1e-6)."""

    mla: MLA
    heads: int
    rope: bool = True
    index: SparseIndex | None = None
    shared_index: bool = False
    sinks: bool = False
    output_gate: str = ""
    qk_norm: str = "none"
    head_dim: int = 0  # the spec's head_dim (the q/k norm's width, where one is given)
    bias: bool = False
    lora_scale: bool = False
    norm_eps: float | None = None
    position_scale: tuple[float, int] | None = None
    index_rope_interleave: bool = False
    index_rope_last: bool = False
    index_norm_eps: float | None = None

    KIND: ClassVar[str] = "mla"
    HEAD: ClassVar[tuple[str, ...]] = ("q", "o", "o_bias", "q_norm", "k_norm")
    TAIL: ClassVar[tuple[str, ...]] = (
        "q_a",
        "q_a_bias",
        "q_a_norm",
        "q_b",
        "kv_a",
        "kv_a_bias",
        "kv_a_norm",
        "kv_b",
        "sinks",
        "g_proj",
    )
    INDEX_NAMES: ClassVar[tuple[str, ...]] = ("idx_wq_b", "idx_wk", "idx_k_norm", "idx_k_norm_bias", "idx_weights")

    @property
    def sharded(self) -> str | None:
        return None

    def names(self) -> list[str]:
        m = self.mla
        names = ["kv_a", "kv_a_norm", "kv_b", "o"]
        names += ["q_a", "q_a_norm", "q_b"] if m.q_lora_rank else ["q"]
        if self.bias:
            names += ["kv_a_bias", "o_bias"] + (["q_a_bias"] if m.q_lora_rank else [])
        if self.index is not None and not self.shared_index:  # HY-V4: shared layers have none
            names += list(self.INDEX_NAMES)
        names += ["g_proj"] if self.output_gate else []
        names += ["sinks"] if self.sinks else []  # HY-V4
        return names

    def late_names(self) -> list[str]:
        return ["q_norm", "k_norm"] if self.qk_norm not in ("none", "l2") else []

    def shapes(self, H: int) -> Shapes:
        m, nh = self.mla, self.heads
        shapes: Shapes = {
            "q": (nh * m.qk_head_dim, H),
            "q_a": (m.q_lora_rank, H),
            "q_a_bias": (m.q_lora_rank,),
            "q_a_norm": (m.q_lora_rank,),
            "q_b": (nh * m.qk_head_dim, m.q_lora_rank),
            "kv_a": (m.kv_lora_rank + m.qk_rope_dim, H),
            "kv_a_bias": (m.kv_lora_rank + m.qk_rope_dim,),
            "kv_a_norm": (m.kv_lora_rank,),
            "kv_b": (nh * (m.qk_nope_dim + m.v_head_dim), m.kv_lora_rank),
            "o": (H, nh * m.v_head_dim),
            "o_bias": (H,),
            "sinks": (nh,),
            # HY-V4: a gate per channel of the MLA output; Ling 3: one per head
            "g_proj": (nh if self.output_gate in ("head", "head_sigmoid") else nh * m.v_head_dim, H),
            "q_norm": (self.head_dim,) if self.qk_norm != "full" else (nh * self.head_dim,),
            "k_norm": (self.head_dim,),
        }
        if (x := self.index) is not None:
            shapes.update(
                {
                    "idx_wq_b": (x.n_heads * x.head_dim, m.q_lora_rank),
                    "idx_wk": (x.head_dim, H),
                    "idx_k_norm": (x.head_dim,),
                    "idx_k_norm_bias": (x.head_dim,),
                    "idx_weights": (x.n_heads, H),
                }
            )
        return shapes

    # LongCat-Flash's second attention (``Residual.shortcut``), a copy of this one
    SECOND: ClassVar[tuple[str, ...]] = (
        *(SECOND_BLOCK + n for n in ("input_norm", "q_a", "q_a_bias", "q_a_norm", "q_b", "kv_a", "kv_a_bias")),
        *(SECOND_BLOCK + n for n in ("kv_a_norm", "kv_b", "o", "o_bias")),
    )

    @classmethod
    def grads(cls, inputs: tuple[str, ...]) -> tuple[str, ...]:
        return (*cls.HEAD, *inputs, *cls.TAIL, *cls.SECOND)


# every token mixer kind; this order is the mixer gradient group's (``replay.groups``, the receipts'
# bits): a new kind goes last
Mixer = Attention | MLAttention | Lightning | DeltaNet | KDA | MambaMixer | ShortConv | MoA


# ----- MLP / MoE blocks -------------------------------------------------------------------------


@dataclass(frozen=True)
class DenseMLP:
    """A dense MLP (``mlp_`` names): SwiGLU, or non-gated ReLU² (``gated`` false, Nemotron-H), of
    width ``dim``; a clamp after the activation at ``glu_limit`` (Step 3.5; 0: none); its output
    normed (``out_norm``, AFMoE: gain ``moe_out_norm``)."""

    dim: int
    gated: bool = True
    glu_limit: float = 0.0
    out_norm: bool = False
    prefix: str = "mlp_"

    KIND: ClassVar[str] = "mlp"

    @property
    def sharded(self) -> str | None:
        return None

    def names(self) -> list[str]:
        p = self.prefix
        names = [p + "w1", p + "w3", p + "w2"] if self.gated else [p + "w1", p + "w2"]
        return names + (["moe_out_norm"] if self.out_norm else [])

    def shapes(self, H: int) -> Shapes:
        p, I = self.prefix, self.dim
        return {p + "w1": (I, H), p + "w3": (I, H), p + "w2": (H, I), "moe_out_norm": (H,)}


@dataclass(frozen=True)
class SharedExpert:
    """The always-on expert of width ``dim`` (``shared_`` names): behind a sigmoid gate (``gated``,
    Qwen2-MoE), its gate and up rows in one tensor (``fused``, Granite 4.0), non-gated ReLU²
    (``glu`` false, Nemotron-H); a clamp after the activation at ``glu_limit`` (Step 3.5; 0: none), or
    DeepSeek-V4's before it, silu(min(gate, c)) ⊙ clamp(up, ±c) with c = ``clamp`` (0: none); its
    output × ``scale`` (Cohere's "average" combination: 0.5)."""

    dim: int
    gated: bool = True
    fused: bool = False
    glu: bool = True
    glu_limit: float = 0.0
    scale: float = 1.0
    clamp: float = 0.0

    GRADS: ClassVar[Grads] = {SHARED: ("shared_w1", "shared_w3", "shared_w2", "shared_gate")}

    def names(self) -> list[str]:
        if self.fused:
            names = ["shared_gate_up", "shared_w2"]
        else:
            names = ["shared_w1", "shared_w3", "shared_w2"] if self.glu else ["shared_w1", "shared_w2"]
        return names + (["shared_gate"] if self.gated else [])

    def shapes(self, H: int) -> Shapes:
        S = self.dim
        return {
            "shared_w1": (S, H),
            "shared_w3": (S, H),
            "shared_w2": (H, S),
            "shared_gate": (1, H),
            "shared_gate_up": (2 * S, H),
        }


@dataclass(frozen=True)
class MoE:
    """A routed MoE block (``replay.blocks.moe``): top-``top_k`` of ``experts`` experts of width
    ``expert_dim`` (the last ``zero_experts`` of them identity experts, LongCat), chosen by
    ``gate``; a selection bias (``gate.selection_bias``) and a bias on the router logits
    (``logit_bias``, gpt-oss); its output normed (``out_norm``, A.X-K1) or biased (``out_bias``,
    JetMoE); an optional :class:`SharedExpert`; the experts' SwiGLU clamped after the activation at
    ``glu_limit`` (Step 3.5, per layer; 0: none).

    The router: the chosen experts' weights renormalised to sum 1 (``renormalise``; the sum + ``renorm_eps``,
    LFM2, or at least ``renorm_min``, ERNIE 4.5); its logits soft-capped, c·tanh(logit / c) with c =
    ``softcap`` (Laguna; 0: none); a sigmoid router without a selection bias choosing on σ(logits)
    (``sigmoid_select``, Flint) rather than on the logits (Llama 4); Phi-3.5-MoE's sparsemixer jitter
    ε (``sparsemixer_eps``, with ``gate.scoring`` "sparsemixer"). Each chosen expert reads its input
    scaled by its combine weight and the outputs are summed unweighted (``scaled_inputs``, Llama 4)."""

    experts: int
    top_k: int
    expert_dim: int
    gate: Gate
    logit_bias: bool = False
    out_norm: bool = False
    out_bias: bool = False
    zero_experts: int = 0
    shared: SharedExpert | None = None
    glu_limit: float = 0.0
    renormalise: bool = False
    renorm_min: float = 0.0
    renorm_eps: float = 0.0
    softcap: float = 0.0
    sigmoid_select: bool = False
    sparsemixer_eps: float | None = None
    scaled_inputs: bool = False

    KIND: ClassVar[str] = "moe"
    GRADS: ClassVar[Grads] = {ROUTER: ("router", "router_logit_bias"), SHARED: ("moe_bias",)}

    def names(self) -> list[str]:
        names = ["router"]
        names += ["router_bias"] if self.gate.selection_bias else []
        names += ["router_logit_bias"] if self.logit_bias else []
        names += ["moe_out_norm"] if self.out_norm else []
        names += ["moe_bias"] if self.out_bias else []
        return names + ([] if self.shared is None else self.shared.names())

    @property
    def sharded(self) -> str | None:
        if self.out_bias:
            return MoA.SHARDED
        if self.out_norm:
            return "norm on the MoE output"
        if self.zero_experts:
            return Residual.SHORTCUT
        return None

    def shapes(self, H: int) -> Shapes:
        E = self.experts
        shapes: Shapes = {"router": (E, H), "router_bias": (E,), "router_logit_bias": (E,)}
        shapes.update({"moe_out_norm": (H,), "moe_bias": (H,)})
        return shapes | ({} if self.shared is None else self.shared.shapes(H))

    def expert_shapes(self, H: int, fused_format: str) -> Shapes:
        """The routed experts' tensors: one expert's (w1, w3, w2 and gpt-oss's biases) and the
        fused stacks of the layouts that store them together (``Layout.fused_format``)."""
        E, I = self.experts, self.expert_dim
        shapes: Shapes = {
            "w1": (I, H),
            "w3": (I, H),
            "w2": (H, I),
            "b1": (I,),
            "b3": (I,),
            "b2": (H,),
            "gate_up": (E, 2 * I, H),
            "down": (E, H, I),
            "gate_up_bias": (E, 2 * I),
            "down_bias": (E, H),
        }
        if fused_format == "flat":  # DBRX: w1, v1, w2 each [E·I, H]
            shapes["gate_up"] = shapes["up"] = shapes["down"] = (E * I, H)
        if fused_format == "split":  # Step 3.5: gate and up each [E, I, H]
            shapes["gate_up"] = shapes["up"] = (E, I, H)
        if fused_format == "up_down":  # Nemotron-H: up [E, I, H], no gate
            shapes["up"] = (E, I, H)
        if fused_format in ("interleaved", "transposed"):
            shapes["gate_up"], shapes["down"] = (E, H, 2 * I), (E, I, H)
        return shapes


FFN = DenseMLP | MoE


# ----- residual wiring and the layer ------------------------------------------------------------


@dataclass(frozen=True)
class HyperConnection:
    """HY-V4's hyper-connections: the residual stream is ``streams`` streams, [B, T, hc, H] (the
    embedding copied onto each; a layer's input and output). Each sub-block reads a mix Σ_s pre_s x_s,
    pre = σ(·) + ``eps``, formed from the flattened streams (``HC_NAMES``: ``attn_hc_*`` before
    attention, ``ffn_hc_*`` before the MLP / MoE block), and its output f is added to every stream s ×
    post_s = ``magnitude``·σ(·) + ``eps``; a head (globals ``hc_head_*``) mixes the streams into one
    before the final norm. ``sinkhorn_iters`` > 0: DeepSeek-V4's manifold-constrained mHC, each
    hyper-connection also forming a residual mixing matrix comb [B, T, hc, hc] = Sinkhorn(softmax(·) +
    ``eps``) with that many iterations (fn [(2 + hc)·hc, hc·H], base [(2 + hc)·hc], scale [3]); a
    sub-block's output is then written as Σ_j comb_js x_j + post_s · f, post = ``magnitude``·σ(·)."""

    streams: int
    sinkhorn_iters: int = 0
    magnitude: float = 2.0
    eps: float = 1e-6

    def shapes(self, H: int) -> Shapes:
        hc, shapes = self.streams, {}
        for block in ("attn", "ffn"):
            shapes.update(
                {f"{block}_hc_fn": (2 * hc, hc * H), f"{block}_hc_base": (2 * hc,), f"{block}_hc_scale": (2,)}
            )
        return shapes


@dataclass(frozen=True)
class Residual:
    """How a layer's mixer and MLP / MoE block sit on the residual stream.

    ``pre_norm``: each block reads a norm of the stream (``input_norm``, ``post_norm``; LayerNorms
    with biases: ``norm_bias``) — false: the stream itself (OLMo-2 post-norm layers); ``parallel``:
    both blocks read the layer input's one norm (Cohere); ``single_block``: the layer is one block on
    one norm (Nemotron-H); ``multiplier``: each block's output × it (Granite); ``scales``: DeepNorm's
    (α, β) of the mixer and of the MLP / MoE block, out = α·norm(x) + β·f(norm(x)) (MiniMax-01);
    ``hc``: hyper-connections (HY-V4); ``shortcut``: LongCat-Flash's second attention and the dense
    MLPs (names ``SECOND_BLOCK`` + the first's) around an MoE that reads the first MLP's input."""

    pre_norm: bool = True
    norm_bias: bool = False
    parallel: bool = False
    single_block: bool = False
    multiplier: float = 1.0
    scales: tuple[tuple[float, float], tuple[float, float]] | None = None
    hc: HyperConnection | None = None
    shortcut: DenseMLP | None = None

    INPUTS: ClassVar[tuple[str, ...]] = ("input_norm", "input_norm_bias")
    SHORTCUT: ClassVar[str] = (
        "shortcut-connected MoE (two attention and dense-MLP sub-blocks per layer, zero-computation experts)"
    )

    def norm_names(self) -> list[str]:
        if not self.pre_norm:
            return []
        return ["input_norm"] if self.single_block else ["input_norm", "post_norm"]

    def bias_names(self) -> list[str]:
        return ["input_norm_bias", "post_norm_bias"] if self.norm_bias else []

    def hc_names(self) -> list[str]:
        return list(HC_NAMES) if self.hc is not None else []

    def shapes(self, H: int) -> Shapes:
        shapes = {n: (H,) for n in ("input_norm", "post_norm", "input_norm_bias", "post_norm_bias")}
        return shapes | ({} if self.hc is None else self.hc.shapes(H))

    def grads(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The residual's part of the mixer group: (the pre-norm gains, which a mixer's ``grads``
        places; after the mixer: HY-V4's hyper-connection of the attention sub-block)."""
        return self.INPUTS, HC_NAMES[:3]

    @property
    def wiring(self) -> str:
        """How the blocks' outputs join the stream, the key of the replay's residual registries
        (``replay.blocks.layer.RESIDUALS``, ``replay.blocks.backward.RESIDUALS``), m the multiplier:

        * "hyper_connection": several residual streams, mixed before and added back after each
          sub-block (HY-V4, ``hc``);
        * "shortcut": h = x + m·attention(norm(x)); the MoE reads norm(h) and its output is added at
          the end of the dense MLP / second-attention chain (LongCat-Flash, ``shortcut``);
        * "deepnorm": α·norm(x) + β·f(norm(x)) after each block (MiniMax-01, ``scales``);
        * "single_block": the layer is one block, x + m·f(norm(x)) (Nemotron-H);
        * "parallel": x + m·mixer(norm(x)) + m·f(norm(x)), both blocks reading x's norm (Cohere);
        * "sequential": h = x + m·mixer(norm(x)), h + m·f(norm(h)).

        The families set at most one of these; the order here decides otherwise."""
        if self.hc is not None:
            return "hyper_connection"
        if self.shortcut is not None:
            return "shortcut"
        if self.scales is not None:
            return "deepnorm"
        if self.single_block:
            return "single_block"
        return "parallel" if self.parallel else "sequential"

    @property
    def sharded(self) -> str | None:
        if self.scales is not None:
            return "DeepNorm residuals"
        if self.hc is not None:
            return "hyper-connections (several residual streams mixed before and after each sub-block)"
        if self.shortcut is not None:
            return self.SHORTCUT
        return None


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its token mixer (None: a Nemotron-H MLP or MoE layer), its MLP / MoE
    block (None: a Nemotron-H mixer layer) and how both sit on the residual stream."""

    mixer: Mixer | None
    ffn: FFN | None
    residual: Residual = Residual()

    @property
    def routed(self) -> bool:
        return isinstance(self.ffn, MoE)

    def names(self) -> list[str]:
        """The canonical tensors a checkpoint holds for this layer (the routed experts' apart)."""
        r = self.residual
        if r.single_block:  # Nemotron-H: the block's one norm, then its weights
            names = ["input_norm"] + ([] if self.mixer is None else self.mixer.names())
            if isinstance(self.ffn, MoE):  # the same gain again, as the MoE block's norm (drift receipts)
                names.append("post_norm")
            return names + ([] if self.ffn is None else self.ffn.names())
        names = ["input_norm", "post_norm"]
        if self.mixer is not None:
            names += self.mixer.names()
        names += r.bias_names()
        if self.mixer is not None:
            names += self.mixer.late_names()
        if r.shortcut is not None:  # LongCat: a dense MLP and a second attention sub-block
            names += r.shortcut.names()
            names += [SECOND_BLOCK + n for n in names]
        names += [] if self.ffn is None else self.ffn.names()
        names += r.hc_names()
        if not r.pre_norm:  # OLMo-2 post-norm layers: no norm in front of attention or the MLP / MoE block
            names = [n for n in names if n not in ("input_norm", "post_norm")]
        return names

    def shapes(self, H: int, fused_format: str) -> Shapes:
        """The shape of each of this layer's tensors and of its routed experts'."""
        shapes = self.residual.shapes(H)
        if self.mixer is not None:
            shapes.update(self.mixer.shapes(H))
        if self.residual.shortcut is not None:
            shapes.update(self.residual.shortcut.shapes(H))
        if self.ffn is not None:
            shapes.update(self.ffn.shapes(H))
        if isinstance(self.ffn, MoE):
            shapes.update(self.ffn.expert_shapes(H, fused_format))
        if self.residual.shortcut is not None:  # the second sub-block's tensors are shaped as the first's
            shapes.update({SECOND_BLOCK + n: shape for n, shape in shapes.items()})
        return shapes

    def sharded_refusal(self) -> str | None:
        """What of this layer the expert-parallel replay does not replay (None: it replays it)."""
        for block in (self.mixer, self.residual, self.ffn):
            if block is None:
                continue
            if (why := block.sharded) is not None:
                return why
        return None

    def to_json(self) -> dict[str, Any]:
        """The layer as ``ModelSpec.to_json`` writes a family's own blocks: each block's fields
        with its kind."""

        def block(b: Mixer | FFN | None) -> dict[str, Any] | None:
            return None if b is None else {"kind": b.KIND, **asdict(b)}

        return {"mixer": block(self.mixer), "ffn": block(self.ffn), "residual": asdict(self.residual)}


T = TypeVar("T")


def uniform(n: int, entry: T) -> tuple[T, ...]:
    """One ``entry`` for each of ``n`` decoder layers: a layer of the same blocks
    (``LayerSettings.layer_blocks``) or the same attention variant (``LayerSettings.attention``)."""
    return (entry,) * n


def per_layer_type(types: Sequence[str], blocks: Mapping[str, T]) -> tuple[T, ...]:
    """One entry per entry of ``types`` (a config's ``layer_types``): the layer, or the block (a
    token mixer), given for its type; a type without one is a ``KeyError`` naming it (the family
    turns it into a config error)."""
    missing = sorted(set(types) - set(blocks))
    if missing:
        raise KeyError(f"no blocks for layer type(s) {', '.join(map(repr, missing))}")
    return tuple(blocks[t] for t in types)
