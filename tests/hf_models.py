"""Tiny random Hugging Face MoE models, one per family, for oracle and end-to-end tests.

The weights are re-drawn after transformers' own init (which gives std-0.02 matrices, unit
norm gains and zero biases): matrices at std 1/sqrt(fan_in) so routing is decisive and
activations are O(1), gains near 1 and small non-zero biases so that a wrong norm or a
dropped bias shows up in the numbers instead of hiding behind an identity.

Importing this module needs transformers; test modules guard with
``pytest.importorskip("transformers")`` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
DEEPSEEK = ("deepseek_v3", "deepseek_v2")
# registry-era families, each with its own oracle test file
NEW_FAMILIES = (
    "glm4_moe",
    "dots1",
    "hunyuan_v1_moe",
    "ernie4_5_moe",
    "minimax_m2",
    "granitemoe",
    "gpt_oss",
    "llama4_text",
    "phimoe",
)

VOCAB = 96

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    num_experts_per_tok=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

_FAMILY: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, intermediate_size=40),
    "olmoe": dict(num_experts=4, intermediate_size=40),
    "qwen2_moe": dict(
        num_experts=4,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        intermediate_size=56,
    ),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=24, intermediate_size=56),
    # MLA (low-rank q, kv latent, rope/nope split), a dense first layer, one shared expert,
    # 8 experts in 4 groups of which the best 2 compete, scaled combine weights.
    "deepseek_v3": dict(
        num_key_value_heads=4,  # MLA expands every head from the latent
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
        num_nextn_predict_layers=0,
    ),
    "deepseek_v2": dict(
        num_key_value_heads=4,
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        n_shared_experts=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        routed_scaling_factor=1.5,
    ),
    # q/k/v bias, per-head qk norm, RoPE on half of each head, V3's router (8 experts in 4
    # groups, best 2 compete, selection bias), one shared expert, a dense first layer.
    "glm4_moe": dict(
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.0,
        attention_bias=True,
        use_qk_norm=True,
        head_dim=8,
        partial_rotary_factor=0.5,
        num_nextn_predict_layers=0,
    ),
    # Qwen3 attention (per-head qk norm) with bias, V3's router (8 experts in 4 groups, best 2
    # compete, selection bias), one shared expert, a dense first layer, a sliding last layer.
    "dots1": dict(
        n_routed_experts=8,
        moe_intermediate_size=24,
        intermediate_size=56,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
        attention_bias=True,
        head_dim=8,
        sliding_window=5,
        max_window_layers=2,
    ),
    # per-head qk norm after RoPE, softmax top-k renormalised, shared MLP (as wide as an expert)
    "hunyuan_v1_moe": dict(
        num_experts=4,
        moe_topk=2,
        intermediate_size=40,
        attention_bias=True,
        head_dim=8,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        eod_token_id=None,
        sep_token_id=None,
    ),
    # softmax + selection bias router, two shared experts, a dense first layer, GLM-style RoPE
    "ernie4_5_moe": dict(
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=24,
        intermediate_size=56,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        tie_word_embeddings=False,
        head_dim=8,
    ),
    # q/k norm over all heads, RoPE on half of each head, sigmoid router with selection bias
    "minimax_m2": dict(
        num_local_experts=8,
        intermediate_size=24,
        head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # Mixtral routing with all four µP multipliers away from 1 (Granite-3.0-1B-A400M's values)
    "granitemoe": dict(
        num_local_experts=4,
        intermediate_size=24,
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        residual_multiplier=0.22,
        logits_scaling=6.0,
    ),
    # sinks, alternating sliding (window 5 < the 12-token windows) and full attention, biased
    # router and experts; a clamp limit the O(1) activations cross, so both clamps act
    "gpt_oss": dict(
        num_local_experts=4,
        intermediate_size=24,
        head_dim=8,
        sliding_window=5,
        swiglu_limit=1.0,
    ),
    # 4 layers: dense 0 and 2, routed 1 and 3 (top-1 of 4 plus the shared expert, inputs scaled by
    # σ); NoPE on layer 3 with a temperature that changes within 12 tokens (floor_scale 4);
    # chunked attention (chunks of 5 tokens) on the RoPE layers 0-2
    "llama4_text": dict(
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size=24,
        intermediate_size_mlp=40,
        interleave_moe_layer_step=2,
        head_dim=8,
        attention_chunk_size=5,
        floor_scale=4,
        attn_scale=0.5,
    ),
    # LayerNorms with bias, q/k/v/o and LM-head biases, sparsemixer top-2 with a jitter band wide
    # enough (0.3) that the combine softmaxes include rivals
    "phimoe": dict(
        num_local_experts=4,
        intermediate_size=24,
        attention_bias=True,
        lm_head_bias=True,
        router_jitter_noise=0.3,
    ),
}


def tiny_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    kwargs = {**_COMMON, **_FAMILY[family], **overrides}
    return transformers.AutoConfig.for_model(family, **kwargs)


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() >= 2:
            p.copy_(noise / p.shape[-1] ** 0.5)
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        else:  # biases
            p.copy_(0.1 * noise)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 selection bias (fp32 buffer)
            b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    for name, p in sorted(model.named_parameters(remove_duplicate=False)):
        if name.endswith("e_score_correction_bias"):  # ERNIE 4.5: a frozen parameter, [1, E]
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def tiny_model(family: str, *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A float32, eval-mode, eager-attention causal LM with seeded random weights."""
    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def save_tiny(
    path: Path,
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Save a tiny model with ``save_pretrained`` (optionally cast and sharded); return it."""
    model = tiny_model(family, seed=seed, **overrides)
    to_save = model if dtype is None else tiny_model(family, seed=seed, **overrides).to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    to_save.save_pretrained(path, **kwargs)
    return model


def load(path: Path) -> transformers.PreTrainedModel:
    """Load a checkpoint back into a float32, eval-mode, eager-attention HF model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def random_tokens(windows: int = 3, length: int = 12, *, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    """A seeded ``[W, T]`` int64 token block (a canary stand-in)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (windows, length), generator=gen)
