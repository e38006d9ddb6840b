"""MiniMax-01 (``minimax``, MiniMax-Text-01): Mixtral's MoE (softmax top-k renormalised, no shared
expert, every layer routed) under a hybrid token mixer. ``layer_types`` (default: even layers
full attention, odd ones lightning attention) picks per layer: Mixtral's softmax attention
(GQA, full rotary, θ default 1e6, ``sliding_window`` on every full layer when set) or
lightning attention, a per-head exponentially decayed linear attention computed in blocks of
``block_size`` tokens (:mod:`moeaudit.replay.lightning`). Residuals are DeepNorm's: each
sub-block adds to its *normed* input, out = α·norm(x) + β·f(norm(x)), with (α, β) from
``full_attn_*``, ``linear_attn_*`` and ``mlp_*_factor`` (``LayerSettings.residual_scales``). The
checkpoints use Mixtral's v4 names (``block_sparse_moe``, experts w1/w3/w2) and store the
lightning layers' slope and decay tables as buffers, which the replay reads and uses as
transformers does. Not to be confused with ``minimax_m2``."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, all_layers, attention_by_layer, mixing, sliding_window
from moeaudit.spec.blocks import Layer, Lightning
from moeaudit.spec.config import ModelSpec
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant

KINDS = ("full_attention", "linear_attention")


def _layer_types(c: Ctx) -> list[str]:
    types = c.cfg.get("layer_types")
    if types is None:  # MiniMaxConfig's default
        return [KINDS[i % 2] for i in range(c.num_layers)]
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= set(KINDS):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} layers, each 'full_attention' or 'linear_attention'",
            path=c.path,
        )
    return types


def _full_rotary(c: Ctx) -> None:
    params = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is not None and value != 1:
        raise CheckpointError(
            f"moeaudit does not replay partial_rotary_factor={value!r} for minimax "
            "(transformers' MiniMax rotates the whole head)",
            path=c.path,
            hint="a limit of moeaudit, not a fault of the checkpoint: it replays 1.0",
        )


def _residual_scales(c: Ctx) -> tuple[tuple[float, float], ...]:
    pairs = []
    for kind in ("full_attn", "linear_attn", "mlp"):
        pair = (c.get(f"{kind}_alpha_factor", float, 1.0), c.get(f"{kind}_beta_factor", float, 1.0))
        pairs.append(pair)
    return tuple(pairs)


def _fields(c: Ctx) -> dict[str, Any]:
    _full_rotary(c)
    types = _layer_types(c)
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    block = c.get("block_size", int, 256)
    if block < 1:
        raise CheckpointError(f"config.json: block_size must be ≥ 1, got {block}", path=c.path)
    window = sliding_window(c)
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": True,
        "attention_bias": False,
        **attention_by_layer([AttentionVariant(window=window if i in full else None) for i in range(c.num_layers)]),
        "lightning_block": block,
        "residual_scales": _residual_scales(c),
    }


def _layers(c: Ctx, s: ModelSpec) -> tuple[Layer, ...]:
    """Lightning attention on the ``linear_attention`` layers, softmax attention (windowed where
    ``sliding_window`` is set) on the ``full_attention`` ones."""
    return mixing(
        s, _layer_types(c), "linear_attention", Lightning(s.num_heads, s.head_dim, s.settings.lightning_block)
    )


LAYOUT = Layout(
    family="minimax",
    globals=GLOBALS,
    layer=prefixed(
        L,
        {
            **ATTN,
            "light_qkv": "self_attn.qkv_proj.weight",
            "light_gate": "self_attn.output_gate.weight",
            "light_norm": "self_attn.norm.weight",
            "light_out": "self_attn.out_proj.weight",
            "light_slope": "self_attn.slope_rate",
            "light_qdecay": "self_attn.query_decay",
            "light_kdecay": "self_attn.key_decay",
            "light_ddecay": "self_attn.diagonal_decay",
            "router": ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
        },
    ),
    expert=prefixed(
        L,
        {
            "w1": ("block_sparse_moe.experts.{expert}.w1.weight", "mlp.experts.{expert}.gate_proj.weight"),
            "w3": ("block_sparse_moe.experts.{expert}.w3.weight", "mlp.experts.{expert}.up_proj.weight"),
            "w2": ("block_sparse_moe.experts.{expert}.w2.weight", "mlp.experts.{expert}.down_proj.weight"),
        },
    ),
    fused=prefixed(
        L,
        {
            "gate_up": ("mlp.experts.gate_up_proj", "block_sparse_moe.experts.gate_up_proj"),
            "down": ("mlp.experts.down_proj", "block_sparse_moe.experts.down_proj"),
        },
    ),
    notes="Mixtral's MoE; full softmax attention or lightning (decayed linear) attention per layer_types; "
    "DeepNorm residuals (α·norm(x) + β·f(norm(x)))",
)

FAMILY = Family(
    name="minimax",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts", "num_experts"),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-5,
    default_rope_theta=1e6,
    layers=_layers,
)
