"""LongCat-Flash (``longcat_flash``, Meituan): each decoder layer holds two attention and two
dense-MLP sub-blocks around one shortcut-connected MoE (``LayerSettings.shortcut_moe``)::

    h = x + MLA₁(input_layernorm[0](x));   y = post_attention_layernorm[0](h)
    m = h + mlps[0](y);   a = m + MLA₂(input_layernorm[1](m))
    out = a + mlps[1](post_attention_layernorm[1](a)) + MoE(y)

The MoE reads y, the first MLP's input, and its output joins at the end of the layer. Its router
takes the float32 softmax of ``classifier`` over all ``n_routed_experts + zero_expert_num``
experts, chooses the top-``moe_topk`` of the probabilities + ``e_score_correction_bias`` and
weights each by its probability × ``routed_scaling_factor`` (no renormalisation). The last
``zero_expert_num`` experts are zero-computation (identity) experts: u_e(y) = y, no weights
(``ModelSpec.zero_experts``). Attention is DeepSeek-V3's MLA (low-rank q, interleaved RoPE) with
LongCat's LoRA scales (``mla_lora_scale``). ``num_layers`` counts the decoder layers (transformers'
``num_hidden_layers`` is twice it); the MTP module (``model.mtp.*``) is left out, as transformers
leaves it. Every layer is routed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Ctx, Family, Refuse, all_layers, parse_mla
from moeaudit.spec.config import MLA, SECOND_BLOCK, Gate, getter
from moeaudit.spec.layouts import GLOBALS, MLP_EXPERTS, L, Layout, prefixed

DEFAULT_LAYERS = 28  # LongcatFlashConfig.num_layers


def _decoder_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """``num_layers`` (what save_pretrained writes) as the layer count the reader takes from
    ``num_hidden_layers``; a config giving only ``num_hidden_layers`` means half of it, as
    transformers' setter reads it."""
    layers, sub = getter(cfg, path)("num_layers", int, None), cfg.get("num_hidden_layers")
    if layers is None:
        layers = sub // 2 if isinstance(sub, int) and not isinstance(sub, bool) else DEFAULT_LAYERS
    elif sub is not None and sub != 2 * layers:
        raise CheckpointError(
            f"config.json: num_hidden_layers={sub} is not twice num_layers={layers} (each LongCat layer "
            "holds two attention sub-blocks)",
            path=path,
        )
    return {**cfg, "num_hidden_layers": layers}


def _mla(c: Ctx) -> MLA:
    mla = parse_mla(c, always_interleave=True)
    if mla.q_lora_rank < 1:
        raise CheckpointError("config.json: LongCat-Flash needs q_lora_rank ≥ 1 (low-rank queries)", path=c.path)
    head = c.get("head_dim", int, 64)
    if head != mla.qk_rope_dim:
        raise CheckpointError(
            f"config.json: head_dim={head} differs from qk_rope_head_dim={mla.qk_rope_dim}: transformers' "
            "LongCat RoPE table is head_dim wide and rotates the qk_rope_head_dim part",
            path=c.path,
        )
    qk = c.get("qk_head_dim", int, mla.qk_head_dim)
    if qk != mla.qk_head_dim:
        raise CheckpointError(
            f"config.json: qk_head_dim={qk} is not qk_nope_head_dim + qk_rope_head_dim = {mla.qk_head_dim}",
            path=c.path,
        )
    return mla


def _zero_experts(cfg: dict[str, Any], get: Callable[..., Any]) -> int:
    """LongcatFlashConfig's default when absent; null reads as 0 (transformers: ``zero_expert_num or 0``).
    The router takes its top-``moe_topk`` over the routed and these experts together, so
    ``moe_topk`` may exceed ``n_routed_experts`` (docs/decisions.md)."""
    return 0 if "zero_expert_num" in cfg and cfg["zero_expert_num"] is None else int(get("zero_expert_num", int, 256))


def _fields(c: Ctx) -> dict[str, Any]:
    zero = _zero_experts(c.cfg, c.get)
    return {
        "num_experts": c.num_experts + zero,
        "zero_experts": zero,
        "routed_layers": all_layers(c),
        "norm_topk_prob": False,
        "dense_dim": c.get("ffn_hidden_size", int, 12288),
        "gate": Gate(scoring="softmax", selection_bias=True, scaling=c.get("routed_scaling_factor", float, 6.0)),
        "shortcut_moe": True,
        "mla_lora_scale": True,
    }


_ATTENTION = {
    "input_norm": "input_layernorm.{i}.weight",
    "post_norm": "post_attention_layernorm.{i}.weight",
    "q_a": "self_attn.{i}.q_a_proj.weight",
    "q_a_bias": "self_attn.{i}.q_a_proj.bias",
    "q_a_norm": "self_attn.{i}.q_a_layernorm.weight",
    "q_b": "self_attn.{i}.q_b_proj.weight",
    "kv_a": "self_attn.{i}.kv_a_proj_with_mqa.weight",
    "kv_a_bias": "self_attn.{i}.kv_a_proj_with_mqa.bias",
    "kv_a_norm": "self_attn.{i}.kv_a_layernorm.weight",
    "kv_b": "self_attn.{i}.kv_b_proj.weight",
    "o": "self_attn.{i}.o_proj.weight",
    "o_bias": "self_attn.{i}.o_proj.bias",
    "mlp_w1": "mlps.{i}.gate_proj.weight",
    "mlp_w3": "mlps.{i}.up_proj.weight",
    "mlp_w2": "mlps.{i}.down_proj.weight",
}


def _sub_block(i: int) -> dict[str, str]:
    # "{i}" filled here; "{layer}" (in the prefix) stays for the reader
    return {(SECOND_BLOCK if i else "") + n: k.replace("{i}", str(i)) for n, k in _ATTENTION.items()}


LAYOUT = Layout(
    family="longcat_flash",
    globals=GLOBALS,
    layer=prefixed(
        L,
        {
            **_sub_block(0),
            **_sub_block(1),
            "router": "mlp.router.classifier.weight",
            "router_bias": "mlp.router.e_score_correction_bias",
        },
    ),
    expert=prefixed(L, MLP_EXPERTS),  # the parametric experts only (the zero-computation ones have none)
    notes="two MLA attention + dense-MLP sub-blocks per layer around one shortcut MoE (it reads the first MLP's "
    "input, its output joins at the end of the layer); softmax router over routed + zero-computation (identity) "
    "experts, a selection bias, combine weights × routed_scaling_factor, not renormalised; MLA with LoRA scales",
    left_out={
        "model.mtp.": "the multi-token-prediction module (transformers does not load it)",
        # transformers' fused gate_up_proj has a row block for every expert, the identity ones
        # included, and save_pretrained writes those blocks out; nothing reads them
        L + "mlp.experts.": "gate/up weights stored for zero-computation experts, which never read them",
    },
)

REFUSE = (
    Refuse("router_bias", (False,), "a bias on the router's classifier, which transformers' LongCat router never adds"),
)

FAMILY = Family(
    name="longcat_flash",
    layout=LAYOUT,
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    expert_dim_key="expert_ffn_hidden_size",
    top_k_key="moe_topk",
    selectable_extra=_zero_experts,
    default_rms_eps=1e-5,
    default_rope_theta=1e7,
    mla=_mla,
    decoder_config=_decoder_config,
    refuse=REFUSE,
)
