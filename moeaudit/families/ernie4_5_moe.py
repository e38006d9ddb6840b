"""ERNIE 4.5 MoE (``ernie4_5_moe``): softmax router whose top-k is chosen on the probabilities
plus a selection-only bias (``moe_statics.e_score_correction_bias``, stored [1, E]), combine
weights the chosen probabilities renormalised; ungated shared experts; MoE layers every
``moe_layer_interval`` from ``moe_layer_start_index`` to ``moe_layer_end_index``; RoPE on
adjacent pairs (transformers' interleaved ``rotate_half``); tied embeddings by default; the
renormalising denominator clamped at ``moe_norm_min``. ``use_bias`` (biases on every linear layer
and the LM head) is refused: the released models do not use it. The released checkpoints' MTP
module (``model.mtp_block.*``, ``model.mtp_emb_norm.*``, ``model.mtp_hidden_norm.*``,
``model.mtp_linear_proj.*``; transformers ignores every key containing "mtp") is left out."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, Refuse
from moeaudit.spec.config import Gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, SHARED_EXPERTS, hf_layout


def _routed_layers(c: Ctx) -> tuple[int, ...]:
    start = c.get("moe_layer_start_index", int, 1)
    end = c.cfg.get("moe_layer_end_index", -1)
    if end is None or end == -1:  # Ernie4_5_MoeConfig.__post_init__
        end = c.num_layers - 1
    if isinstance(end, bool) or not isinstance(end, int) or end < 0:
        raise CheckpointError(f"config.json: 'moe_layer_end_index' must be an int ≥ -1, got {end!r}", path=c.path)
    step = c.get("moe_layer_interval", int, 1)
    if step < 1:
        raise CheckpointError(f"config.json: moe_layer_interval must be ≥ 1, got {step}", path=c.path)
    return tuple(i for i in range(c.num_layers) if (i + 1) % step == 0 and start <= i <= end)


def _norm_min(c: Ctx) -> float:
    value = c.get("moe_norm_min", float, 1e-12)
    if value < 0:
        raise CheckpointError(f"config.json: moe_norm_min must be ≥ 0, got {value!r}", path=c.path)
    return float(value)


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": _routed_layers(c),
        "norm_topk_prob": True,
        "attention_bias": False,
        "tie_embeddings": bool(c.get("tie_word_embeddings", bool, True)),
        "dense_dim": c.get("intermediate_size", int, 0),
        "shared_dim": c.get("moe_num_shared_experts", int, 0) * c.get("moe_intermediate_size", int),
        "gate": Gate(scoring="softmax", selection_bias=True),
        "rope_interleaved": True,
        "renorm_min": _norm_min(c),
    }


LAYOUT = hf_layout(
    "ernie4_5_moe",
    {
        **ATTN,
        **MLP_MOE,
        # transformers' save_pretrained name, its module path, the original release's name
        "router_bias": (
            "mlp.moe_statics.e_score_correction_bias",
            "mlp.gate.moe_statics.e_score_correction_bias",
            "mlp.moe_statistic.e_score_correction_bias",
        ),
        **SHARED_EXPERTS,
        **DENSE_MLP,
    },
    notes="softmax router with a selection bias; shared experts; interval MoE layers; interleaved RoPE; "
    "MTP module left out",
    left_out={
        prefix: "multi-token-prediction module model.mtp_*"
        for prefix in ("model.mtp_block.", "model.mtp_emb_norm.", "model.mtp_hidden_norm.", "model.mtp_linear_proj.")
    },
)

FAMILY = Family(
    name="ernie4_5_moe",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("moe_num_experts", "num_experts"),
    top_k_key="moe_k",
    default_rms_eps=1e-5,
    refuse=(Refuse("use_bias", (False,), "biases on the attention, MLPs, experts and LM head"),),
)
