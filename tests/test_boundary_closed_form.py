"""Boundary mass against its closed form (`002` Remark 3.3, Example 3.8).

The checkpoint is a real Mixtral layout built so that the gate input has a known law: one
decoder layer, attention output zeroed (o_proj = 0, so h = the embedding row exactly),
embedding rows i.i.d. N(0, I_d), MoE gain γ = 1. Then y = z = h / rms(h) and z/√d is
*exactly* uniform on the unit sphere S^{d−1}. With router rows whose score difference is a
linear form a·z, the selection margin is m = |a·z| and the boundary mass is the probability of
the slab {|a·z| < η} around the interface a·z = 0 (`002` Remark 3.3):

    B(η) = P(|t| < η / (√d ‖a‖)),   t = â·u,  (t + 1)/2 ~ Beta((d−1)/2, (d−1)/2),

computed here by quadrature of cos^{d−2} (t = sin φ). As d grows, √d·t → N(0, 1) and B(η) →
2Φ(η/‖a‖) − 1, the Gaussian slab of Example 3.8 (3.11).

The canary visits every vocabulary row exactly once (V = W·T = 4096 tokens, the first token of
every window included), so the receipt is the empirical slab mass of 4096 i.i.d. draws: it must
match (1) the same fraction computed here from the embedding matrix, to within a token at the
threshold, and (2) the closed form, to within 4 binomial standard errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint
from moeaudit.policy import Policy, ReceiptSettings
from moeaudit.receipts.state import state_receipts

pytest.importorskip("transformers")

V, W, T = 4096, 64, 64
A_NORM = 0.5  # ‖a‖: puts B(η) between ~0.01 and ~1 over the policy's η grid (docs/policy.md, "boundary_etas")
EPS = 1e-5  # Mixtral rms_norm_eps
NO_BOOTSTRAP = Policy(receipts=ReceiptSettings(bootstrap=0))


@dataclass(frozen=True)
class Case:
    name: str
    d: int  # hidden size
    experts: int
    top_k: int


CASES = [
    Case("top1-of-2-d4", d=4, experts=2, top_k=1),  # far from Gaussian: the sphere law matters
    Case("top1-of-2-d16", d=16, experts=2, top_k=1),
    Case("top2-of-3-d8", d=8, experts=3, top_k=2),
    Case("top1-of-2-d64", d=64, experts=2, top_k=1),  # near the Gaussian limit
]


def router_rows(case: Case, a: torch.Tensor) -> torch.Tensor:
    """Rows whose selection margin is exactly |a·y|.

    top-1 of 2: w = (a/2, −a/2), so s_(1) − s_(2) = |a·y|. top-2 of 3: w = (0, a, −a), scores
    (0, a·y, −a·y) sorted (|a·y|, 0, −|a·y|), so s_(2) − s_(3) = |a·y|, and expert 0 is always
    active.
    """
    if case.top_k == 1:
        return torch.stack([a / 2, -a / 2])
    return torch.stack([torch.zeros_like(a), a, -a])


@dataclass(frozen=True)
class Built:
    path: Path
    embed: torch.Tensor  # [V, d]
    a: torch.Tensor  # score-difference direction (float32-rounded, as stored)


def build(root: Path, case: Case, seed: int = 0) -> Built:
    from hfmodels import save_tiny

    save_tiny(
        root,
        "mixtral",
        vocab_size=V,
        hidden_size=case.d,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        num_local_experts=case.experts,
        num_experts_per_tok=case.top_k,
        intermediate_size=8,
        rms_norm_eps=EPS,
    )
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, case.d, generator=g)
    direction = torch.randn(case.d, generator=g, dtype=torch.float64)
    a = (A_NORM * direction / direction.norm()).float()
    weights = root / "model.safetensors"
    t = load_file(weights)
    t["model.embed_tokens.weight"] = embed
    t["model.layers.0.self_attn.o_proj.weight"] = torch.zeros_like(t["model.layers.0.self_attn.o_proj.weight"])
    t["model.layers.0.post_attention_layernorm.weight"] = torch.ones(case.d)
    t["model.layers.0.block_sparse_moe.gate.weight"] = router_rows(case, a).contiguous()
    save_file(t, weights, metadata={"format": "pt"})
    return Built(root, embed, a)


def every_row_once(seed: int = 1) -> Canary:
    order = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
    return Canary(order.view(W, T).to(torch.int32), torch.arange(W, dtype=torch.int32) % 2, ("even", "odd"))


def sphere_slab(c: float, d: int, steps: int = 4000) -> float:
    """P(|t| < c) for t the first coordinate of a uniform point on S^{d−1}.

    The density of t is (1 − t²)^{(d−3)/2} / B(1/2, (d−1)/2); with t = sin φ the integrand is
    cos^{d−2} φ, smooth on [0, arcsin c], so composite Simpson is accurate to ~1e-12.
    """
    if c >= 1.0:
        return 1.0
    log_norm = math.lgamma(d / 2) - math.lgamma(0.5) - math.lgamma((d - 1) / 2)
    top = math.asin(c)
    h = top / steps
    total = sum((1 if i in (0, steps) else 4 if i % 2 else 2) * math.cos(i * h) ** (d - 2) for i in range(steps + 1))
    return min(1.0, 2.0 * math.exp(log_norm) * total * h / 3.0)


def gaussian_slab(eta: float, a_norm: float) -> float:
    """`002` Example 3.8 (3.11) with b = 0: P(|a·x| < η) = 2Φ(η/‖a‖) − 1 for x ~ N(0, I)."""
    return math.erf(eta / (a_norm * math.sqrt(2.0)))


def expected_mass(eta: float, d: int, a_norm: float) -> float:
    return sphere_slab(eta / (math.sqrt(d) * a_norm), d)


def direct_margins(built: Built) -> torch.Tensor:
    """|a·z| for every vocabulary row, in float64 from the stored tensors."""
    e = built.embed.double()
    z = e / (e.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
    return (z @ built.a.double()).abs()


BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def measure(tmp_path_factory: pytest.TempPathFactory):
    """``measure(case) -> (built, receipts)``, built and replayed once per module."""
    cache: dict[str, tuple[Built, dict]] = {}

    def get(case: Case) -> tuple[Built, dict]:
        if case.name not in cache:
            built = build(tmp_path_factory.mktemp(case.name), case)
            cache[case.name] = (
                built,
                state_receipts(Checkpoint(built.path), every_row_once(), NO_BOOTSTRAP),
            )
        return cache[case.name]

    return get


def test_sphere_law_is_the_beta_law() -> None:
    # Sanity of the quadrature: d = 3 gives the uniform law of t (Archimedes), so P = c;
    # d = 2 gives the arcsine law, P = 2·asin(c)/π.
    assert sphere_slab(0.3, 3) == pytest.approx(0.3, abs=1e-12)
    assert sphere_slab(0.3, 2) == pytest.approx(2 * math.asin(0.3) / math.pi, abs=1e-12)
    # Large d approaches the Gaussian slab of Example 3.8.
    assert expected_mass(0.2, 4000, A_NORM) == pytest.approx(gaussian_slab(0.2, A_NORM), abs=2e-4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_boundary_mass_matches_closed_form(measure, case: Case) -> None:
    built, doc = measure(case)
    (layer,) = doc["layers"]
    mass = layer["boundary"]["boundary_mass"]
    margins = direct_margins(built)
    assert float(built.a.double().norm()) == pytest.approx(A_NORM, rel=1e-6)
    for key, got in mass.items():
        eta = float(key)
        empirical = float((margins < eta).double().mean())
        assert abs(got - empirical) <= 2.0 / V, (case.name, eta, got, empirical)  # rounding at η
        p = expected_mass(eta, case.d, A_NORM)
        se = max(math.sqrt(p * (1.0 - p) / V), 1.0 / V)
        assert abs(got - p) <= 4.0 * se, (case.name, eta, got, p, se)
    # The margin itself is the slab coordinate: mean |a·z| = ‖a‖·√d·E|t|.
    e_abs_t = math.exp(math.lgamma(case.d / 2) - math.lgamma(0.5) - math.lgamma((case.d + 1) / 2))
    assert layer["boundary"]["margin_mean"] == pytest.approx(
        A_NORM * math.sqrt(case.d) * e_abs_t, abs=4.0 * A_NORM / math.sqrt(V)
    )


def test_sphere_law_is_distinguishable_from_gaussian_at_small_d(measure) -> None:
    """The d = 4 case would fail against the Gaussian formula: the check has teeth."""
    _, doc = measure(BY_NAME["top1-of-2-d4"])
    mass = doc["layers"][0]["boundary"]["boundary_mass"]
    p_gauss = gaussian_slab(0.5, A_NORM)
    assert abs(mass["0.5"] - p_gauss) > 6.0 * math.sqrt(p_gauss * (1 - p_gauss) / V)


def test_gaussian_limit_matches_example_3_8(measure) -> None:
    case = BY_NAME["top1-of-2-d64"]
    _, doc = measure(case)
    for key, got in doc["layers"][0]["boundary"]["boundary_mass"].items():
        eta = float(key)
        p = gaussian_slab(eta, A_NORM)
        bias = abs(expected_mass(eta, case.d, A_NORM) - p)  # O(1/d) finite-d correction
        se = max(math.sqrt(p * (1.0 - p) / V), 1.0 / V)
        assert abs(got - p) <= 4.0 * se + bias, (eta, got, p)


def test_top2_of_3_routes_expert_0_everywhere(measure) -> None:
    _, doc = measure(BY_NAME["top2-of-3-d8"])
    occ = doc["layers"][0]["occupancy"]
    assert occ["counts"][0] == V and sum(occ["counts"]) == 2 * V
    assert occ["counts"][1] == pytest.approx(V / 2, abs=4 * math.sqrt(V / 4))
    assert doc["layers"][0]["overlap"]["c2"] is not None


# ----- flip rate (`002` §7.2) -------------------------------------------------------------


def flip_law(a: torch.Tensor, router: torch.Tensor, sigma: float, draws: int = 20000) -> torch.Tensor:
    """Flip fraction for uniform z under W ← W + σ·rms(W)·G is angle(a, a + δ)/π, with
    δ = σ·rms(W)·(g_1 − g_2); its law over G (a sample of `draws` values)."""
    g = torch.Generator().manual_seed(123)
    noise = torch.randn(draws, 2, a.shape[0], generator=g, dtype=torch.float64)
    rms = router.double().pow(2).mean().sqrt()
    a = a.double()
    a_new = a + sigma * rms * (noise[:, 0] - noise[:, 1])
    cos = (a_new @ a) / (a_new.norm(dim=-1) * a.norm())
    return cos.clamp(-1, 1).acos() / math.pi


def test_flip_rate_is_zero_for_tiny_sigma_and_grows_with_sigma(measure) -> None:
    case = BY_NAME["top1-of-2-d16"]
    built, doc = measure(case)
    ckpt, canary = Checkpoint(built.path), every_row_once()
    router = router_rows(case, built.a)
    rates = {0.01: doc["layers"][0]["boundary"]["flip_rate"]}  # the default σ
    assert NO_BOOTSTRAP.receipts.flip_sigma == 0.01
    for sigma in (1e-9, 0.05, 0.2):
        policy = Policy(receipts=replace(NO_BOOTSTRAP.receipts, flip_sigma=sigma))
        rates[sigma] = state_receipts(ckpt, canary, policy)["layers"][0]["boundary"]["flip_rate"]
    assert rates[1e-9] == 0.0
    # One seeded G for every σ: the flipped sets are nested along the ray a + s·δ.
    assert rates[0.01] <= rates[0.05] < rates[0.2]
    for sigma in (0.05, 0.2):
        law = flip_law(built.a, router, sigma)
        lo, hi = (float(q) for q in torch.quantile(law, torch.tensor([0.0005, 0.9995], dtype=torch.float64)))
        se = math.sqrt(hi * (1 - hi) / V)
        assert lo - 4 * se <= rates[sigma] <= hi + 4 * se, (sigma, rates[sigma], lo, hi)
