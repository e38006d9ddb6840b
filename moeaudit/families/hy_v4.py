"""HY-V4 (``hy_v4``, Hunyuan V4): hyper-connections around a DeepSeek-V3.2-style decoder.

The residual stream is ``hc_mult`` streams (``ModelSpec.hc``, a ``HyperConnection``): each layer's attention and its
MLP / MoE block read a mix of them formed by their own hyper-connection (``attn_hc``, ``ffn_hc``)
and add their output back onto every stream with per-token weights; a head (``model.hc_head``)
mixes the streams into one before the final norm. Attention: MLA with a query latent and
rotate-half RoPE (no interleave), a sigmoid output gate per channel (``self_attn.gate_proj``),
a learned sink logit per head, and DeepSeek Sparse Attention whose indexer rotates the last
qk_rope dims of its heads and norms its key with ``rms_norm_eps``; ``indexer_types`` "shared"
layers reuse the previous layer's key selection (replayed for windows of at most ``index_topk``
tokens, where every causal key is kept: ``engine.check_shared_index``). The router: float32
σ(W_r y), top-k on σ + ``e_score_correction_bias`` (groups as DeepSeek-V3, one by default),
renormalised (+1e-20), × ``routed_scaling_factor``; ungated shared experts; the routed experts'
SwiGLU clamped at ``swiglu_limit`` (gate ≤ limit, |up| ≤ limit); ``mlp_layer_types`` (default: the
first layer dense). MTP layers (``model.mtp_layers``) are left out, as transformers does."""

from __future__ import annotations

import dataclasses
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import deepseek_v32
from moeaudit.families.base import Ctx, Family, attention_by_layer, parse_mla, v3_gate
from moeaudit.spec.config import MLA, ClampedGLU, SparseIndex
from moeaudit.spec.layouts import DEEPSEEK_LAYER, GLOBALS, MLP_EXPERTS, MLP_FUSED, L, Layout, prefixed
from moeaudit.spec.settings import AttentionVariant


def _mla(c: Ctx) -> MLA:
    """MLA as ``HYV4Attention`` builds it: rotate-half RoPE whatever ``rope_interleave`` says
    (the class reads no such key), and a query latent, which the indexer reads."""
    mla = dataclasses.replace(parse_mla(c), rope_interleave=False)
    if mla.q_lora_rank < 1:
        raise CheckpointError(
            "config.json: HY-V4 needs q_lora_rank ≥ 1 (its sparse-attention indexer reads the query latent)",
            path=c.path,
        )
    return mla


def _layer_list(c: Ctx, key: str, kinds: tuple[str, ...], default: list[str]) -> list[str]:
    value = c.cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, list) or len(value) != c.num_layers or not set(value) <= set(kinds):
        allowed = " or ".join(repr(k) for k in kinds)
        raise CheckpointError(f"config.json: {key} must list {c.num_layers} layers, each {allowed}", path=c.path)
    return value


def _fields(c: Ctx) -> dict[str, Any]:
    n = c.num_layers
    mlp = _layer_list(c, "mlp_layer_types", ("dense", "sparse"), ["dense"] * min(1, n) + ["sparse"] * max(n - 1, 0))
    other = sorted({t for t in c.cfg.get("layer_types") or [] if t != "indexed_attention"}, key=str)
    if other:
        raise CheckpointError(
            f"moeaudit does not replay layer_types {other!r} for hy_v4 (it replays indexed_attention)",
            path=c.path,
            hint="a limit of moeaudit, not a fault of the checkpoint",
        )
    pattern = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(n)]
    indexers = _layer_list(c, "indexer_types", ("full", "shared"), pattern)
    if indexers and indexers[0] != "full":
        raise CheckpointError("config.json: the first layer's indexer_types must be 'full'", path=c.path)
    hc = c.get("hc_mult", int, 4)
    if not 1 <= hc <= 64:
        raise CheckpointError(f"config.json: hc_mult must be in 1..64, got {hc}", path=c.path)
    limit = c.get("swiglu_limit", float, 10.0)
    if limit <= 0:  # the docstring says "disables the clamp", the code clamps at it: ambiguous
        raise CheckpointError(
            f"config.json: swiglu_limit={limit:g} is ambiguous (transformers documents ≤ 0 as no clamp, "
            "and clamps at it); moeaudit does not replay it",
            path=c.path,
            hint="give the positive limit the model was trained with",
        )
    assert c.mla is not None
    index = SparseIndex(
        topk=c.get("index_topk", int, 2048),
        n_heads=c.get("index_n_heads", int, 16),
        head_dim=c.get("index_head_dim", int, 128),
    )
    if index.topk < 1 or index.n_heads < 1 or index.head_dim < c.mla.qk_rope_dim:
        raise CheckpointError(
            "config.json: the DSA indexer needs index_topk ≥ 1, index_n_heads ≥ 1 "
            f"and index_head_dim ≥ qk_rope_head_dim ({c.mla.qk_rope_dim})",
            path=c.path,
        )
    return {
        "routed_layers": tuple(i for i, t in enumerate(mlp) if t == "sparse"),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "dense_dim": c.get("intermediate_size", int, 6912),
        "shared_dim": c.get("n_shared_experts", int, 1) * c.get("moe_intermediate_size", int),
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=2.827),
        "shared_gated": False,
        "attention_bias": bool(c.get("attention_bias", bool, False)),
        "attention_sinks": True,
        "output_gate": "sigmoid",
        "clamped_glu": ClampedGLU(alpha=1.0, limit=limit, offset=0.0),
        "sparse_index": index,
        "index_rope_last": True,
        "index_norm_eps": c.get("rms_norm_eps", float, 1e-5),
        **attention_by_layer([AttentionVariant(shared_index=t == "shared") for t in indexers]),
        "hc_mult": hc,
        "hc_magnitude": c.get("hc_magnitude", float, 2.0),
        "hc_eps": c.get("hc_eps", float, 1e-6),
    }


# Each tensor under the name the checkpoints are written with (transformers' save_pretrained
# reverts its ``hy_v4`` conversion mapping: ``hc_pre.hc_attn_layer.hc_fn``, ``linear_gate``,
# ``learnable_sink_param``), then the name of transformers' module
_HC = {
    f"{block}_hc_{n}": (f"hc_pre.hc_{stored}_layer.hc_{n}", f"{block}_hc.{n}")
    for block, stored in (("attn", "attn"), ("ffn", "mlp"))
    for n in ("fn", "base", "scale")
}
_GATES = {
    "g_proj": ("self_attn.linear_gate.weight", "self_attn.gate_proj.weight"),
    "sinks": ("self_attn.learnable_sink_param", "self_attn.sinks"),
    "shared_w1": ("mlp.shared_experts.linear_gate.weight", "mlp.shared_experts.gate_proj.weight"),
    "mlp_w1": ("mlp.linear_gate.weight", "mlp.gate_proj.weight"),
}

LAYOUT = Layout(
    family="hy_v4",
    globals={
        **GLOBALS,
        **{
            f"hc_head_{n}": (f"model.hc_pre.hc_head.hc_head_{n}", f"model.hc_head.hc_{n}")
            for n in ("fn", "base", "scale")
        },
    },
    layer=prefixed(L, {**DEEPSEEK_LAYER, **deepseek_v32.INDEXER, **_GATES, **_HC}),
    expert=prefixed(L, MLP_EXPERTS),
    fused=prefixed(L, MLP_FUSED),
    notes="hyper-connections (hc_mult residual streams, mixed before each sub-block and by a head before the "
    "final norm); MLA with a sigmoid output gate, attention sinks and DSA (indexer RoPE on its last dims); "
    "sigmoid router with a selection bias, renormalised and scaled; shared experts; clamped SwiGLU experts; "
    "MTP layers left out",
    left_out={"model.mtp_layers.": "multi-token-prediction layers"},
)

FAMILY = Family(
    name="hy_v4",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    mla=_mla,
    default_rms_eps=1e-5,
)
