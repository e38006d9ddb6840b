"""DeepSeek-V4's compressed attention branches (``moeaudit.replay.compress``) against transformers'
``DeepseekV4HCACompressor`` and ``DeepseekV4CSACompressor`` (with its ``DeepseekV4Indexer``), run
without a cache as a training forward runs them.

Compared: the compressed entries (values, and gradients of a random projection of them with
respect to the input and every compressor weight), which entries each query may read (HCA: the
closed windows; CSA: those the indexer keeps), in float32 and in bfloat16 (projections in
bfloat16, the position bias and norms in float32, as transformers keeps them), on two
configurations varying the compression ratios, head sizes, indexer heads and top-k (fewer kept
than readable, so the selection decides), with a sequence that leaves a partial last window.
With two or three indexer heads many scores are ReLU's exact zeros and cuts tie; there
transformers' top-k breaks the ties by position as the replay does (``support.indexer_ties``).
The first configuration's attention meets no tie (asserted) and is compared with transformers as
it is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from support.indexer_ties import watch_indexers  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

from moeaudit.replay.compress import (  # noqa: E402
    V4Branch,
    compressed_entries,
    indexer_selection,
    v4_attention,
    visible_entries,
)

H = 24
CASES: dict[str, dict[str, Any]] = {
    # CSA every 4 tokens, HCA every 8; head 16 with 8 rotary dims; 3 indexer heads keeping 2
    "csa4-hca8-top2": {
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "index_n_heads": 3,
        "index_head_dim": 12,
        "index_topk": 2,
        "rms_norm_eps": 1e-6,
    },
    # CSA every 2 tokens, HCA every 5; head 12 with 4 rotary dims; 2 indexer heads keeping 3;
    # a large eps and another RoPE base
    "csa2-hca5-top3": {
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 5},
        "head_dim": 12,
        "partial_rotary_factor": 1 / 3,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "index_topk": 3,
        "rms_norm_eps": 0.05,
        "compress_rope_theta": 500.0,
    },
}
T = 23  # a partial last window for every ratio above


def _config(case: dict[str, Any]) -> DeepseekV4Config:
    base: dict[str, Any] = {
        "vocab_size": 32,
        "hidden_size": H,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "q_lora_rank": 10,
        "o_groups": 1,
        "o_lora_rank": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["moe", "moe"],
    }
    return DeepseekV4Config(**{**base, **case})


def _inv_freq(cfg: DeepseekV4Config) -> torch.Tensor:
    rd = cfg.qk_rope_head_dim
    return 1.0 / (cfg.rope_parameters["compress"]["rope_theta"] ** (torch.arange(0, rd, 2).float() / rd))


def _prepare(module: torch.nn.Module, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Random weights; the projections in ``dtype``, the position biases and norms in float32."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 1.0 if "position_bias" in name or "norm" in name else 0.4
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear) and "norm" not in name:
            sub.to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _entries(comp: Any, x: torch.Tensor, overlap: bool, cfg: DeepseekV4Config, ratio: int) -> torch.Tensor:
    return compressed_entries(
        x,
        comp.kv_proj.weight,
        comp.gate_proj.weight,
        comp.position_bias,
        comp.kv_norm.weight,
        cfg.rms_norm_eps,
        ratio,
        overlap,
        _inv_freq(cfg),
    )


def _grads(out: torch.Tensor, probe: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out.float() * probe).sum(), params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_hca_compressor(name: str, dtype: torch.dtype) -> None:
    cfg = _config(CASES[name])
    ratio = cfg.compress_rates["heavily_compressed_attention"]
    gen = torch.Generator().manual_seed(1)
    comp = dsv4.DeepseekV4HCACompressor(cfg)
    _prepare(comp, dtype, gen)
    assert torch.equal(comp.rotary_emb.compress_inv_freq, _inv_freq(cfg))
    x = torch.randn(2, T, H, generator=gen).to(dtype).requires_grad_(True)
    kv_t, bias_t = comp(x, None, torch.arange(T)[None].expand(2, T), None, 0)
    kv_r = _entries(comp, x, False, cfg, ratio)
    assert kv_r.dtype == kv_t.dtype == dtype and kv_r.shape == kv_t[:, 0].shape == (2, T // ratio, cfg.head_dim)
    assert _rel(kv_r, kv_t[:, 0]) < 1e-6
    assert torch.equal(visible_entries(T, T // ratio, ratio).expand(2, -1, -1), bias_t[:, 0] == 0)
    probe = torch.randn(kv_r.shape, generator=gen)
    params = [x, comp.kv_proj.weight, comp.gate_proj.weight, comp.position_bias, comp.kv_norm.weight]
    for g_r, g_t in zip(_grads(kv_r, probe, params), _grads(kv_t[:, 0], probe, params)):
        assert _rel(g_r, g_t) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_csa_compressor_and_indexer(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    ties = watch_indexers(monkeypatch, by_position=True)
    cfg = _config(CASES[name])
    ratio = cfg.compress_rates["compressed_sparse_attention"]
    gen = torch.Generator().manual_seed(2)
    comp = dsv4.DeepseekV4CSACompressor(cfg)
    _prepare(comp, dtype, gen)
    x = torch.randn(2, T, H, generator=gen).to(dtype).requires_grad_(True)
    q_latent = torch.randn(2, T, cfg.q_lora_rank, generator=gen).to(dtype)
    kv_t, bias_t = comp(x, q_latent, torch.arange(T)[None].expand(2, T), None, 0)
    W = T // ratio
    kv_r = _entries(comp, x, True, cfg, ratio)
    assert kv_r.dtype == kv_t.dtype == dtype and kv_r.shape == (2, W, cfg.head_dim)
    assert _rel(kv_r, kv_t[:, 0]) < 1e-6
    probe = torch.randn(kv_r.shape, generator=gen)
    params = [x, comp.kv_proj.weight, comp.gate_proj.weight, comp.position_bias, comp.kv_norm.weight]
    for g_r, g_t in zip(_grads(kv_r, probe, params), _grads(kv_t[:, 0], probe, params)):
        assert _rel(g_r, g_t) < 1e-5

    ix = comp.indexer
    with torch.no_grad():
        keys = _entries(ix, x, True, cfg, ratio)
        kept = indexer_selection(
            x, q_latent, keys, ix.q_b_proj.weight, ix.scorer.weights_proj.weight, cfg.index_n_heads,
            cfg.index_topk, ratio, _inv_freq(cfg),
        )  # fmt: skip
    assert torch.equal(kept, bias_t[:, 0] == 0)
    assert ties.tied_cuts > 0  # the comparison exercises the tie rule
    visible = visible_entries(T, W, ratio)
    # the selection decides: some queries read fewer entries than have closed, and those kept differ
    assert bool((kept.sum(-1) < visible.sum(-1)).any())
    assert bool((kept.sum(-1) == torch.clamp(visible.sum(-1), max=cfg.index_topk)).all())


_NAMES = {
    "q_a": "q_a_proj.weight",
    "q_a_norm": "q_a_norm.weight",
    "q_b": "q_b_proj.weight",
    "kv": "kv_proj.weight",
    "kv_norm": "kv_norm.weight",
    "sinks": "sinks",
    "o_a": "o_a_proj.weight",
    "o_b": "o_b_proj.weight",
    "c_kv": "compressor.kv_proj.weight",
    "c_gate": "compressor.gate_proj.weight",
    "c_bias": "compressor.position_bias",
    "c_norm": "compressor.kv_norm.weight",
    "i_kv": "compressor.indexer.kv_proj.weight",
    "i_gate": "compressor.indexer.gate_proj.weight",
    "i_bias": "compressor.indexer.position_bias",
    "i_norm": "compressor.indexer.kv_norm.weight",
    "i_q": "compressor.indexer.q_b_proj.weight",
    "i_w": "compressor.indexer.scorer.weights_proj.weight",
}
TIED_ATTENTION = ("csa2-hca5-top3",)  # the configurations whose attention's indexer cuts tie
ATTENTION: dict[str, dict[str, Any]] = {
    # 4 heads in 2 output groups; a window of 6 (shorter than the sequence)
    "csa4-hca8-top2": {"num_attention_heads": 4, "o_groups": 2, "sliding_window": 6, "rope_theta": 100.0},
    # 3 heads in 3 groups; a window of 9
    "csa2-hca5-top3": {"num_attention_heads": 3, "o_groups": 3, "sliding_window": 9, "o_lora_rank": 5},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
@pytest.mark.parametrize("name", list(CASES))
def test_attention(name: str, kind: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``v4_attention`` against ``DeepseekV4Attention`` (eager, no cache), each layer type: the
    output and the gradients of a random projection of it (input and every weight)."""
    ties = watch_indexers(monkeypatch, by_position=name in TIED_ATTENTION)
    cfg = _config({**CASES[name], **ATTENTION[name]})
    cfg.layer_types = [kind, kind]
    cfg._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(4)
    attn = dsv4.DeepseekV4Attention(cfg, 0)
    _prepare(attn, dtype, gen)
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(attn.sinks.shape, generator=gen))
    x = torch.randn(2, T, H, generator=gen).to(dtype).requires_grad_(True)
    pos = torch.arange(T)[None].expand(2, T)
    rotary = dsv4.DeepseekV4RotaryEmbedding(cfg)
    embeddings = {k: rotary(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    i = torch.arange(T)
    allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < cfg.sliding_window)
    mask = torch.zeros(2, 1, T, T, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    out_t, _ = attn(x, embeddings, pos, mask)

    parts = {"sliding_attention": ("",), "heavily_compressed_attention": ("", "c_")}.get(kind, ("", "c_", "i_"))
    p = {k: attn.get_parameter(v) for k, v in _NAMES.items() if (k[:2] if k[:2] in ("c_", "i_") else "") in parts}
    if kind == "sliding_attention":
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.qk_rope_head_dim, 2).float() / cfg.qk_rope_head_dim))
        branch = None
    else:
        inv_freq = _inv_freq(cfg)
        csa = kind == "compressed_sparse_attention"
        branch = V4Branch(cfg.compress_rates[kind], csa, cfg.index_n_heads if csa else 0, cfg.index_topk if csa else 0)
    out_r = v4_attention(
        p, x, n_heads=cfg.num_attention_heads, head_dim=cfg.head_dim, window=cfg.sliding_window,
        eps=cfg.rms_norm_eps, o_groups=cfg.o_groups, inv_freq=inv_freq, branch=branch,
    )  # fmt: skip
    assert out_r.dtype == out_t.dtype == dtype
    assert _rel(out_r, out_t) < 1e-5
    probe = torch.randn(out_r.shape, generator=gen)
    params = [x, *(t for k, t in p.items() if k[:2] != "i_")]  # the indexer takes no gradient
    for g_r, g_t in zip(_grads(out_r, probe, params), _grads(out_t, probe, params)):
        assert _rel(g_r, g_t) < 1e-4
    if kind == "compressed_sparse_attention":
        assert ties.calls > 0 and (ties.tied_cuts > 0) == (name in TIED_ATTENTION)


YARN: dict[str, dict[str, Any]] = {
    # factor 4 from 8 original positions (T = 23 reaches past them), default betas
    "yarn4": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    # factor 16 as DeepSeek-V4's configs, narrower betas: the ramp falls inside the rotary dims
    "yarn16-beta8-2": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 4,
        "beta_fast": 8.0,
        "beta_slow": 2.0,
    },
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["compressed_sparse_attention", "heavily_compressed_attention"])
@pytest.mark.parametrize("yarn", list(YARN))
def test_attention_with_yarn_on_the_compressed_rope(
    yarn: str, kind: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """YaRN on the compressed branches' RoPE (what DeepSeek-V4's configs give, flat
    ``rope_parameters`` that transformers applies to the ``compress`` base only, forcing its
    attention_factor to 1): the replay's ``yarn_inv_freq`` at ``compress_rope_theta`` over the
    rotary dims is transformers' ``compress_inv_freq``, the sliding base is left unscaled, and
    ``v4_attention`` with it agrees with ``DeepseekV4Attention`` (output and gradients; the
    indexer's cuts tie, so transformers breaks the ties by position)."""
    from moeaudit.replay.model import yarn_inv_freq

    watch_indexers(monkeypatch, by_position=True)
    from moeaudit.spec.rope_config import _yarn

    name = "csa4-hca8-top2"
    r = YARN[yarn]
    positions = int(r["factor"] * r["original_max_position_embeddings"])
    cfg = _config({**CASES[name], **ATTENTION[name], "rope_parameters": dict(r), "max_position_embeddings": positions})
    cfg.layer_types = [kind, kind]
    cfg._attn_implementation = "eager"
    compress = cfg.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and cfg.rope_parameters["main"]["rope_type"] == "default"
    y = _yarn({"rope_parameters": compress}, "config.json")
    assert y is not None and y.attention_factor == 1.0
    inv_freq = yarn_inv_freq(y, compress["rope_theta"], cfg.qk_rope_head_dim)
    rotary = dsv4.DeepseekV4RotaryEmbedding(cfg)
    assert rotary.compress_attention_scaling == 1.0
    assert torch.equal(inv_freq, rotary.compress_inv_freq)
    assert not torch.allclose(inv_freq, _inv_freq(cfg))  # the scaling changes the frequencies
    gen = torch.Generator().manual_seed(5)
    attn = dsv4.DeepseekV4Attention(cfg, 0)
    _prepare(attn, dtype, gen)
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(attn.sinks.shape, generator=gen))
    x = torch.randn(2, T, H, generator=gen).to(dtype).requires_grad_(True)
    pos = torch.arange(T)[None].expand(2, T)
    embeddings = {k: rotary(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    i = torch.arange(T)
    allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < cfg.sliding_window)
    mask = torch.zeros(2, 1, T, T, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    out_t, _ = attn(x, embeddings, pos, mask)
    csa = kind == "compressed_sparse_attention"
    parts = ("", "c_", "i_") if csa else ("", "c_")
    p = {k: attn.get_parameter(v) for k, v in _NAMES.items() if (k[:2] if k[:2] in ("c_", "i_") else "") in parts}
    branch = V4Branch(cfg.compress_rates[kind], csa, cfg.index_n_heads if csa else 0, cfg.index_topk if csa else 0)
    kw: dict[str, Any] = {
        "n_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim, "window": cfg.sliding_window,
        "eps": cfg.rms_norm_eps, "o_groups": cfg.o_groups, "branch": branch,
    }  # fmt: skip
    out_r = v4_attention(p, x, inv_freq=inv_freq, **kw)
    assert _rel(out_r, out_t) < 1e-5
    probe = torch.randn(out_r.shape, generator=gen)
    params = [x, *(t for k, t in p.items() if k[:2] != "i_")]
    for g_r, g_t in zip(_grads(out_r, probe, params), _grads(out_t, probe, params)):
        assert _rel(g_r, g_t) < 1e-4
    # the unscaled compressed base gives another output: the YaRN frequencies are what agree
    with torch.no_grad():
        assert _rel(v4_attention(p, x, inv_freq=_inv_freq(cfg), **kw), out_t) > 1e-3
