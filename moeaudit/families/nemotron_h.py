"""NVIDIA Nemotron-H / Nemotron 3 (``nemotron_h``): every layer one block, x + f(norm(x)), its
kind from ``layers_block_type`` (or the legacy ``hybrid_override_pattern``, M E * -): a Mamba-2
mixer ("linear_attention", :mod:`moeaudit.replay.mamba`), GQA attention without RoPE
("full_attention"), a dense MLP ("mlp") or a MoE block ("moe"). The MLPs, the shared expert and
the routed experts are non-gated ReLU², W2 relu(W1 y)² (up/down only); the router is
DeepSeek-V3's (sigmoid scores, ``e_score_correction_bias`` for choosing, group-limited top-k,
renormalised, × ``routed_scaling_factor``); the shared expert reads the same normed input.

transformers' mixer clamps the time step to [``time_step_min``, ∞) and ignores
``time_step_limit``; the replay does as it does. ``moe_latent_size`` (latent projections
around the experts, Nemotron 3 Super) is refused; MTP modules (``mtp.*``) are left out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, Refuse, mtp_count, v3_gate
from moeaudit.families.granitemoehybrid import mamba2
from moeaudit.spec.blocks import Layer, MambaMixer, uniform
from moeaudit.spec.config import ModelSpec, derived_layer
from moeaudit.spec.layouts import Layout
from moeaudit.spec.settings import AttentionVariant

# transformers' block names (and the legacy ones remap_legacy_layer_types accepts) → block kind
KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}
PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# config.json keys transformers' NemotronHConfig renames on reading (legacy → current)
LEGACY_KEYS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
# NemotronHConfig's defaults where the generic reader's fallback differs
DEFAULTS = {"head_dim": 128, "num_key_value_heads": 8, "layer_norm_epsilon": 1e-5}


def _decoder_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """config.json as transformers' ``NemotronHConfig.__post_init__`` reads it: legacy keys
    renamed, the layer list from ``hybrid_override_pattern`` when ``layers_block_type`` is
    absent, the layer count its length (``num_hidden_layers`` is ignored there)."""
    out = {**cfg}
    for old, new in LEGACY_KEYS.items():
        if old in out:
            out[new] = out.pop(old)
    for key, value in DEFAULTS.items():
        if out.get(key) is None:
            out[key] = value
    types = out.get("layers_block_type", out.get("layer_types"))
    if types is None and isinstance(out.get("hybrid_override_pattern"), str):
        pattern = out["hybrid_override_pattern"]
        if not pattern or set(pattern) - set(PATTERN):
            raise CheckpointError(
                f"config.json: hybrid_override_pattern {pattern!r} must be made of M, E, * and -", path=path
            )
        types = [PATTERN[ch] for ch in pattern]
    if types is None:
        types = ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
    if not isinstance(types, list) or not types or not all(isinstance(t, str) and t in KINDS for t in types):
        raise CheckpointError(
            "config.json: layers_block_type must be a non-empty list of 'linear_attention', 'full_attention', "
            f"'mlp' or 'moe', got {types!r}",
            path=path,
        )
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        act = out.get(key, want)
        if act != want:
            raise CheckpointError(
                f"moeaudit does not replay {key}={act!r} for nemotron_h yet (the replay implements {want!r})",
                path=path,
                hint="a limit of moeaudit, not a fault of the checkpoint",
            )
    out.pop("hidden_act", None)  # NemotronHConfig has none: mlp_hidden_act and mamba_hidden_act
    return {**out, "layers_block_type": types, "num_hidden_layers": len(types)}


def _dt_min(c: Ctx) -> float:
    value = c.get("time_step_min", float, 0.001)
    if not math.isfinite(value) or value < 0:
        raise CheckpointError(f"config.json: time_step_min must be a finite number ≥ 0, got {value!r}", path=c.path)
    return float(value)


def _kinds(c: Ctx) -> tuple[str, ...]:
    return tuple(KINDS[t] for t in c.cfg["layers_block_type"])


def _layers(c: Ctx, s: ModelSpec) -> tuple[Layer, ...]:
    """Each layer one block (``layers_block_type``): a Mamba-2 mixer, attention, a dense MLP or an MoE."""
    assert s.settings.mamba is not None
    mamba = MambaMixer(s.settings.mamba)
    return tuple(derived_layer(s, i, mamba if k == "mamba" else None, k) for i, k in enumerate(_kinds(c)))


def _fields(c: Ctx) -> dict[str, Any]:
    kinds = _kinds(c)
    eps = c.get("layer_norm_epsilon", float, 1e-5)
    m = mamba2(
        c,
        heads="mamba_num_heads",
        head_dim="mamba_head_dim",
        groups="n_groups",
        state="ssm_state_size",
        conv="conv_kernel",
        chunk="chunk_size",
        conv_bias="use_conv_bias",
        proj_bias="use_bias",
        eps=eps,
        dt_limit=(_dt_min(c), None),  # transformers' mixer: [time_step_min, ∞)
        defaults={
            "mamba_num_heads": 128,
            "mamba_head_dim": 64,
            "n_groups": 8,
            "ssm_state_size": 128,
            "conv_kernel": 4,
            "chunk_size": 128,
        },
    )
    return {
        "rms_eps": eps,
        "routed_layers": tuple(i for i, k in enumerate(kinds) if k == "moe") if c.num_experts > 0 else (),
        "mamba": m,
        "attention": uniform(len(kinds), AttentionVariant(rope=False)),  # Jamba-style attention: no RoPE
        "attention_bias": False,  # transformers builds q/k/v/o without biases whatever the config says
        "mlp_act": "relu2",
        "norm_topk_prob": bool(c.get("norm_topk_prob", bool, True)),
        "dense_dim": c.get("intermediate_size", int, 21504),
        "shared_dim": c.get("moe_shared_expert_intermediate_size", int, 7688),
        "shared_gated": False,
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=1.0),
        "mtp_layers": mtp_count(c, 0),
    }


def _prefixed(table: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Each name under the released files' ``backbone.`` and transformers' in-memory ``model.``."""
    return {n: tuple(f"{root}.layers.{{layer}}.{k}" for root in ("backbone", "model")) for n, k in table.items()}


LAYOUT = Layout(
    family="nemotron_h",
    globals={
        "embed": ("backbone.embeddings.weight", "model.embeddings.weight"),
        "final_norm": ("backbone.norm_f.weight", "model.norm_f.weight"),
        "lm_head": ("lm_head.weight",),
    },
    layer=_prefixed(
        {
            "input_norm": "norm.weight",
            "post_norm": "norm.weight",  # a MoE layer's one norm, read again as the MoE block's (drift receipts)
            "q": "mixer.q_proj.weight",
            "k": "mixer.k_proj.weight",
            "v": "mixer.v_proj.weight",
            "o": "mixer.o_proj.weight",
            "ssm_in": "mixer.in_proj.weight",
            "ssm_in_bias": "mixer.in_proj.bias",
            "ssm_conv": "mixer.conv1d.weight",
            "ssm_conv_bias": "mixer.conv1d.bias",
            "ssm_dt_bias": "mixer.dt_bias",
            "ssm_A_log": "mixer.A_log",
            "ssm_D": "mixer.D",
            "ssm_norm": "mixer.norm.weight",
            "ssm_out": "mixer.out_proj.weight",
            "ssm_out_bias": "mixer.out_proj.bias",
            "mlp_w1": "mixer.up_proj.weight",
            "mlp_w2": "mixer.down_proj.weight",
            "router": "mixer.gate.weight",
            "router_bias": "mixer.gate.e_score_correction_bias",
            "shared_w1": "mixer.shared_experts.up_proj.weight",
            "shared_w2": "mixer.shared_experts.down_proj.weight",
        }
    ),
    expert=_prefixed({"w1": "mixer.experts.{expert}.up_proj.weight", "w2": "mixer.experts.{expert}.down_proj.weight"}),
    fused=_prefixed({"up": "mixer.experts.up_proj", "down": "mixer.experts.down_proj"}),
    fused_format="up_down",
    notes="single-block layers (Mamba-2, attention without RoPE, ReLU² MLP or MoE); non-gated ReLU² experts "
    "and shared expert; DeepSeek-V3 routing (sigmoid, selection bias, groups, scaled); MTP layers left out",
    left_out={"mtp.": "the multi-token-prediction layers (not part of the decoder's loss)"},
)

FAMILY = Family(
    name="nemotron_h",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    decoder_config=_decoder_config,
    layers=_layers,
    refuse=(
        Refuse(
            "moe_latent_size",
            (),
            "latent projections fc1_latent_proj / fc2_latent_proj around the routed experts, which then work "
            "in the latent width; the receipts model expert outputs in the hidden width",
        ),
    ),
)
