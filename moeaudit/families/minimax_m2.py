"""MiniMax-M2 (``minimax_m2``): q/k RMSNorm over all heads before the head split (OLMoE's
"full" norm), partial rotary (rotate-half on the first ``rotary_dim`` of each head), a sigmoid
router whose top-k is chosen on σ(W_r y) + ``e_score_correction_bias`` (a buffer of the MoE
block, not of the gate) and whose chosen σ are renormalised; no shared expert, every layer
routed, no sliding window."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, Refuse, all_layers, head_dim, partial_rotary_dim
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, GLOBALS, L, Layout, prefixed


def _rotary_factor(c: Ctx, head_dim: int) -> float:
    """``rope_parameters.partial_rotary_factor`` (v5), else the released checkpoints' legacy
    top-level ``rotary_dim`` / head_dim (``MiniMaxM2Config.convert_rope_params_to_dict``), else 1."""
    params = c.cfg.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None and c.cfg.get("rotary_dim") is not None:
        value = c.get("rotary_dim", int) / head_dim
    if value is None:
        value = c.cfg.get("partial_rotary_factor", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {value!r}", path=c.path)
    return float(value)


def _attention_kinds(c: Ctx) -> None:
    """The released config's ``attn_type_list`` (1: softmax attention per layer; 0 would be
    MiniMax-Text-01's lightning linear attention, which the replay does not implement)."""
    kinds = c.cfg.get("attn_type_list")
    if kinds is None:
        return
    if not isinstance(kinds, list) or any(isinstance(k, bool) or not isinstance(k, int) for k in kinds):
        raise CheckpointError("config.json: attn_type_list must be a list of integers", path=c.path)
    other = [i for i, k in enumerate(kinds[: c.num_layers]) if k != 1]
    if other:
        raise CheckpointError(
            f"moeaudit does not replay attn_type_list values other than 1 for minimax_m2 yet "
            f"(layers {other[:5]}: lightning linear attention)",
            path=c.path,
            hint="a limit of moeaudit, not a fault of the checkpoint",
        )


def _fields(c: Ctx) -> dict[str, Any]:
    _attention_kinds(c)
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": True,
        "attention_bias": False,
        "qk_norm": "full",
        "rotary_dim": partial_rotary_dim(c, head_dim(c), _rotary_factor(c, head_dim(c))),
        "gate": Gate(scoring="sigmoid", selection_bias=True),
    }


# The released checkpoints (and transformers' save_pretrained) use Mixtral's v4 names,
# ``block_sparse_moe`` with w1/w3/w2 experts; v5 module names are accepted too.
LAYOUT = Layout(
    family="minimax_m2",
    globals=GLOBALS,
    layer=prefixed(
        L,
        {
            **ATTN,
            "router": ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
            "router_bias": ("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias"),
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
    notes="q/k norm over all heads, partial rotary; sigmoid router with a selection bias",
)

# keys of the released config.json (MiniMax's own code reads them; transformers' class builds the
# released values): replayed at those values only
REFUSE = (
    Refuse("scoring_func", ("sigmoid",), "the router's scoring function"),
    Refuse("use_routing_bias", (True,), "the router's selection bias"),
    Refuse("use_qk_norm", (True,), "the q/k RMSNorm"),
    Refuse("qk_norm_type", ("per_layer",), "q/k RMSNorm over all heads"),
)

FAMILY = Family(
    name="minimax_m2",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_local_experts", "num_experts"),
    expert_dim_key="intermediate_size",
    default_rope_theta=5e6,
    refuse=REFUSE,
)
