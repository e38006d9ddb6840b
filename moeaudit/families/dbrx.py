"""DBRX (``dbrx``): a pre-norm decoder with bias-free LayerNorms (``norm_1``, ``norm_2``, ``norm_f``),
grouped-query attention from one fused ``Wqkv`` (canonical ``qkv``) clamped to
±``clip_qkv``, rotate-half RoPE; every layer routed: softmax over the experts, top-k, the chosen
weights divided by their p-norm (``moe_normalize_expert_weights``: 1 renormalises, null keeps
them); SwiGLU experts stored flat as ``w1``, ``v1``, ``w2`` [E·I, H] (``w2`` holds each expert's
down projection transposed). The config nests the attention and FFN settings (``attn_config``,
``ffn_config``); :func:`flat_config` reads them into the common keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, all_layers
from moeaudit.spec.layouts import Layout, prefixed


def _section(cfg: dict[str, Any], key: str, path: Path | str) -> dict[str, Any]:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"config.json: {key} must be an object, got {value!r}", path=path)
    return value


def flat_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """DbrxConfig's nested keys as the common ones (DbrxConfig's defaults where absent).

    RoPE θ: transformers 5.24 reads the top-level ``rope_parameters`` (default 1e4) and ignores
    ``attn_config.rope_theta``, which DBRX's own code and the released configs use (5e5). Where
    only one is given, it is used; where both are given and differ, the checkpoint is refused
    (docs/decisions.md)."""
    attn, ffn = _section(cfg, "attn_config", path), _section(cfg, "ffn_config", path)
    out = {k: v for k, v in cfg.items() if k not in ("attn_config", "ffn_config")}
    act = ffn.get("ffn_act_fn") or {"name": "silu"}
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    top = (params.get("rope_theta") if isinstance(params, dict) else None) or cfg.get("rope_theta")
    theta = attn.get("rope_theta")
    if top is not None and theta is not None and float(top) != float(theta):
        raise CheckpointError(
            f"config.json: attn_config.rope_theta {theta} and rope_parameters' rope_theta "
            f"{top} differ: which one the model was trained with is ambiguous",
            path=path,
            hint="keep one of them (transformers 5.24 reads rope_parameters, DBRX's own code attn_config.rope_theta)",
        )
    out.update(
        hidden_size=cfg.get("d_model", 2048),
        num_attention_heads=cfg.get("n_heads", 16),
        num_hidden_layers=cfg.get("n_layers", 24),
        num_key_value_heads=attn.get("kv_n_heads", 1),
        clip_qkv=attn.get("clip_qkv"),
        num_experts=ffn.get("moe_num_experts", 4),
        num_experts_per_tok=ffn.get("moe_top_k", 1),
        moe_intermediate_size=ffn.get("ffn_hidden_size", 3584),
        moe_normalize_expert_weights=ffn.get("moe_normalize_expert_weights", 1.0),
        hidden_act=act.get("name", "silu") if isinstance(act, dict) else act,
    )
    if top is None and theta is not None:
        out["rope_theta"] = theta
    return out


def _fields(c: Ctx) -> dict[str, Any]:
    p = c.cfg.get("moe_normalize_expert_weights")
    if p not in (None, 1, 1.0) or isinstance(p, bool):
        raise CheckpointError(
            f"moeaudit does not replay moe_normalize_expert_weights={p!r} for dbrx yet "
            "(the chosen weights divided by their p-norm)",
            path=c.path,
            hint="a limit of moeaudit, not a fault of the checkpoint: it replays 1 "
            "(renormalised, DBRX's default) and null (not normalised)",
        )
    clip = c.get("clip_qkv", float, None)
    if clip is not None and not clip > 0:
        raise CheckpointError(f"config.json: clip_qkv must be positive or null, got {clip!r}", path=c.path)
    return {
        "routed_layers": all_layers(c),
        "norm_topk_prob": p is not None,
        "clip_qkv": clip,
        "layer_norm": True,
        "norm_bias": False,
        "rms_eps": 1e-5,  # nn.LayerNorm's default eps: DBRX's norms are built without one
        "tie_embeddings": False,  # DbrxConfig refuses tie_word_embeddings
    }


B = "transformer.blocks.{layer}."

LAYOUT = Layout(
    family="dbrx",
    globals={
        "embed": ("transformer.wte.weight",),
        "final_norm": ("transformer.norm_f.weight",),
        "lm_head": ("lm_head.weight",),
    },
    layer=prefixed(
        B,
        {
            "input_norm": "norm_attn_norm.norm_1.weight",
            "post_norm": "norm_attn_norm.norm_2.weight",
            "qkv": "norm_attn_norm.attn.Wqkv.weight",
            "o": "norm_attn_norm.attn.out_proj.weight",
            "router": "ffn.router.layer.weight",
        },
    ),
    expert={},
    # "gate_up" holds the gate projections only here (w1), "up" the up projections (v1)
    fused=prefixed(B, {"gate_up": "ffn.experts.mlp.w1", "up": "ffn.experts.mlp.v1", "down": "ffn.experts.mlp.w2"}),
    fused_format="flat",
    notes="bias-free LayerNorms; fused Wqkv clamped by clip_qkv; softmax top-k renormalised; experts "
    "stored flat [E·I, H]",
)

FAMILY = Family(
    name="dbrx",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("num_experts",),
    decoder_config=flat_config,
    default_rms_eps=1e-5,
)
