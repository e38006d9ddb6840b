"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2 (MLA with a query latent, DeepSeek Sparse Attention,
sigmoid + selection-bias routing, shared experts, dense first layers) as transformers' GLM-5
builds it. Two differences: the DSA indexer rotates adjacent pairs, as the MLA does
(``LayerSettings.index_rope_interleave``), and ``indexer_types`` lets a layer reuse the previous
layer's key selection ("shared"). The replay runs every layer's own indexer ("full", the
default pattern); a checkpoint with a "shared" layer is refused, because the streaming replay
recomputes each layer from its input alone. Defaults: one expert group, 32 indexer heads,
``mlp_layer_types`` (else ``first_k_dense_replace`` 3) for the dense layers."""

from __future__ import annotations

import dataclasses
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families import deepseek_v3, deepseek_v32
from moeaudit.families.base import Ctx, Family, mtp_count, v3_gate
from moeaudit.spec.config import SparseIndex


def indexer_types(c: Ctx) -> list[object]:
    """``indexer_types``, else the pattern ``GlmMoeDsaConfig`` derives (``index_topk_pattern``
    of F/S letters, or ``index_topk_freq`` / ``index_skip_topk_offset``)."""
    types = c.cfg.get("indexer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != c.num_layers:
            raise CheckpointError(f"config.json: indexer_types must list {c.num_layers} layers", path=c.path)
        return types
    pattern = c.cfg.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        return [letters.get(ch, ch) for ch in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(c.get("index_topk_freq", int, 1), 1)
    offset = c.get("index_skip_topk_offset", int, 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(c.num_layers)]


def _check_indexers(c: Ctx) -> None:
    types = indexer_types(c)
    shared = [i for i, t in enumerate(types) if t != "full"]
    if shared:
        raise CheckpointError(
            f"moeaudit does not replay glm_moe_dsa indexer_types other than 'full' yet "
            f"(layers {shared[:5]} reuse another layer's DSA key selection)",
            path=c.path,
            hint="a limit of moeaudit, not a fault of the checkpoint: the streaming replay "
            "recomputes each layer from its own input",
        )


def _fields(c: Ctx) -> dict[str, Any]:
    _check_indexers(c)
    fields = deepseek_v32.FAMILY.fields(c)
    index = fields["sparse_index"]
    return {
        **fields,
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=2.5),
        "sparse_index": SparseIndex(topk=index.topk, n_heads=c.get("index_n_heads", int, 32), head_dim=index.head_dim),
        "index_rope_interleave": True,
        "mtp_layers": mtp_count(c, 1),
    }


FAMILY = Family(
    name="glm_moe_dsa",
    layout=dataclasses.replace(deepseek_v32.LAYOUT, family="glm_moe_dsa"),
    fields=_fields,
    expert_count_keys=deepseek_v3.FAMILY.expert_count_keys,
    mla=deepseek_v32.FAMILY.mla,
    default_rms_eps=1e-5,
    refuse=deepseek_v3.REFUSE,
)
