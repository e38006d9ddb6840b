"""gpt-oss (``gpt_oss``): attention with a learned sink logit per head in every softmax,
alternating sliding-window (``layer_types``) and full attention, q/k/v/o biases, YaRN RoPE; a
biased router (top-k of W_r y + b, softmax over those k: the renormalised top-k of the full
softmax); experts with biases and a clamped GLU, (clamp(u, ±limit) + 1) ⊙ g σ(α g) with
g = min(gate, limit), stored fused as ``gate_up_proj`` [E, H, 2I] whose gate and up columns
alternate and ``down_proj`` [E, I, H]. No shared expert, every layer routed.

Weights quantised to MXFP4 (the released checkpoints' ``*_blocks``/``*_scales``) are read
through :mod:`moeaudit.checkpoint.mxfp4`.
"""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, all_layers, attention_by_layer
from moeaudit.spec.config import ClampedGLU
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant
from moeaudit.spec.torchtitan import HF_LAYER, TT_LAYER, Rules

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig when config.json names no RoPE scaling
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _with_defaults(cfg: dict[str, Any], _path: Any) -> dict[str, Any]:
    """The config as ``GptOssConfig`` completes it: YaRN RoPE unless one is given."""
    if cfg.get("rope_parameters") or cfg.get("rope_scaling"):
        return cfg
    return {**cfg, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": cfg.get("rope_theta", 150000.0)}}


def _sliding_layers(c: Ctx) -> tuple[int, ...]:
    """``layer_types`` (sliding on even layers when absent, as ``GptOssConfig`` fills it in)."""
    types = c.cfg.get("layer_types")
    if types is None:
        return tuple(i for i in range(c.num_layers) if (i + 1) % 2)
    if not isinstance(types, list) or len(types) != c.num_layers or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(
            f"config.json: layer_types must list {c.num_layers} of {' / '.join(LAYER_TYPES)}", path=c.path
        )
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _positive(c: Ctx, key: str, default: float) -> float:
    value = c.get(key, float, default)
    if not value > 0:
        raise CheckpointError(f"config.json: {key} must be positive, got {value!r}", path=c.path)
    return float(value)


def _fields(c: Ctx) -> dict[str, Any]:
    window = c.cfg.get("sliding_window", 128)  # null: every layer attends fully
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(
            f"config.json: sliding_window must be a positive integer or null, got {window!r}", path=c.path
        )
    sliding = _sliding_layers(c)
    if sliding and window is None:  # transformers cannot build such a model either
        raise CheckpointError("config.json: layer_types name sliding layers but sliding_window is null", path=c.path)
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": True,
        "attention_bias": bool(c.get("attention_bias", bool, True)),
        **attention_by_layer([AttentionVariant(window=window if i in sliding else None) for i in range(c.num_layers)]),
        "attention_sinks": True,
        "router_logit_bias": True,
        "clamped_glu": ClampedGLU(alpha=_positive(c, "swiglu_alpha", 1.702), limit=_positive(c, "swiglu_limit", 7.0)),
    }


# torchtitan's gpt-oss (its state_dict_adapter's from_hf_map; the newer parameter names carry a
# shape suffix): sinks, the biased router, and GroupedExperts mlp1 [E, 2I, H] (gate and up rows
# interleaved, out × in) and mlp2 [E, H, I] with their biases. A load-balancing ``expert_bias``
# has no place in transformers' gpt-oss: it stays unmapped and is reported as ignored.
TORCHTITAN: Rules = (
    (TT_LAYER + r"attention\.sinks", HF_LAYER + "self_attn.sinks"),
    (TT_LAYER + r"moe\.router\.gate\.weight", HF_LAYER + "mlp.router.weight"),
    (TT_LAYER + r"moe\.router\.gate\.bias", HF_LAYER + "mlp.router.bias"),
    (TT_LAYER + r"moe\.experts\.mlp1_weight(?:_EGD)?", HF_LAYER + "mlp.experts.mlp1_weight"),
    (TT_LAYER + r"moe\.experts\.mlp1_bias(?:_EG)?", HF_LAYER + "mlp.experts.gate_up_proj_bias"),
    (TT_LAYER + r"moe\.experts\.mlp2_weight(?:_EDF)?", HF_LAYER + "mlp.experts.mlp2_weight"),
    (TT_LAYER + r"moe\.experts\.mlp2_bias(?:_ED)?", HF_LAYER + "mlp.experts.down_proj_bias"),
    (TT_LAYER + r"moe\.expert_bias(?:_E)?", HF_LAYER + "mlp.router.expert_bias"),
)

LAYOUT = Layout(
    family="gpt_oss",
    globals=GLOBALS,
    layer=prefixed(
        L, {**ATTN, "sinks": "self_attn.sinks", "router": "mlp.router.weight", "router_logit_bias": "mlp.router.bias"}
    ),
    expert={},
    fused=prefixed(
        L,
        {
            "gate_up": ("mlp.experts.gate_up_proj", "mlp.experts.mlp1_weight"),
            "gate_up_bias": "mlp.experts.gate_up_proj_bias",
            "down": ("mlp.experts.down_proj", "mlp.experts.mlp2_weight"),
            "down_bias": "mlp.experts.down_proj_bias",
        },
    ),
    fused_format="interleaved",
    fused_formats={L + "mlp.experts.mlp1_weight": "interleaved_rows"},
    notes="attention sinks, alternating sliding windows, biased router, biased clamped-GLU experts "
    "stored [E, H, 2I] with gate/up columns interleaved",
)

FAMILY = Family(
    name="gpt_oss",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts", "num_experts"),
    expert_dim_key="intermediate_size",
    default_rms_eps=1e-5,
    default_rope_theta=150000.0,
    decoder_config=_with_defaults,
    torchtitan=TORCHTITAN,
)
