"""A family's description of its decoder layers as read (:class:`LayerSettings`), which
``spec.config.derived_layer`` turns, with the model-wide fields, into each layer's typed blocks
(``ModelSpec.layers``). Only ``moeaudit.spec`` and the family files read the settings; everything
else reads the blocks (tests/test_layering.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeaudit.spec.blocks import (
    Layer,
)
from moeaudit.spec.geometry import LinearAttention, Mamba

# Settings added for new families carry ``NEW``: left out of ``ModelSpec.to_json`` at their default,
# so the JSON of the families that predate them stays byte-identical.
NEW = {"omit_default": True}


@dataclass(frozen=True)
class AttentionVariant:
    """How one layer's attention differs from the model's (``LayerSettings.attention``): a causal window
    of ``window`` keys, the query's included (None: none); no RoPE (``rope`` false: a NoPE layer);
    attention within blocks of ``chunk`` tokens (Llama 4's chunked local attention); the attention of
    kind ``kind`` (an index into ``ModelSpec.attention_kinds``: its heads, head sizes, RoPE table,
    sinks); the previous layer's DSA key selection reused (``shared_index``, HY-V4)."""

    window: int | None = None
    rope: bool = True
    chunk: int | None = None
    kind: int | None = None
    shared_index: bool = False


SAME = AttentionVariant()  # a layer whose attention is the model's


@dataclass(frozen=True)
class GLULimits:
    """One layer's SwiGLU clamps after the activation, min(silu(gate), L) ⊙ clamp(up, ±L), Step 3.5's
    ``swiglu_limits`` (``experts``: the routed experts') and ``swiglu_limits_shared`` (``mlp``: the shared
    expert's and the dense MLP's); 0: no clamp."""

    experts: float = 0.0
    mlp: float = 0.0


@dataclass(frozen=True)
class LayerSettings:
    """What a family's config says about its decoder layers' blocks, as read: the settings
    :func:`derived_layer` builds ``ModelSpec.layers`` from (with the model-wide fields), and that
    ``ModelSpec.to_json`` writes where they stood when they were ModelSpec fields. The replay, the
    checkpoint reader and the receipts read the blocks, never these (tests/test_layering.py)."""

    # biases on the q/k/v projections (and o_proj unless ``o_bias`` is false)
    attention_bias: bool = False
    # "none" | "full" (OLMoE, over all heads) | "head" (Qwen3, per head) | "head_after_rope"
    # (Hunyuan: per head, applied to the rotated q and k)
    qk_norm: str = "none"
    o_bias: bool = field(default=True, metadata=NEW)  # attention_bias covers o_proj (not Qwen2-MoE, GLM)
    gated_attention: bool = field(default=False, metadata=NEW)  # q_proj also emits a gate: out ⊙ σ(gate)
    linear_attention: LinearAttention | None = field(default=None, metadata=NEW)  # gated DeltaNet sizes
    # Kimi Linear: layers mixing by Kimi Delta Attention (per-channel decay; sizes in linear_attention)
    # Ling 3 (bailing_hybrid): the KDA forget gate bounded, log α = bound · σ(exp(A_log) · f) (None: Kimi's
    # −exp(A_log) · softplus(f))
    kda_gate_bound: float | None = field(default=None, metadata=NEW)
    # Granite: each block's output × this before the residual add
    residual_multiplier: float = field(default=1.0, metadata=NEW)
    # gpt-oss: a learned per-head sink logit in every attention softmax (it takes mass, adds no value)
    attention_sinks: bool = field(default=False, metadata=NEW)
    # LFM2-MoE: the layers whose type is "conv" mix tokens by a short convolution (kernel
    # ``conv_kernel``, biases with ``conv_bias``) instead of attention
    conv_kernel: int = field(default=0, metadata=NEW)
    conv_bias: bool = field(default=False, metadata=NEW)
    # Mamba hybrids (Jamba, Granite 4.0): the token mixer of ``mamba_layers`` is a selective
    # state-space scan of these sizes instead of attention
    mamba: Mamba | None = field(default=None, metadata=NEW)
    # MiniMax-01: lightning attention (decayed linear attention, ``replay.lightning``) on
    # ``lightning_layers``, in blocks of ``lightning_block`` tokens; DeepNorm-style residuals: a
    # sub-block adds to its normed input, out = α·norm(x) + β·f(norm(x)), with (α, β) in
    # ``residual_scales`` for full attention, lightning attention and the MLP / MoE block
    lightning_block: int = field(default=0, metadata=NEW)
    residual_scales: tuple[tuple[float, float], ...] | None = field(default=None, metadata=NEW)
    # Laguna: the attention output gated by softplus(W_g x), one gate per head ("head") or per
    # channel ("element"); AFMoE: "sigmoid", σ(W_g x) per channel
    output_gate: str = field(default="", metadata=NEW)
    # AFMoE (sandwich norms): the attention output passes an RMSNorm (gain ``attn_out_norm``)
    # before the residual add, and so does a dense layer's MLP output (``dense_out_norm``: gain
    # ``moe_out_norm``, as on the routed layers); ``output_gate`` "sigmoid": out ⊙ σ(W_g x) per channel
    attn_out_norm: bool = field(default=False, metadata=NEW)
    dense_out_norm: bool = field(default=False, metadata=NEW)
    # JetMoE: the token mixer is a mixture of attention heads (``replay.moa``, ``MOA_NAMES``)
    moa: bool = field(default=False, metadata=NEW)
    # LongCat-Flash: two attention + dense-MLP sub-blocks around one MoE (``Residual.shortcut``)
    shortcut_moe: bool = field(default=False, metadata=NEW)
    # the settings of the blocks the ModelSpec notes above describe (each block record says how it
    # uses its share: ``Attention.clip`` / ``temperature``, ``MLAttention``'s LoRA scales, latent eps,
    # position scale and indexer RoPE, ``SharedExpert.gated`` / ``scale`` / ``clamp``, ``MoE.out_bias`` /
    # ``out_norm``, ``Residual.parallel`` / ``pre_norm``)
    clip_qkv: float | None = None
    shared_gated: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert; DeepSeek: none
    attn_temperature: tuple[float, float] | None = field(default=None, metadata=NEW)
    index_rope_interleave: bool = field(default=False, metadata=NEW)
    parallel_block: bool = field(default=False, metadata=NEW)
    shared_scale: float = field(default=1.0, metadata=NEW)
    query_position_scale: tuple[float, int] | None = field(default=None, metadata=NEW)
    moe_out_norm: bool = field(default=False, metadata=NEW)
    pre_norm: bool = field(default=True, metadata=NEW)
    moe_bias: bool = field(default=False, metadata=NEW)
    mla_lora_scale: bool = field(default=False, metadata=NEW)
    shared_clamped: bool = field(default=False, metadata=NEW)
    index_rope_last: bool = field(default=False, metadata=NEW)
    index_norm_eps: float | None = field(default=None, metadata=NEW)
    mla_norm_eps: float | None = field(default=None, metadata=NEW)
    # the router's and the routed experts' settings the ModelSpec notes above describe (``MoE``:
    # ``renormalise``, ``logit_bias``, ``sparsemixer_eps``, ``renorm_min``, ``renorm_eps``, ``softcap``,
    # ``sigmoid_select``, ``scaled_inputs``)
    norm_topk_prob: bool = False
    router_logit_bias: bool = field(default=False, metadata=NEW)
    scaled_expert_inputs: bool = field(default=False, metadata=NEW)
    sparsemixer_eps: float | None = field(default=None, metadata=NEW)
    renorm_min: float = field(default=0.0, metadata=NEW)
    renorm_eps: float = field(default=0.0, metadata=NEW)
    router_softcap: float = field(default=0.0, metadata=NEW)
    sigmoid_select: bool = field(default=False, metadata=NEW)
    # how each layer's attention differs from the model's, one per layer (() : none differs), built with
    # ``spec.blocks.uniform`` / ``per_layer_type``: windows, NoPE and chunked layers, the attention kind,
    # HY-V4's reused DSA selection
    attention: tuple[AttentionVariant, ...] = ()
    # Step 3.5 / Step-3.7: each layer's SwiGLU clamps (() : none anywhere)
    glu_limits: tuple[GLULimits, ...] = field(default=(), metadata=NEW)
    # A family that describes its decoder layers as typed blocks itself (``spec.blocks``:
    # ``uniform``, ``per_layer_type``; docs/guides/block-kind.md) gives them here, one per layer;
    # () : ``layers`` derives them from the fields above
    layer_blocks: tuple[Layer, ...] = field(default=(), metadata=NEW)
