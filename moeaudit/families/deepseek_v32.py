"""DeepSeek-V3.2: DeepSeek-V3 (MLA, sigmoid + selection-bias group-limited routing, shared
experts, dense first layers, MTP left out) plus DeepSeek Sparse Attention: a lightning indexer
per layer picks the ``index_topk`` causal keys each query attends to
(:mod:`moeaudit.replay.dsa`). Its MLA always rotates interleaved pairs and always has a query
latent (the indexer reads it)."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import deepseek_v3
from moeaudit.families.base import Ctx, Family, parse_mla
from moeaudit.spec.config import MLA, SparseIndex
from moeaudit.spec.layouts import DEEPSEEK_LAYER, hf_layout


def _mla(c: Ctx) -> MLA:
    mla = parse_mla(c, always_interleave=True)  # the V3.2 config has no rope_interleave
    if mla.q_lora_rank < 1:
        raise CheckpointError(
            "config.json: DeepSeek-V3.2 needs q_lora_rank ≥ 1 (its sparse-attention indexer reads the query latent)",
            path=c.path,
        )
    return mla


def _sparse_index(c: Ctx) -> SparseIndex:
    index = SparseIndex(
        topk=c.get("index_topk", int, 2048),
        n_heads=c.get("index_n_heads", int, 64),
        head_dim=c.get("index_head_dim", int, 128),
    )
    assert c.mla is not None
    if index.topk < 1 or index.n_heads < 1 or index.head_dim < c.mla.qk_rope_dim:
        raise CheckpointError(
            "config.json: the DSA indexer needs index_topk ≥ 1, index_n_heads ≥ 1 "
            f"and index_head_dim ≥ qk_rope_head_dim ({c.mla.qk_rope_dim})",
            path=c.path,
        )
    return index


def _routed_layers(c: Ctx, dense_first: tuple[int, ...]) -> tuple[int, ...]:
    """``mlp_layer_types`` ("dense" / "sparse" per layer, which save_pretrained always writes),
    else the first ``first_k_dense_replace`` layers dense (``DeepseekV32Config``'s rule)."""
    types = c.cfg.get("mlp_layer_types")
    if types is None:
        return dense_first
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= {"dense", "sparse"}:
        raise CheckpointError(
            f"config.json: mlp_layer_types must list {c.num_layers} layers, each 'dense' or 'sparse'", path=c.path
        )
    return tuple(i for i, t in enumerate(types) if t == "sparse")


def _check_layer_types(c: Ctx) -> None:
    """Every layer's attention is DSA (``indexed_attention``); another kind is not replayed."""
    types = c.cfg.get("layer_types")
    if types is None:
        return
    if not isinstance(types, list) or len(types) != c.num_layers:
        raise CheckpointError(f"config.json: layer_types must list {c.num_layers} layers", path=c.path)
    other = sorted({t for t in types if t != "indexed_attention"}, key=str)
    if other:
        raise CheckpointError(
            f"moeaudit does not replay layer_types {other!r} for deepseek_v32 yet (it replays indexed_attention)",
            path=c.path,
            hint="a limit of moeaudit, not a fault of the checkpoint",
        )


def _fields(c: Ctx) -> dict[str, Any]:
    _check_layer_types(c)
    fields = deepseek_v3.FAMILY.fields(c)
    return {**fields, "routed_layers": _routed_layers(c, fields["routed_layers"]), "sparse_index": _sparse_index(c)}


INDEXER = {
    "idx_wq_b": "self_attn.indexer.wq_b.weight",
    "idx_wk": "self_attn.indexer.wk.weight",
    "idx_k_norm": "self_attn.indexer.k_norm.weight",
    "idx_k_norm_bias": "self_attn.indexer.k_norm.bias",
    "idx_weights": "self_attn.indexer.weights_proj.weight",
}

LAYOUT = hf_layout(
    "deepseek_v32",
    {**DEEPSEEK_LAYER, **INDEXER},
    notes="DeepSeek-V3 plus the DSA lightning indexer (each query attends to its index_topk best "
    "causal keys); MTP layers left out",
)

FAMILY = Family(
    name="deepseek_v32",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=deepseek_v3.FAMILY.expert_count_keys,
    mla=_mla,
    refuse=deepseek_v3.REFUSE,
)
