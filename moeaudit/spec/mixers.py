"""The token mixers that are not softmax attention (:mod:`.blocks` holds the attention kinds, the MLP
/ MoE blocks and the residual wiring): gated DeltaNet, Kimi Delta Attention, a selective state-space
scan, lightning attention, a short convolution and a mixture of attention heads. Each owns its
tensor names, their shapes, its part of the mixer gradient group and whether the expert-parallel
replay replays it, as every block kind does (docs/guides/block-kind.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moeaudit.spec.geometry import (
    FLAT_PROJECTIONS,
    FUSED_PROJECTION,
    GROUPED_PROJECTIONS,
    KDA_FULL_RANK,
    KDA_LOW_RANK,
    KDA_NAMES,
    LIGHTNING_BUFFERS,
    LIGHTNING_NAMES,
    LINEAR_ATTENTION_NAMES,
    MAMBA_NAMES,
    MOA_NAMES,
    SHORT_CONV_NAMES,
    LinearAttention,
    Mamba,
)

Shapes = dict[str, tuple[int, ...]]


class _Mixer:
    """A token mixer that is not attention: its names follow the residual's pre-norm gains in the
    mixer group, and it has no q/k norm of the spec's."""

    NAMES: ClassVar[tuple[str, ...]] = ()
    SHARDED: ClassVar[str | None] = None

    @property
    def sharded(self) -> str | None:
        return self.SHARDED

    def names(self) -> list[str]:
        return list(self.NAMES)

    def late_names(self) -> list[str]:
        return []

    @classmethod
    def grads(cls, inputs: tuple[str, ...]) -> tuple[str, ...]:
        return (*inputs, *cls.NAMES)


@dataclass(frozen=True)
class DeltaNet(_Mixer):
    """Gated DeltaNet (Qwen3-Next, ``replay.deltanet``): sizes in ``la``; its input projections
    "grouped" per key head (Qwen3-Next), "flat" (Qwen3.5) or "fused" into one (Lara-Mini)."""

    la: LinearAttention
    projections: str = "grouped"

    KIND: ClassVar[str] = "deltanet"
    NAMES: ClassVar[tuple[str, ...]] = LINEAR_ATTENTION_NAMES

    def names(self) -> list[str]:
        unused = {
            "grouped": FLAT_PROJECTIONS + FUSED_PROJECTION,
            "flat": GROUPED_PROJECTIONS + FUSED_PROJECTION,
            "fused": GROUPED_PROJECTIONS + FLAT_PROJECTIONS,
        }[self.projections]
        return [n for n in LINEAR_ATTENTION_NAMES if n not in unused]

    def shapes(self, H: int) -> Shapes:
        la = self.la
        key_dim, value_dim = la.num_k_heads * la.k_dim, la.num_v_heads * la.v_dim
        return {
            "lin_in": (2 * key_dim + 2 * value_dim + 2 * la.num_v_heads, H),
            "lin_qkvz": (2 * key_dim + 2 * value_dim, H),
            "lin_ba": (2 * la.num_v_heads, H),
            "lin_qkv": (2 * key_dim + value_dim, H),
            "lin_z": (value_dim, H),
            "lin_b": (la.num_v_heads, H),
            "lin_a": (la.num_v_heads, H),
            "lin_conv": (la.conv_channels, 1, la.conv_kernel),
            "lin_dt_bias": (la.num_v_heads,),
            "lin_A_log": (la.num_v_heads,),
            "lin_norm": (la.v_dim,),
            "lin_out": (H, value_dim),
        }


@dataclass(frozen=True)
class KDA(_Mixer):
    """Kimi Delta Attention (``replay.kda``): the delta rule with a per-channel decay; low-rank
    forget and output gates (Kimi Linear) or full-rank ones (``full_rank``, Ling 3, whose forget
    gate is bounded: ``gate_bound``)."""

    la: LinearAttention
    full_rank: bool = False
    gate_bound: float | None = None

    KIND: ClassVar[str] = "kda"
    NAMES: ClassVar[tuple[str, ...]] = KDA_NAMES
    SHARDED: ClassVar[str | None] = "Kimi Delta Attention layers"

    def names(self) -> list[str]:
        skip = KDA_LOW_RANK if self.full_rank else KDA_FULL_RANK
        return [n for n in KDA_NAMES if n not in skip]

    def shapes(self, H: int) -> Shapes:
        la = self.la
        qkv_dim, K = la.num_v_heads * la.v_dim, la.v_dim
        return {
            "kda_q": (qkv_dim, H),
            "kda_k": (qkv_dim, H),
            "kda_v": (qkv_dim, H),
            "kda_q_conv": (qkv_dim, 1, la.conv_kernel),
            "kda_k_conv": (qkv_dim, 1, la.conv_kernel),
            "kda_v_conv": (qkv_dim, 1, la.conv_kernel),
            "kda_f_a": (K, H),
            "kda_f_b": (qkv_dim, K),
            "kda_dt_bias": (qkv_dim,),
            "kda_f": (qkv_dim, H),
            "kda_g": (qkv_dim, H),
            "kda_A_log": (la.num_v_heads,) if self.full_rank else (1, 1, la.num_v_heads, 1),
            "kda_b": (la.num_v_heads, H),
            "kda_g_a": (K, H),
            "kda_g_b": (qkv_dim, K),
            "kda_norm": (K,),
            "kda_o": (H, qkv_dim),
        }


@dataclass(frozen=True)
class MambaMixer(_Mixer):
    """A selective state-space scan (Jamba, Granite 4.0, Nemotron-H; ``replay.mamba``)."""

    mamba: Mamba

    KIND: ClassVar[str] = "mamba"
    NAMES: ClassVar[tuple[str, ...]] = MAMBA_NAMES

    def names(self) -> list[str]:
        return self.mamba.names()

    def shapes(self, H: int) -> Shapes:
        return self.mamba.shapes(H)


@dataclass(frozen=True)
class Lightning(_Mixer):
    """MiniMax-01's lightning attention (``replay.lightning``): decayed linear attention in blocks
    of ``block`` tokens; its decay buffers are stored beside its weights (not in a gradient group)."""

    heads: int
    head_dim: int
    block: int

    KIND: ClassVar[str] = "lightning"
    NAMES: ClassVar[tuple[str, ...]] = LIGHTNING_NAMES

    def names(self) -> list[str]:
        return [*LIGHTNING_NAMES, *LIGHTNING_BUFFERS]

    def shapes(self, H: int) -> Shapes:
        n, D, C = self.heads, self.head_dim, self.block
        return {
            "light_qkv": (3 * n * D, H),
            "light_gate": (n * D, H),
            "light_norm": (n * D,),
            "light_out": (H, n * D),
            "light_slope": (n, 1, 1),
            "light_qdecay": (n, C, 1),
            "light_kdecay": (n, C, 1),
            "light_ddecay": (1, n, C, C),
        }


@dataclass(frozen=True)
class ShortConv(_Mixer):
    """LFM2's short causal convolution (``replay.shortconv``)."""

    kernel: int
    bias: bool = False

    KIND: ClassVar[str] = "shortconv"
    NAMES: ClassVar[tuple[str, ...]] = SHORT_CONV_NAMES

    def names(self) -> list[str]:
        return ["conv_in", "conv_w", "conv_out"] + (["conv_in_bias", "conv_bias", "conv_out_bias"] if self.bias else [])

    def shapes(self, H: int) -> Shapes:
        return {
            "conv_in": (3 * H, H),
            "conv_in_bias": (3 * H,),
            "conv_w": (H, 1, self.kernel),
            "conv_bias": (H,),
            "conv_out": (H, H),
            "conv_out_bias": (H,),
        }


@dataclass(frozen=True)
class MoA(_Mixer):
    """JetMoE's mixture of attention heads (``replay.moa``): top-``top_k`` of ``experts`` attention
    experts, each with its q and o projection, over one shared kv projection of ``kv_heads``
    heads of ``head_dim``."""

    experts: int
    top_k: int
    kv_heads: int
    head_dim: int

    KIND: ClassVar[str] = "moa"
    NAMES: ClassVar[tuple[str, ...]] = MOA_NAMES
    SHARDED: ClassVar[str | None] = "mixture of attention heads and the bias on its MoE output"

    def shapes(self, H: int) -> Shapes:
        E, X = self.experts, self.kv_heads * self.head_dim
        return {"moa_router": (E, H), "moa_q": (E, X, H), "moa_o": (E, H, X), "moa_bias": (H,), "kv": (2 * X, H)}
