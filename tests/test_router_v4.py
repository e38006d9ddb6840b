"""DeepSeek-V4's MoE pieces against transformers' modules: the √softplus router with a selection
bias (``DeepseekV4TopKRouter``), the hash router (``DeepseekV4HashRouter``: the set from
``tid2eid[token id]``, the learned router only weighting it) and the clamped shared expert
(``DeepseekV4MLP``). fp32 and bf16 inputs (the router in float32 as transformers keeps its bias),
two configurations each (expert count, top-k, renormalisation, scaling, clamp)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay.model import hash_route, route, shared_expert  # noqa: E402
from moeaudit.spec.config import ClampedGLU, Gate, ModelSpec  # noqa: E402

H = 16
CASES: dict[str, dict[str, Any]] = {
    "top2-of-8-scaled-1.5": {"n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 1.5},
    "top3-of-12-clamp-0.3": {
        "n_routed_experts": 12,
        "num_experts_per_tok": 3,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 0.3,
    },
}


def _cfg(case: dict[str, Any]) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=40,
        hidden_size=H,
        moe_intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=8,
        q_lora_rank=8,
        o_groups=1,
        o_lora_rank=8,
        layer_types=["sliding_attention"] * 2,
        mlp_layer_types=["hash_moe", "moe"],
        **case,
    )


def _spec(cfg: DeepseekV4Config) -> ModelSpec:
    base = spec_from_config(
        {
            "model_type": "hy_v4",
            "hidden_size": H,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "vocab_size": 40,
            "n_routed_experts": cfg.n_routed_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
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
        gate=Gate(scoring="sqrtsoftplus", selection_bias=True, scaling=cfg.routed_scaling_factor),
        norm_topk_prob=True,
        clamped_glu=ClampedGLU(alpha=1.0, limit=cfg.swiglu_limit, offset=0.0),
        shared_clamped=True,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_sqrtsoftplus_router(name: str, dtype: torch.dtype) -> None:
    cfg = _cfg(CASES[name])
    spec = _spec(cfg)
    gen = torch.Generator().manual_seed(1)
    router = dsv4.DeepseekV4TopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=gen) * 0.5)
    y = torch.randn(64, H, generator=gen).to(dtype).float()  # the replay's router reads float32
    logits_t, weights_t, idx_t = router(y)
    r = route(spec, router.weight.detach(), y, router.e_score_correction_bias)
    order_t, order_r = idx_t.sort(-1), r.topk_NK.sort(-1)
    assert torch.equal(order_t.values, order_r.values)
    w_t = weights_t.gather(1, order_t.indices)
    w_r = r.combine_NK.gather(1, order_r.indices)
    assert _rel(w_r, w_t) < 1e-6
    # the bias decides: without it another set is chosen for some token
    plain = torch.nn.functional.softplus(logits_t).sqrt().topk(cfg.num_experts_per_tok).indices.sort(-1).values
    assert not torch.equal(plain, order_r.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_hash_router(name: str, dtype: torch.dtype) -> None:
    cfg = _cfg(CASES[name])
    spec = _spec(cfg)
    gen = torch.Generator().manual_seed(2)
    router = dsv4.DeepseekV4HashRouter(cfg)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.tid2eid.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(cfg.vocab_size)]))
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
    y = torch.randn(64, H, generator=gen).to(dtype).float()
    _, weights_t, idx_t = router(y, tokens)
    r = hash_route(spec, router.weight.detach(), y, router.tid2eid[tokens.reshape(-1)])
    assert torch.equal(r.topk_NK, idx_t)
    assert _rel(r.combine_NK, weights_t) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_clamped_shared_expert(name: str, dtype: torch.dtype) -> None:
    cfg = _cfg(CASES[name])
    spec = _spec(cfg)
    gen = torch.Generator().manual_seed(3)
    mlp = dsv4.DeepseekV4MLP(cfg)
    with torch.no_grad():
        for w in mlp.parameters():
            w.copy_(torch.randn(w.shape, generator=gen))
    mlp = mlp.to(dtype)
    y = torch.randn(40, H, generator=gen).to(dtype)
    p = {"shared_w1": mlp.gate_proj.weight, "shared_w3": mlp.up_proj.weight, "shared_w2": mlp.down_proj.weight}
    out_r = shared_expert(spec, p, y)
    assert out_r.dtype == dtype
    assert _rel(out_r, mlp(y)) < 1e-6
    # the clamp bites: the unclamped SwiGLU differs
    assert _rel(shared_expert(spec.revised(shared_clamped=False), p, y), mlp(y)) > 1e-2


def test_sqrtsoftplus_gate_receipts_keep_their_own_units() -> None:
    """The √softplus gate's receipts (the lead's decision, docs/decisions.md): margins on the
    selection scores √softplus(W_r y) + b in the gate's own units (the η grid unscaled), the
    gate note naming √softplus, not σ or softmax, and saying the units are not comparable."""
    from moeaudit.receipts.boundary import eta_scale
    from moeaudit.receipts.gate import gate_note

    spec = _spec(_cfg(CASES["top2-of-8-scaled-1.5"]))
    assert eta_scale(spec) == 1.0
    note = gate_note(spec)
    assert note is not None and not note["bias_free_linear"]
    text = " ".join([note["why"], *note["changed"], *note["not_certified"]])
    assert "√softplus(W_r y) + b" in text and "in √softplus units, not comparable" in text
    assert "ρ = √softplus(s)/Σ√softplus(s) on the unbiased scores" in text
    assert "σ(" not in text and "softmax(W_r y) + b" not in text
    assert any("Gaussian boundary-mass closed form" in s for s in note["not_certified"])
    plain = gate_note(spec.revised(gate=Gate(scoring="sqrtsoftplus")))
    assert plain is not None and "√softplus combine weights √softplus(W_r y)" in plain["why"]
