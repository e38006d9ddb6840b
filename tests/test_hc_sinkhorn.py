"""DeepSeek-V4's manifold-constrained hyper-connections (``ModelSpec.hc_sinkhorn_iters``) against
transformers' own ``DeepseekV4HyperConnection``, ``DeepseekV4HyperHead`` and the residual write of
``DeepseekV4DecoderLayer.forward``.

The whole DeepSeek-V4 layer is not replayed (its attention and compressors are not: the family is
refused), so the layer is run with its two sub-blocks swapped for fixed functions the replay
computes too — a linear map as the attention, a dense clamped SwiGLU (``DeepseekV4MLP``, the
shared expert's class) as the MLP — leaving transformers' code for everything the
hyper-connections do: the stream mix read by each sub-block, the post weights, the Sinkhorn
mixing matrix and its transposed use, the dtypes (weights in float32, streams in the model's
dtype; the residual write computed in the streams' dtype). Values and gradients (streams and
hyper-connection weights) are compared in float32 and bfloat16, with streams, eps and iteration
counts varied; bfloat16 agrees to the bit on the streams.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay.model import HCWrite, hc_add, hc_mix, rms_norm  # noqa: E402
from moeaudit.spec.config import ModelSpec  # noqa: E402

H = 16
CASES: dict[str, dict[str, Any]] = {
    # V4's defaults: four streams, 20 Sinkhorn iterations
    "four-streams-20-iters": {"hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6},
    # two streams, one iteration (the column normalisation alone); eps large enough to be seen
    "two-streams-1-iter-large-eps": {"hc_mult": 2, "hc_sinkhorn_iters": 1, "hc_eps": 0.05, "rms_norm_eps": 0.05},
    # three streams, 3 iterations: far from doubly stochastic, so each iteration counts
    "three-streams-3-iters": {"hc_mult": 3, "hc_sinkhorn_iters": 3, "hc_eps": 1e-6, "rms_norm_eps": 1e-6},
}


def _config(case: dict[str, Any]) -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        vocab_size=32,
        hidden_size=H,
        moe_intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        q_lora_rank=8,
        o_groups=1,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention"],
        mlp_layer_types=["moe"],
        swiglu_limit=0.5,
        **case,
    )
    return cfg


def _spec(case: dict[str, Any]) -> ModelSpec:
    base = spec_from_config(
        {
            "model_type": "hy_v4",
            "hidden_size": H,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "vocab_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "q_lora_rank": 8,
            "kv_lora_rank": 8,
            "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4,
            "v_head_dim": 4,
            "index_head_dim": 8,
        }
    )
    return base.revised(
        hc_mult=case["hc_mult"],
        hc_sinkhorn_iters=case["hc_sinkhorn_iters"],
        hc_eps=case["hc_eps"],
        rms_eps=case["rms_norm_eps"],
        hc_magnitude=2.0,
    )


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights drawn so every term moves the output: logits of order 1, scales and biases not trivial."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * (0.5 if "fn" in name else 1.0))


class _Linear(torch.nn.Module):
    """A stand-in attention: the layer calls ``self_attn(x, **kwargs)`` and reads ``[0]``."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.w.to(x.dtype)), None


class _MLP(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.inner = mlp

    def forward(self, x: torch.Tensor, input_ids: Any = None) -> torch.Tensor:
        return self.inner(x)


def _replay_mlp(mlp: torch.nn.Module, x: torch.Tensor, limit: float) -> torch.Tensor:
    gate = F.linear(x, mlp.gate_proj.weight.to(x.dtype)).clamp(max=limit)
    up = F.linear(x, mlp.up_proj.weight.to(x.dtype)).clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, mlp.down_proj.weight.to(x.dtype))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_hyper_connection_weights(name: str, dtype: torch.dtype) -> None:
    """post, comb and the mix Σ pre_s x_s equal ``DeepseekV4HyperConnection``'s."""
    case = CASES[name]
    cfg, spec = _config(case), _spec(case)
    S = case["hc_mult"]
    gen = torch.Generator().manual_seed(3)
    hc = dsv4.DeepseekV4HyperConnection(cfg).to(torch.float32)
    _randomise(hc, gen)
    x = torch.randn(2, 5, case["hc_mult"], H, generator=gen).to(dtype)
    post_t, comb_t, mix_t = hc(x)
    write, mix = hc_mix(spec, hc.fn.detach(), hc.base.detach(), hc.scale.detach(), x)
    assert write is not None and write.comb_BTSS is not None
    tol = 1e-6
    assert _rel(write.post_BTS, post_t) < 1e-6
    assert _rel(write.comb_BTSS, comb_t) < 1e-6
    assert mix.dtype == mix_t.dtype and _rel(mix, mix_t) < tol
    # the last step normalises the columns
    assert torch.allclose(write.comb_BTSS.sum(-2), torch.ones(()), atol=1e-4 + S * case["hc_eps"])
    # the mixing matrix is not symmetric: using it untransposed would give other streams
    assert _rel(write.comb_BTSS.transpose(-1, -2), comb_t) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_decoder_layer_hyper_connections(name: str, dtype: torch.dtype) -> None:
    """Transformers' ``DeepseekV4DecoderLayer.forward`` (sub-blocks swapped for fixed functions)
    against hc_mix / hc_add around the same functions: the output streams, and the gradients of
    a random projection of them with respect to the input streams and every hyper-connection
    weight."""
    case = CASES[name]
    cfg, spec = _config(case), _spec(case)
    S = case["hc_mult"]
    gen = torch.Generator().manual_seed(7)
    layer = dsv4.DeepseekV4DecoderLayer(cfg, 0)
    for hc in (layer.attn_hc, layer.ffn_hc):
        _randomise(hc, gen)
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(1 + 0.3 * torch.randn(H, generator=gen))
        layer.post_attention_layernorm.weight.copy_(1 + 0.3 * torch.randn(H, generator=gen))
    mlp = dsv4.DeepseekV4MLP(cfg)
    _randomise(mlp, gen)
    mlp = mlp.to(dtype)  # in the model's dtype, as transformers keeps only the norms and mHC in float32
    layer.self_attn = _Linear(torch.randn(H, H, generator=gen) / H**0.5)  # type: ignore[assignment]
    layer.mlp = _MLP(mlp)  # type: ignore[assignment]
    x0 = torch.randn(2, 6, S, H, generator=gen).to(dtype)
    probe = torch.randn(2, 6, S, H, generator=gen)

    x_t = x0.clone().requires_grad_(True)
    out_t = layer(x_t)
    (out_t.float() * probe).sum().backward()
    hc_params = [layer.attn_hc.fn, layer.attn_hc.base, layer.attn_hc.scale]
    hc_params += [layer.ffn_hc.fn, layer.ffn_hc.base, layer.ffn_hc.scale]
    grads_t = [x_t.grad] + [p.grad for p in hc_params]

    weights = [p.detach().clone().requires_grad_(True) for p in hc_params]
    a_fn, a_base, a_scale, f_fn, f_base, f_scale = weights
    w_attn = layer.self_attn.w.detach()
    x_r = x0.clone().requires_grad_(True)
    write, a = hc_mix(spec, a_fn, a_base, a_scale, x_r)
    assert isinstance(write, HCWrite)
    attn_in = rms_norm(a, layer.input_layernorm.weight.detach(), spec.rms_eps).to(dtype)
    x1 = hc_add(write, F.linear(attn_in, w_attn.to(attn_in.dtype)), x_r)
    write2, m = hc_mix(spec, f_fn, f_base, f_scale, x1)
    assert write2 is not None
    y = rms_norm(m, layer.post_attention_layernorm.weight.detach(), spec.rms_eps).to(dtype)
    out_r = hc_add(write2, _replay_mlp(mlp, y, cfg.swiglu_limit), x1)
    (out_r.float() * probe).sum().backward()
    grads_r = [x_r.grad] + [w.grad for w in weights]

    assert out_r.dtype == out_t.dtype == dtype
    # measured: streams ≤ 3.5e-7 (float32) and equal (bfloat16), gradients ≤ 1.1e-6
    assert _rel(out_r, out_t) < 1e-5
    for g_r, g_t in zip(grads_r, grads_t):
        assert g_r is not None and g_t is not None
        assert _rel(g_r, g_t) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hyper_head(dtype: torch.dtype) -> None:
    """The final collapse equals ``DeepseekV4HyperHead``'s."""
    case = CASES["four-streams-20-iters"]
    cfg, spec = _config(case), _spec(case)
    gen = torch.Generator().manual_seed(11)
    head = dsv4.DeepseekV4HyperHead(cfg).to(torch.float32)
    _randomise(head, gen)
    x = torch.randn(2, 5, 4, H, generator=gen).to(dtype)
    write, mix = hc_mix(spec, head.hc_fn.detach(), head.hc_base.detach(), head.hc_scale.detach(), x, head=True)
    assert write is None
    assert _rel(mix, head(x)) < 1e-6


def test_sinkhorn_differs_from_hy_v4() -> None:
    """Without ``hc_sinkhorn_iters`` the same weights give HY-V4's write (identity residual, ε on
    post), which is not DeepSeek-V4's: the option is what selects the variant."""
    case = CASES["two-streams-1-iter-large-eps"]
    spec = _spec(case)
    gen = torch.Generator().manual_seed(5)
    S = case["hc_mult"]
    fn = torch.randn(2 * S, S * H, generator=gen)
    x = torch.randn(1, 3, S, H, generator=gen)
    f = torch.randn(1, 3, H, generator=gen)
    write, _ = hc_mix(spec.revised(hc_sinkhorn_iters=0), fn, torch.zeros(2 * S), torch.ones(2), x)
    assert write is not None and write.comb_BTSS is None
    out = hc_add(write, f, x)
    assert torch.allclose(out, x + write.post_BTS.unsqueeze(-1) * f.unsqueeze(-2))
