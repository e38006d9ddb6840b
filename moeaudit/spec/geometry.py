"""The sizes and tensor names the block records (:mod:`.blocks`) are built from: multi-head latent
attention's ranks, the router's gate, DeepSeek Sparse Attention's indexer, the clamped GLU, Mamba's
and the linear attentions' sizes, and each block kind's canonical tensor names. Torch-free;
:mod:`.config` re-exports the records, so ``ModelSpec`` fields keep their types' old import path."""

from __future__ import annotations

from dataclasses import dataclass

# LongCat-Flash: the canonical names of a layer's second attention and dense-MLP sub-block are
# the first's with this prefix (``blocks.Residual.shortcut``)
SECOND_BLOCK = "s2_"

# LFM2's short convolution mixer (``replay.shortconv``): its weights, in the attention gradient norm
SHORT_CONV_NAMES = ("conv_in", "conv_in_bias", "conv_w", "conv_bias", "conv_out", "conv_out_bias")
# JetMoE's mixture of attention heads (``replay.moa``): router [E, H], expert q [E, X, H] and o
# [E, H, X] projections (X = num_kv_heads · head_dim), the output bias [H], the shared kv [2X, H];
# in the attention gradient norm
MOA_NAMES = ("moa_router", "moa_q", "moa_o", "moa_bias", "kv")
# HY-V4's hyper-connection mixing weights of a layer (``HyperConnection.streams``): for the attention and
# the MLP / MoE sub-block each, fn [2·hc, hc·H], base [2·hc], scale [2] (DeepSeek-V4's mHC,
# ``HyperConnection.sinkhorn_iters``: fn [(2 + hc)·hc, hc·H], base [(2 + hc)·hc], scale [3])
HC_NAMES = tuple(f"{block}_hc_{n}" for block in ("attn", "ffn") for n in ("fn", "base", "scale"))
# every canonical tensor name a Mamba mixer may have (``Mamba.names`` lists one layer's)
MAMBA_NAMES = (
    "ssm_in",
    "ssm_in_bias",
    "ssm_conv",
    "ssm_conv_bias",
    "ssm_x",
    "ssm_dt",
    "ssm_dt_bias",
    "ssm_A_log",
    "ssm_D",
    "ssm_dt_norm",
    "ssm_b_norm",
    "ssm_c_norm",
    "ssm_norm",
    "ssm_out",
    "ssm_out_bias",
)
# MiniMax-01's lightning attention: its weights (gradients measured) and its decay buffers (not)
LIGHTNING_NAMES = ("light_qkv", "light_gate", "light_norm", "light_out")
LIGHTNING_BUFFERS = ("light_slope", "light_qdecay", "light_kdecay", "light_ddecay")
LINEAR_ATTENTION_NAMES = (
    "lin_in",
    "lin_qkvz",
    "lin_ba",
    "lin_qkv",
    "lin_z",
    "lin_b",
    "lin_a",
    "lin_conv",
    "lin_dt_bias",
    "lin_A_log",
    "lin_norm",
    "lin_out",
)
# Kimi Linear's Kimi Delta Attention (``replay.kda``): q, k, v, their convolutions (stored apart), the low-rank
# per-channel forget gate (f_a, f_b, dt_bias, A_log), β, the low-rank output gate, norm, output
KDA_NAMES = (
    "kda_q",
    "kda_k",
    "kda_v",
    "kda_q_conv",
    "kda_k_conv",
    "kda_v_conv",
    "kda_f_a",
    "kda_f_b",
    "kda_f",
    "kda_dt_bias",
    "kda_A_log",
    "kda_b",
    "kda_g_a",
    "kda_g_b",
    "kda_g",
    "kda_norm",
    "kda_o",
)
KDA_LOW_RANK = ("kda_f_a", "kda_f_b", "kda_g_a", "kda_g_b")  # Kimi Linear's gates
KDA_FULL_RANK = ("kda_f", "kda_g")  # Ling 3's (bailing_hybrid)
# Qwen3-Next groups q, k, v, z (and b, a) per key head in two projections; Qwen3.5 has four.
GROUPED_PROJECTIONS = ("lin_qkvz", "lin_ba")
FLAT_PROJECTIONS = ("lin_qkv", "lin_z", "lin_b", "lin_a")
# Lara-Mini's checkpoints: Qwen3.5's four flat projections stored as one ``in_proj``, rows q|k|v|z|b|a
FUSED_PROJECTION = ("lin_in",)


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
class Gate:
    """How a router turns scores into an active set, beyond softmax-then-top-k.

    ``scoring`` "softmax", "sigmoid" or "sqrtsoftplus" (DeepSeek-V4); ``selection_bias``: a per-expert bias added to the
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
class SparseIndex:
    """DeepSeek Sparse Attention (V3.2): each query attends to the ``topk`` causal keys its
    lightning indexer (``n_heads`` heads of ``head_dim``) scores highest."""

    topk: int
    n_heads: int
    head_dim: int


@dataclass(frozen=True)
class ClampedGLU:
    """gpt-oss's expert activation: with a = W1 y + b1 (gate) and u = W3 y + b3 (up),
    h = (clamp(u, −limit, limit) + 1) ⊙ g σ(α g) where g = min(a, limit)."""

    alpha: float
    limit: float
    # HY-V4: (clamp(u, −limit, limit) + offset) with offset 0 and α 1 is SwiGLU on the clamped
    # gate and up, silu(min(a, limit)) ⊙ clamp(u, ±limit); left out of ``to_json`` at gpt-oss's 1
    offset: float = 1.0
    # Step 3.5 / Step-3.7 (``ModelSpec.expert_glu``): the clamp after the activation,
    # min(g σ(α g), limit) ⊙ (clamp(u, ±limit) + offset) with g = a unclamped (α 1, offset 0:
    # min(silu(a), limit) ⊙ clamp(u, ±limit)); left out of ``to_json`` when false
    after: bool = False


@dataclass(frozen=True)
class Mamba:
    """Sizes of a Mamba (selective state-space) token mixer (``moeaudit.replay.mamba``).

    ``version`` 1: Jamba's Mamba-1 (per-channel state of ``state`` dims, ``dt_rank``-wide
    time-step projection, RMS norms on dt, B and C); 2: Mamba-2 / SSD (``heads`` heads of
    ``head_dim`` channels sharing a scalar decay, B and C in ``groups`` groups, a gated
    RMS norm before the output projection, chunks of ``chunk`` tokens). ``dt_min``/``dt_max``
    clamp the time step after the softplus (None: no upper limit)."""

    version: int
    inner: int  # channels of the scan (expand × hidden_size, or heads × head_dim)
    state: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    heads: int = 0
    head_dim: int = 0
    groups: int = 1
    chunk: int = 256
    dt_rank: int = 0
    dt_min: float = 0.0
    dt_max: float | None = None
    eps: float = 1e-6  # the mixer's own RMS norms

    @property
    def conv_channels(self) -> int:
        return self.inner if self.version == 1 else self.inner + 2 * self.groups * self.state

    def names(self) -> list[str]:
        """The canonical tensors of one mixer."""
        names = ["ssm_in", "ssm_conv", "ssm_dt_bias", "ssm_A_log", "ssm_D", "ssm_out"]
        names += ["ssm_x", "ssm_dt", "ssm_dt_norm", "ssm_b_norm", "ssm_c_norm"] if self.version == 1 else ["ssm_norm"]
        names += ["ssm_conv_bias"] if self.conv_bias else []
        return names + (["ssm_in_bias", "ssm_out_bias"] if self.proj_bias else [])

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        I, N = self.inner, self.state
        if self.version == 1:
            return {
                "ssm_in": (2 * I, hidden),
                "ssm_in_bias": (2 * I,),
                "ssm_x": (self.dt_rank + 2 * N, I),
                "ssm_dt": (I, self.dt_rank),
                "ssm_dt_bias": (I,),
                "ssm_A_log": (I, N),
                "ssm_D": (I,),
                "ssm_dt_norm": (self.dt_rank,),
                "ssm_b_norm": (N,),
                "ssm_c_norm": (N,),
                **self._common(hidden),
            }
        proj = I + self.conv_channels + self.heads
        return {
            "ssm_in": (proj, hidden),
            "ssm_in_bias": (proj,),
            "ssm_dt_bias": (self.heads,),
            "ssm_A_log": (self.heads,),
            "ssm_D": (self.heads,),
            "ssm_norm": (I,),
            **self._common(hidden),
        }

    def _common(self, hidden: int) -> dict[str, tuple[int, ...]]:
        C = self.conv_channels
        return {
            "ssm_conv": (C, 1, self.conv_kernel),
            "ssm_conv_bias": (C,),
            "ssm_out": (hidden, self.inner),
            "ssm_out_bias": (hidden,),
        }


@dataclass(frozen=True)
class LinearAttention:
    """Sizes of a gated DeltaNet layer (Qwen3-Next ``linear_*`` config keys)."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim
