"""The live monitors' metrics (docs/monitors.md): values on a routing small enough to do by hand,
equality with a transcription of the upstream code (Megatron-Core's ``build_router_diagnostics``
+ ``layer-router-health``; NeMo AutoModel's ``load_balance_metrics``) on random routings, and
the roll-ups the terminal and the HTML show."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from moeaudit.receipts.deferred import resolve
from moeaudit.receipts.monitors import megatron_health, monitors_pending, nemo_load_balance
from moeaudit.receipts.occupancy import counts, occupancy
from moeaudit.report import monitors as rollup

# E = 4, k = 2, two windows of two tokens (by hand below)
RHO = torch.tensor(
    [
        [0.4, 0.3, 0.2, 0.1],  # top-2 {0, 1}: (0.3 − 0.2)/0.3 = 1/3
        [0.1, 0.2, 0.3, 0.4],  # {3, 2}: 1/3
        [0.5, 0.1, 0.3, 0.1],  # {0, 2}: (0.3 − 0.1)/0.3 = 2/3
        [0.1, 0.6, 0.2, 0.1],  # {1, 2}: (0.2 − 0.1)/0.2 = 1/2
    ],
    dtype=torch.float64,
)
TOPK = torch.tensor([[0, 1], [3, 2], [0, 2], [1, 2]])


def _values(d: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()}


def test_megatron_health_by_hand() -> None:
    m = _values(megatron_health(RHO, TOPK, 2))
    # window 0: loads and mean scores uniform → loss 1, imbalances 0, margin 1/3
    # window 1: aux load (1/4, 1/4, 1/2, 0), mean score (0.3, 0.35, 0.25, 0.1)
    #   loss 4·(0.075 + 0.0875 + 0.125) = 1.15; assignment 4·(2·0.25²) = 0.5;
    #   score 4·(0.05² + 0.1² + 0.15²) = 0.14; margin (2/3 + 1/2)/2 = 7/12
    want = {
        "seq-loss": (1.0 + 1.15) / 2,
        "seq-assignment-imbalance": 0.25,
        "seq-score-imbalance": 0.07,
        # pooled: load (2, 2, 3, 1)/8, score (0.275, 0.3, 0.25, 0.175)
        "global-batch-loss": 4 * (0.25 * 0.275 + 0.25 * 0.3 + 0.375 * 0.25 + 0.125 * 0.175),
        "seq-global-loss-gap": 1.075 - 1.0375,
        "global-aux-max-over-mean": 1.5,
        "global-actual-imbalance": 4 * (2 * 0.125**2),
        "global-actual-max-over-mean": 1.5,
        "topk-boundary-relative-margin": (1 / 3 + 7 / 12) / 2,
    }
    assert m == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_a_biased_dispatch_changes_only_the_actual_side() -> None:
    dispatched = TOPK.clone()
    dispatched[3] = torch.tensor([1, 3])  # a selection bias moved token 3's second expert
    m = resolve(monitors_pending(RHO.float(), dispatched, 2))["megatron"]
    unbiased = _values(megatron_health(RHO, TOPK, 2))
    for name in ("seq-loss", "seq-assignment-imbalance", "global-batch-loss", "topk-boundary-relative-margin"):
        assert m[name] == pytest.approx(unbiased[name], rel=1e-6), name  # aux map: top-k of ρ
    assert m["global-actual-imbalance"] == pytest.approx(0.0, abs=1e-12)  # counts (2, 2, 2, 2)
    assert m["global-actual-max-over-mean"] == pytest.approx(1.0)
    assert m["topk-overlap-mean"] == pytest.approx((1.0 + 3 / 4) / 2)


def test_nemo_by_hand() -> None:
    n = _values(nemo_load_balance(torch.tensor([2, 2, 3, 1])))
    p = [0.25, 0.25, 0.375, 0.125]
    assert n == pytest.approx(
        {
            "cv": math.sqrt(2 / 3) / 2,  # sample std (N − 1) of (2, 2, 3, 1) over the mean 2
            "dead_expert_frac": 0.0,
            "expert_diversity": math.exp(-sum(x * math.log(x) for x in p)) / 4,
            "utilization_min": 0.5,
            "utilization_max": 1.5,
        },
        rel=1e-12,
    )
    dead = _values(nemo_load_balance(torch.tensor([4, 0, 0, 0])))
    assert dead["dead_expert_frac"] == 0.75 and dead["expert_diversity"] == pytest.approx(0.25)


# --- the upstream code, transcribed (float32 as upstream computes) ---------------------------------


def _megatron_upstream(scores: torch.Tensor, aux_map: torch.Tensor, actual_map: torch.Tensor, W: int) -> dict:
    """megatron/core/transformer/moe/router_diagnostics.py ``build_router_diagnostics`` (no
    padding) and megatron/training/tensor_metrics/router_metrics.py ``_per_sequence_statistic``
    / ``_finalize`` for one layer; token-major [N, E] reshaped as upstream's [s, b, E]
    (sequences are columns: token t of sequence b is row t·b_count + b)."""
    N, E = scores.shape
    T = N // W
    # our windows are contiguous rows; upstream's flattening is [seq_len, batch]: transpose
    s = scores.float().reshape(W, T, E).transpose(0, 1)
    aux = aux_map.reshape(W, T, E).transpose(0, 1)
    act = actual_map.reshape(W, T, E).transpose(0, 1)
    valid = torch.full((W,), float(T))
    mean_score = s.sum(0) / valid.clamp_min(1)[:, None]
    aux_c, act_c = aux.sum(0).float(), act.sum(0).float()
    aux_load = aux_c / aux_c.sum(-1, keepdim=True).clamp_min(1)
    act_load = act_c / act_c.sum(-1, keepdim=True).clamp_min(1)
    overlap = (aux & act).sum(dim=(0, 2)).float() / aux_c.sum(-1).clamp_min(1)
    floor = s.masked_fill(~aux, float("inf")).amin(-1)
    ceil = s.masked_fill(aux, float("-inf")).amax(-1)
    rel = ((floor - ceil).clamp_min(0) / floor.clamp_min(torch.finfo(torch.float32).eps)).sum(0) / T
    u = 1.0 / E

    def imb(load: torch.Tensor) -> torch.Tensor:
        return E * (load - u).square().sum(-1)

    seq_loss = (E * (aux_load * mean_score).sum(-1)).mean()
    g_score = (mean_score * valid[:, None]).sum(0)
    g_aux = (aux_load * valid[:, None]).sum(0)
    g_act = (act_load * valid[:, None]).sum(0)
    g_score, g_aux, g_act = (x / x.sum().clamp_min(1) for x in (g_score, g_aux, g_act))
    g_loss = E * (g_aux * g_score).sum()
    return {
        "seq-loss": seq_loss,
        "seq-assignment-imbalance": imb(aux_load).mean(),
        "seq-score-imbalance": imb(mean_score).mean(),
        "global-batch-loss": g_loss,
        "seq-global-loss-gap": seq_loss - g_loss,
        "global-aux-max-over-mean": g_aux.amax() * E,
        "global-actual-imbalance": imb(g_act),
        "global-actual-max-over-mean": g_act.amax() * E,
        "topk-boundary-relative-margin": rel.mean(),
        "topk-overlap-mean": overlap.mean(),
    }


def _nemo_upstream(load: torch.Tensor) -> dict:
    """nemo_automodel/components/moe/load_balance_metrics.py ``_compute_per_layer_stats`` and
    ``_compute_diversity_per_layer`` for one layer."""
    load = load.float()
    mean, std, total = load.mean(), load.std(), load.sum()
    cv = (std / mean).item() if mean > 0 else 0.0
    util = load / (total / load.shape[0])
    p = util / util.sum()
    p = p[p > 0]
    return {
        "cv": cv,
        "dead_expert_frac": (util == 0).float().mean().item(),
        "expert_diversity": math.exp(-(p * p.log()).sum().item()) / load.shape[0],
        "utilization_min": util.min().item(),
        "utilization_max": util.max().item(),
    }


def _routing(seed: int, N: int, E: int, K: int, biased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g, dtype=torch.float64) * 2
    logits[:, 0] -= 4.0  # a rarely used expert (dead on some seeds)
    rho = torch.softmax(logits, -1).float()
    select = rho + (torch.rand(E, generator=g) * 0.3 if biased else 0.0)
    return rho, select.topk(K, dim=-1).indices


@pytest.mark.parametrize("seed,E,K,biased", [(0, 8, 2, False), (1, 16, 4, True), (2, 6, 1, False), (3, 8, 2, True)])
def test_equals_the_upstream_formulas(seed: int, E: int, K: int, biased: bool) -> None:
    W, T = 4, 32
    rho, topk = _routing(seed, W * T, E, K, biased)
    got = resolve(monitors_pending(rho, topk, W))
    aux_map = torch.zeros(W * T, E, dtype=torch.bool).scatter_(1, rho.topk(K, dim=-1).indices, True)
    act_map = torch.zeros(W * T, E, dtype=torch.bool).scatter_(1, topk, True)
    want = {k: float(v) for k, v in _megatron_upstream(rho, aux_map, act_map, W).items()}
    assert got["megatron"] == pytest.approx(want, rel=2e-6, abs=1e-7)
    assert got["nemo"] == pytest.approx(_nemo_upstream(counts(topk, E)), rel=2e-6, abs=1e-7)


def test_agrees_with_the_occupancy_receipt() -> None:
    """global-actual-imbalance = CV² (population), global-actual-max-over-mean = max/mean,
    NeMo's cv = CV·√(E/(E − 1)), expert_diversity = exp(H)/E of the same counts."""
    rho, topk = _routing(4, 128, 8, 2, False)
    occ = occupancy(topk, rho)
    got = resolve(monitors_pending(rho, topk, 4))
    assert got["megatron"]["global-actual-imbalance"] == pytest.approx(occ["cv"] ** 2, rel=1e-12)
    assert got["megatron"]["global-actual-max-over-mean"] == pytest.approx(occ["imbalance"], rel=1e-12)
    assert got["nemo"]["cv"] == pytest.approx(occ["cv"] * math.sqrt(8 / 7), rel=1e-12)
    assert got["nemo"]["expert_diversity"] == pytest.approx(math.exp(occ["entropy"]) / 8, rel=1e-12)


def test_every_expert_active_has_no_metrics() -> None:
    rho, _ = _routing(5, 16, 2, 2, False)
    assert "reason" in resolve(monitors_pending(rho, rho.topk(2, dim=-1).indices, 2))


# --- roll-ups ----------------------------------------------------------------------------------------

LAYERS = [
    {"layer": L, "monitors": {"megatron": {"seq-loss": s, "topk-boundary-relative-margin": m}, "nemo": {"cv": c}}}
    for L, s, m, c in [(0, 1.0, 0.4, 0.1), (1, 1.2, 0.1, 0.3), (3, 1.1, 0.3, None), (5, 1.5, 0.2, 0.2)]
]


def test_rollups_quantiles_and_worst_layer() -> None:
    rows = {r["metric"]: r for r in rollup.rollups(LAYERS)}
    loss = rows["seq-loss"]  # sorted 1.0, 1.1, 1.2, 1.5: linear interpolation at q·3
    assert loss["p50"] == pytest.approx(1.15)
    assert loss["p90"] == pytest.approx(1.2 + 0.7 * 0.3)
    assert loss["p95"] == pytest.approx(1.2 + 0.85 * 0.3)
    assert (loss["worst"], loss["worst_layer"]) == (1.5, 5)
    margin = rows["topk-boundary-relative-margin"]  # lowest is worst: the (1 − q) quantiles
    assert margin["p50"] == pytest.approx(0.25)
    assert margin["p90"] == pytest.approx(0.1 + 0.3 * 0.1)
    assert (margin["worst"], margin["worst_layer"], margin["worst_is"]) == (0.1, 1, "lowest")
    assert rows["cv"]["worst_layer"] == 1 and rows["cv"]["p50"] == pytest.approx(0.2)  # a None skipped


def test_rollup_quantile_is_torch_quantile() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.55]
    for q in (0.5, 0.9, 0.95):
        assert rollup.quantile(values, q) == pytest.approx(float(torch.quantile(torch.tensor(values), q)), rel=1e-6)


def test_dashboard_scalars() -> None:
    m = rollup.megatron_scalars(LAYERS)
    tag = "tensor-metrics/layer-router-health/"
    assert m[f"{tag}global/seq-loss"] == pytest.approx(4.8 / 4)
    assert m[f"{tag}worst-layer/seq-loss"] == 1.5
    assert m[f"{tag}worst-layer/topk-boundary-relative-margin"] == 0.1  # upstream: amin for the margin
    n = rollup.nemo_scalars(
        [
            {"layer": i, "monitors": {"nemo": {"cv": c, "dead_expert_frac": 0.0, "expert_diversity": d}}}
            for i, c, d in [(0, 0.1, 0.9), (1, 0.3, 0.8), (2, 0.2, 0.95)]
        ]
    )
    assert n["moe/cv_median"] == statistics.median([0.1, 0.3, 0.2]) and n["moe/cv_max"] == 0.3
    assert n["moe/expert_diversity_min"] == 0.8


def test_relabelling_experts_changes_nothing() -> None:
    """Every monitor metric is label-free: a consistent permutation of the experts leaves it."""
    rho, topk = _routing(6, 64, 8, 2, True)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    inverse = torch.argsort(perm)  # expert e is column inverse[e] after relabelling
    got = resolve(monitors_pending(rho[:, perm], inverse[topk], 4))
    want = resolve(monitors_pending(rho, topk, 4))
    for source in ("megatron", "nemo"):
        assert got[source] == pytest.approx(want[source], rel=1e-12), source


def _nemo_utilization_upstream(loads: list[torch.Tensor]) -> dict[str, float]:
    """load_balance_metrics.py ``_compute_utilization_aggregates`` (per_layer=False)."""
    all_ratios: list[float] = []
    for load in loads:
        load = load.float()
        util = load / (load.sum() / load.shape[0])
        all_ratios.extend(util.tolist())
    s, n = sorted(all_ratios), len(all_ratios)
    return {
        "moe/expert_utilization_p25": s[n // 4] if n >= 4 else s[0],
        "moe/expert_utilization_median": statistics.median(all_ratios),
        "moe/expert_utilization_p75": s[3 * n // 4] if n >= 4 else s[-1],
        "moe/expert_utilization_min": s[0],
        "moe/expert_utilization_max": s[-1],
    }


def test_nemo_pooled_utilization() -> None:
    # by hand: loads (2, 2, 3, 1) and (1, 3) → ratios 1, 1, 1.5, 0.5, 0.5, 1.5; sorted
    # 0.5 0.5 1 1 1.5 1.5: p25 = s[1] = 0.5, median 1, p75 = s[4] = 1.5
    got = rollup.nemo_utilization([[2, 2, 3, 1], [1, 3]])
    assert got == {
        "moe/expert_utilization_p25": 0.5,
        "moe/expert_utilization_median": 1.0,
        "moe/expert_utilization_p75": 1.5,
        "moe/expert_utilization_min": 0.5,
        "moe/expert_utilization_max": 1.5,
    }
    g = torch.Generator().manual_seed(7)
    loads = [torch.randint(0, 50, (8,), generator=g) for _ in range(5)]
    pi = [(x.double() / 640).tolist() for x in loads]  # any per-layer scale: π as in the heatmap
    assert rollup.nemo_utilization(pi) == pytest.approx(_nemo_utilization_upstream(loads), rel=1e-6)
