"""The dense MLPs and one routed expert's MLP: SwiGLU, ReLU², gpt-oss's and Step 3.5's clamped GLUs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeaudit.spec.config import ClampedGLU, ModelSpec


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def relu2_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's non-gated MLP: W2 relu(W1 x)² (transformers' ``relu2`` activation)."""
    return F.linear(torch.square(F.relu(F.linear(x, w1))), w2)


def mlp(spec: ModelSpec, p: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """A dense MLP (``mlp_``) or shared expert (``shared_``) of the family's kind; on a layer
    with a clamp after the activation (Step 3.5 ``swiglu_limits_shared``, ``spec.mlp_glu_limit``),
    W2(min(silu(W1 x), L) ⊙ clamp(W3 x, ±L)) as Step3p7MLP."""
    if spec.mlp_act == "relu2":
        return relu2_mlp(x, p[prefix + "w1"], p[prefix + "w2"])
    if limit := spec.mlp_glu_limit(layer):
        gate = F.silu(F.linear(x, p[prefix + "w1"])).clamp(max=limit)
        return F.linear(gate * F.linear(x, p[prefix + "w3"]).clamp(-limit, limit), p[prefix + "w2"])
    return swiglu(x, p[prefix + "w1"], p[prefix + "w3"], p[prefix + "w2"])


def clamped_glu(glu: ClampedGLU, a1: torch.Tensor, a3: torch.Tensor) -> torch.Tensor:
    """gpt-oss: (clamp(up, ±limit) + 1) ⊙ g σ(α g), g = min(gate, limit); with ``glu.after``
    (Step 3.5): (clamp(up, ±limit) + offset) ⊙ min(silu(gate), limit)."""
    if glu.after:
        assert glu.alpha == 1.0  # silu, as transformers' act_fn
        return (a3.clamp(-glu.limit, glu.limit) + glu.offset) * F.silu(a1).clamp(max=glu.limit)
    g = a1.clamp(max=glu.limit)
    return (a3.clamp(-glu.limit, glu.limit) + glu.offset) * (g * torch.sigmoid(glu.alpha * g))


def expert_mlp(w: dict[str, torch.Tensor], x: torch.Tensor, glu: ClampedGLU | None = None) -> torch.Tensor:
    """One routed expert's output u(x): SwiGLU, Nemotron-H's ReLU² (no ``w3``), or gpt-oss's
    biased clamped GLU; an expert without weights is a zero-computation expert, u(x) = x (LongCat)."""
    if not w:
        return x
    if "w3" not in w:
        return relu2_mlp(x, w["w1"], w["w2"])
    if glu is None:
        return swiglu(x, w["w1"], w["w3"], w["w2"])
    h = clamped_glu(glu, F.linear(x, w["w1"], w.get("b1")), F.linear(x, w["w3"], w.get("b3")))
    return F.linear(h, w["w2"], w.get("b2"))
