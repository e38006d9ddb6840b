"""Gated DeltaNet (Qwen3-Next linear attention) against transformers' ``Qwen3NextGatedDeltaNet``
running its pure-torch fallbacks (chunked delta rule, F.conv1d causal conv)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import tiny_model  # noqa: E402

from moeaudit.replay.deltanet import gated_delta_rule, gated_deltanet  # noqa: E402
from moeaudit.spec.config import LinearAttention  # noqa: E402


def _params(mod) -> dict[str, torch.Tensor]:
    return {
        "lin_qkvz": mod.in_proj_qkvz.weight,
        "lin_ba": mod.in_proj_ba.weight,
        "lin_conv": mod.conv1d.weight,
        "lin_dt_bias": mod.dt_bias,
        "lin_A_log": mod.A_log,
        "lin_norm": mod.norm.weight,
        "lin_out": mod.out_proj.weight,
    }


def _la(mod) -> LinearAttention:
    return LinearAttention(mod.num_k_heads, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim, mod.conv_kernel_size)


@pytest.mark.parametrize("T", [12, 70])  # 70 > transformers' chunk of 64: two chunks
def test_deltanet_matches_transformers_forward_and_backward(T: int) -> None:
    model = tiny_model("qwen3_next")
    mod = model.model.layers[0].linear_attn
    assert model.config.layer_types[:2] == ["linear_attention", "full_attention"]
    x = torch.randn(3, T, 32, generator=torch.Generator().manual_seed(5))
    x_ref, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = mod(x_ref)
    p = {n: t.detach().clone().requires_grad_(True) for n, t in _params(mod).items()}
    got = gated_deltanet(_la(mod), p, x_ours, mod.layer_norm_epsilon)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert want.abs().mean() > 0.1  # a real signal, not a vanishing one
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for name, t in _params(mod).items():  # whole-tensor relative error (entries near 0 are noise)
        assert float((p[name].grad - t.grad).norm() / t.grad.norm()) < 1e-4, name


def test_delta_rule_recurrence_by_hand() -> None:
    """One head, d_k = d_v = 1: S_t = α S + β k (v − α S k), o_t = S_t q (q, k → ±1 by L2),
    the state carried across chunks of 2."""
    q = torch.tensor([1.0, 1.0, -1.0]).view(1, 3, 1, 1)
    k = torch.tensor([1.0, -2.0, 3.0]).view(1, 3, 1, 1)
    v = torch.tensor([2.0, 1.0, -1.0]).view(1, 3, 1, 1)
    alpha, beta = torch.tensor([0.5, 0.8, 1.0]), torch.tensor([1.0, 0.5, 0.25])
    out = gated_delta_rule(q, k, v, alpha.log().view(1, 3, 1), beta.view(1, 3, 1), chunk=2)
    S, want = 0.0, []
    for t in range(3):
        kt, qt = float(k.flatten()[t] > 0) * 2 - 1, float(q.flatten()[t] > 0) * 2 - 1
        S = alpha[t].item() * S
        S = S + beta[t].item() * kt * (v.flatten()[t].item() - S * kt)
        want.append(S * qt)
    torch.testing.assert_close(out.flatten(), torch.tensor(want), rtol=1e-5, atol=1e-5)
