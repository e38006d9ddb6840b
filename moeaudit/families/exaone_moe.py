"""K-EXAONE (``exaone_moe``): EXAONE 4.0's attention (per-head q/k RMSNorm before RoPE, no
biases; with a ``sliding_window`` the ``sliding_attention`` layers are windowed and rotated, the
``full_attention`` layers are global and have no RoPE at all), DeepSeek-V3's router (sigmoid
scores, ``e_score_correction_bias`` for selection only, group-limited top-k on top-2 sums,
renormalised, × ``routed_scaling_factor``), ungated shared experts and ``mlp_layer_types`` (or
``first_k_dense_replace``) dense layers. Multi-token-prediction tensors (``mtp.*``, which
transformers ignores on load) are left out."""

from __future__ import annotations

from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, attention_by_type, sliding_window, v3_gate
from moeaudit.spec.layouts import ATTN, DENSE_MLP, MLP_MOE, SHARED_EXPERTS, hf_layout
from moeaudit.spec.settings import AttentionVariant


def _typed_layers(c: Ctx, key: str, kinds: tuple[str, str], default: list[str]) -> list[str]:
    types = c.cfg.get(key)
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != c.num_layers or not all(t in kinds for t in types):
        raise CheckpointError(
            f"config.json: {key} must list {c.num_layers} layers, each {' or '.join(map(repr, kinds))}", path=c.path
        )
    return types


def _layer_types(c: Ctx, window: int | None) -> list[str]:
    """``layer_types``; without them ``ExaoneMoeConfig.__post_init__``'s rule: every
    ``sliding_window_pattern``-th layer global, the others sliding."""
    if c.cfg.get("layer_types") is None and window is not None:
        pattern = c.cfg.get("sliding_window_pattern", 4)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            # a "LLLG" string or 0: transformers' rule (i + 1) % pattern fails on it too
            raise CheckpointError(
                f"config.json: without layer_types, sliding_window_pattern must be a positive integer, got {pattern!r}",
                path=c.path,
                hint="write layer_types (what save_pretrained writes)",
            )
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(c.num_layers)]
    return _typed_layers(c, "layer_types", ("sliding_attention", "full_attention"), ["full_attention"] * c.num_layers)


def _fields(c: Ctx) -> dict[str, Any]:
    window = sliding_window(c)
    types = _layer_types(c, window)
    dense = c.get("first_k_dense_replace", int, 1)
    mlp = _typed_layers(
        c, "mlp_layer_types", ("dense", "sparse"), ["dense" if i < dense else "sparse" for i in range(c.num_layers)]
    )
    shared = c.get("num_shared_experts", int, 1)
    if shared < 1:  # transformers still builds (and saves) a zero-width shared MLP
        raise CheckpointError(
            "config.json: num_shared_experts must be ≥ 1 for exaone_moe "
            f"(transformers always builds the shared expert), got {shared}",
            path=c.path,
        )
    return {
        "routed_layers": tuple(i for i, t in enumerate(mlp) if t == "sparse"),
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "qk_norm": "head",
        "dense_dim": c.get("intermediate_size", int, 0),
        "shared_dim": shared * c.get("moe_intermediate_size", int),
        "shared_gated": False,
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=2.5),
        # EXAONE 4: with a window, the global layers have no RoPE (ExaoneMoeAttention rotates only
        # when sliding_window is None or the layer slides)
        **attention_by_type(
            types,
            {
                "sliding_attention": AttentionVariant(window=window),
                "full_attention": AttentionVariant(rope=window is None),
            },
        ),
    }


LAYOUT = hf_layout(
    "exaone_moe",
    {
        **ATTN,
        **MLP_MOE,
        # the hub's checkpoints (and save_pretrained) store it on the MoE block
        "router_bias": ("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
        **SHARED_EXPERTS,
        **DENSE_MLP,
    },
    notes="per-head qk norm; sliding layers with RoPE, global layers without; sigmoid router with "
    "selection bias and group-limited top-k; shared experts; mlp_layer_types dense layers",
    left_out={"mtp.": "the multi-token-prediction module (mtp.*)"},
)

FAMILY = Family(
    name="exaone_moe", layout=LAYOUT, fields=_fields, expert_count_keys=("num_experts",), default_rms_eps=1e-5
)
