"""Tiny random configs of DeepSeek-V3.2 (MLA with the DSA indexer) and the DeltaNet hybrids
Qwen3-Next and Qwen3.5-MoE, same conventions as :mod:`hfmodels.core`: their table, which
:mod:`hfmodels` merges into ``REGISTRY``, and the Qwen3.5-MoE vision-language checkpoint around
``qwen3_5_moe_text``."""

from __future__ import annotations

from typing import Any

_MLA = dict(
    num_key_value_heads=4,
    n_routed_experts=8,
    moe_intermediate_size=24,
    intermediate_size=56,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    routed_scaling_factor=2.5,
)

TINY: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 MLA + MoE with the DSA lightning indexer: 8 indexer heads of width 8 (the
    # first qk_rope_head_dim=4 rotated), and index_topk=5 < T so the selection matters.
    "deepseek_v32": dict(_MLA, index_topk=5, index_n_heads=8, index_head_dim=8),
    # Hybrid: layers 0, 2 gated DeltaNet (2 key heads, 4 value heads), layer 1 gated full
    # attention with per-head q/k norms and RoPE on half of each head; zero-centred norms
    # (gain 1 + w); 8 experts, top-2 renormalised, a sigmoid-gated shared expert.
    "qwen3_next": dict(
        head_dim=8,
        partial_rotary_factor=0.5,
        full_attention_interval=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_experts=8,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        intermediate_size=56,
    ),
}
# Qwen3.5-MoE's text decoder: the same hybrid, separate DeltaNet projections, every layer routed.
TINY["qwen3_5_moe_text"] = {k: v for k, v in TINY["qwen3_next"].items() if k not in ("intermediate_size",)}


_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=1,
)


def save_tiny_qwen3_5_moe(path, *, seed: int = 0) -> Any:
    """A tiny Qwen3.5-MoE vision-language checkpoint (text decoder as ``qwen3_5_moe_text``
    above, a one-block vision encoder); returns the float32 eval-mode model."""
    import torch
    import transformers

    from hfmodels.core import COMMON, redraw

    text = {**COMMON, **TINY["qwen3_5_moe_text"]}
    config = transformers.AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=_VISION)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    redraw(model, seed)
    model.save_pretrained(path)
    return model.eval()
