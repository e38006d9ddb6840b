"""Multi-head latent attention (``spec.blocks.MLAttention``): DeepSeek-V2/V3's low-rank query and
shared kv latent, with DeepSeek Sparse Attention's indexer where the layer has one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.replay.blocks.attention import _with_sink_key
from moeaudit.replay.blocks.norms import _linear, rms_norm
from moeaudit.replay.blocks.rope import (
    _rotate_half,
    _rotate_interleaved,
)
from moeaudit.replay.dsa import sparse_causal_mask
from moeaudit.spec.blocks import MLAttention
from moeaudit.spec.config import MLA_NORM_EPS, ModelSpec


def mla_attention(
    spec: ModelSpec,
    block: MLAttention,
    p: dict[str, torch.Tensor],
    x_BTH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    layer: int = -1,
) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3): the query through a low-rank bottleneck
    with its own RMSNorm, keys and values expanded from one normalised latent per token, and a
    single rotary key shared by every head; heads are ``qk_nope + qk_rope`` wide."""
    m = block.mla
    B, T, _ = x_BTH.shape
    nh, nope, rot = block.heads, m.qk_nope_dim, m.qk_rope_dim
    q_lat = None
    eps = MLA_NORM_EPS if block.norm_eps is None else block.norm_eps
    if m.q_lora_rank:
        q_lat = rms_norm(_linear(x_BTH, p, "q_a", "q_a_bias"), p["q_a_norm"], eps)
        q = F.linear(q_lat, p["q_b"])
    else:
        q = F.linear(x_BTH, p["q"])
    if block.lora_scale:  # LongCat: the query (nope and rope parts) × √(H / q_lora_rank)
        q = q * (spec.hidden_size / m.q_lora_rank) ** 0.5
    q_nope, q_rot = q.view(B, T, nh, m.qk_head_dim).transpose(1, 2).split([nope, rot], dim=-1)
    kv_lat, k_rot = _linear(x_BTH, p, "kv_a", "kv_a_bias").split([m.kv_lora_rank, rot], dim=-1)
    kv_lat = rms_norm(kv_lat, p["kv_a_norm"], eps)
    if block.lora_scale:  # LongCat: the normed latent × √(H / kv_lora_rank), before its expansion
        kv_lat = kv_lat * (spec.hidden_size / m.kv_lora_rank) ** 0.5
    k_rot = k_rot.view(B, 1, T, rot)
    cos, sin = rope
    if not block.rope:  # Kimi Linear: the "rope" dims are used as they are
        pass
    elif m.rope_interleave:
        q_rot, k_rot = _rotate_interleaved(q_rot, cos, sin), _rotate_interleaved(k_rot, cos, sin)
    else:
        q_rot = q_rot * cos + _rotate_half(q_rot) * sin
        k_rot = k_rot * cos + _rotate_half(k_rot) * sin
    kv = F.linear(kv_lat, p["kv_b"]).view(B, T, nh, nope + m.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([nope, m.v_head_dim], dim=-1)
    q_BnTD = torch.cat([q_nope, q_rot], dim=-1)
    if block.position_scale is not None:  # Mistral 4: 1 + β·log(1 + ⌊pos / L⌋), 1 below L
        beta, length = block.position_scale
        pos = torch.arange(T, device=x_BTH.device, dtype=torch.float32)
        q_BnTD = q_BnTD * (1 + beta * torch.log(1 + torch.floor(pos / length)))[:, None].to(q_BnTD.dtype)
    k_BnTD = torch.cat([k_nope, k_rot.expand(B, nh, T, rot)], dim=-1)
    mask = None
    if (si := block.index) is not None and T > si.topk:  # T ≤ topk: DSA keeps every causal key
        if block.shared_index:  # refused before the replay starts (engine.check_replayable)
            raise ValueError(f"layer {layer} reuses another layer's DSA key selection, which is not replayed")
        assert q_lat is not None  # the config reader requires q_lora_rank for DSA
        mask = sparse_causal_mask(
            p,
            x_BTH,
            q_lat,
            rope,
            si.n_heads,
            si.head_dim,
            si.topk,
            block.index_rope_interleave,
            block.index_rope_last,
            block.index_norm_eps,
        )
    scale = spec.attention_scale
    if block.sinks:  # HY-V4: a learned sink logit per head, as gpt-oss's
        assert scale is not None  # MLA's scale is always set (config.rope)
        q_BnTD, k_BnTD, v, mask = _with_sink_key(p["sinks"], q_BnTD, k_BnTD, v, mask, scale)
    out = F.scaled_dot_product_attention(q_BnTD, k_BnTD, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    if block.output_gate == "head_sigmoid":  # Ling 3: σ(W_g x) per head, rounded to the activations' dtype
        gate = torch.sigmoid(F.linear(x_BTH, p["g_proj"]).float()).to(x_BTH.dtype)
        out = out * gate.transpose(1, 2)[..., None]
    out_BTX = out.transpose(1, 2).reshape(B, T, nh * m.v_head_dim)
    if block.output_gate == "sigmoid":  # HY-V4: σ(W_g x) per channel of every head's output
        out_BTX = out_BTX * torch.sigmoid(F.linear(x_BTH, p["g_proj"]))
    return _linear(out_BTX, p, "o", "o_bias")
