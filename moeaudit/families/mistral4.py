"""Mistral 4 (``mistral4``): DeepSeek-V3's decoder (:mod:`moeaudit.families.deepseek_v3`: MLA with
interleaved RoPE, YaRN with the softmax-scale mscale, shared experts, ``first_k_dense_replace``
dense layers, default 0) with two differences. The router is DeepSeek-V3's grouped top-k on
softmax probabilities instead of biased sigmoid scores (no ``e_score_correction_bias``; a group's
score is the sum of its best two probabilities; default one group), renormalised with the 1e-20
denominator and × ``routed_scaling_factor`` (default 1). And every MLA query is scaled by
1 + β·log(1 + ⌊pos / L⌋) with β = ``rope_parameters.llama_4_scaling_beta`` and L its
``original_max_position_embeddings`` (Llama 4's long-context scaling: 1 below position L). No MTP
layers."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import deepseek_v3
from moeaudit.families.base import Ctx, Family, first_k_dense, grouped_gate, parse_mla, sliding_window, windowed_all
from moeaudit.spec.layouts import Layout


def _query_scale(c: Ctx) -> tuple[float, int]:
    raw = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling")
    params: dict[str, Any] = raw if isinstance(raw, dict) else {}
    beta, length = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    number = (int, float)
    if (
        not isinstance(beta, number)
        or isinstance(beta, bool)
        or not isinstance(length, int)
        or isinstance(length, bool)
        or length < 1
    ):
        raise CheckpointError(
            "config.json: mistral4 needs rope_parameters.llama_4_scaling_beta (a number) and "
            "original_max_position_embeddings (≥ 1): transformers' Mistral4Attention scales "
            "every query by them",
            path=c.path,
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", "linear", "dynamic"):
        raise CheckpointError(
            f"model family 'mistral4' with rope_type {kind!r} cannot be replayed: transformers' "
            "Mistral 4 builds that rotary table over the whole head while it rotates only "
            "qk_rope_head_dim dims of it (it runs with YaRN, as released)",
            path=c.path,
        )
    return float(beta), length


def _rope_freq_dim(c: Ctx) -> int:
    """transformers' rotary width for Mistral 4: ``int(head_dim × partial_rotary_factor)`` with
    head_dim = qk_nope_head_dim + qk_rope_head_dim (the config forces it) and the factor from
    ``rope_parameters`` (default qk_rope_head_dim / head_dim). YaRN computes the frequencies for
    that width — arange(0, dim, 2) of them, ramped over dim // 2 — and the attention applies the
    table to the qk_rope_head_dim rotated dims by broadcasting. 0 when the width is the rotated
    one; refused by name where transformers' own broadcast fails (it cannot run that model)."""
    mla = c.mla
    assert mla is not None
    head = mla.qk_nope_dim + mla.qk_rope_dim
    raw = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling")
    params: dict[str, Any] = raw if isinstance(raw, dict) else {}
    factor = params.get("partial_rotary_factor")  # a top-level one is not read (Mistral4Config)
    if factor is None:
        factor = mla.qk_rope_dim / head  # Mistral4Config.__post_init__'s setdefault
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {factor!r}", path=c.path)
    dim = int(head * factor)
    if dim == mla.qk_rope_dim:
        return 0
    freqs, ramp = len(range(0, dim, 2)), dim // 2
    width = max(freqs, ramp) if 1 in (freqs, ramp) or freqs == ramp else -1  # torch's broadcast
    pairs = mla.qk_rope_dim // 2
    fits = width == pairs or (width == 1 and mla.rope_interleave)
    if width < 1 or not fits:
        raise CheckpointError(
            f"model family 'mistral4' with head_dim × partial_rotary_factor = {head} × {factor} → {dim} "
            f"rotary dims and qk_rope_head_dim {mla.qk_rope_dim} cannot be replayed: transformers' "
            f"Mistral 4 builds a {max(width, 0)}-frequency table it cannot apply to {pairs} rotated pairs "
            "(its forward fails)",
            path=c.path,
        )
    return dim


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        "routed_layers": first_k_dense(c, 0),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "renorm_eps": 1e-20,
        "dense_dim": c.get("intermediate_size", int, 0),
        "shared_dim": c.get("n_shared_experts", int, 1) * c.get("moe_intermediate_size", int),
        "shared_gated": False,
        **windowed_all(c, sliding_window(c)),
        "gate": grouped_gate(
            c,
            scoring="softmax",
            selection_bias=False,
            grouped=True,
            n_group=1,
            topk_group=1,
            group_score="top2sum",
            scaling=1.0,
        ),
        "query_position_scale": _query_scale(c),
        "rope_freq_dim": _rope_freq_dim(c),
    }


_V3 = deepseek_v3.LAYOUT
LAYOUT = Layout(
    family="mistral4",
    globals=_V3.globals,
    layer={k: v for k, v in _V3.layer.items() if k != "router_bias"},
    expert=_V3.expert,
    fused=_V3.fused,
    notes="MLA; softmax group-limited top-k (top-2 sum per group, no selection bias), renormalised, scaled; "
    "shared experts; Llama 4 query scaling by position",
)

FAMILY = Family(
    name="mistral4",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts", "num_experts"),
    mla=parse_mla,
)
