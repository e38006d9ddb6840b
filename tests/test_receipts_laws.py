"""Laws the receipts must obey whatever the checkpoint (docs/glossary.md; `003` §5, Eq. 18–32).

* a checkpoint compared with itself: the four exact drifts are exactly 0 and r_ex = τ;
* relabelling experts consistently changes no label-free receipt (NLL, occupancy multiset, C2);
* smin_β / smax_β bracket min / max within ln(n)/β and converge to them (`003` Eq. 18–19);
* JS divergence lies in [0, ln 2], is symmetric and vanishes on equal distributions;
* occupancy numbers on a handmade top-k tensor equal the hand computation (`003` Eq. 16–17);
* window-bootstrap intervals are seeded and contain the point estimate of mean receipts;
* `moeaudit receipts` writes the same bytes twice (docs/glossary.md, "Replay": determinism).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.cli import cli
from moeaudit.margins import smax, smin
from moeaudit.policy import Policy
from moeaudit.receipts.bootstrap import WindowBootstrap
from moeaudit.receipts.occupancy import active_sets, js_divergence, occupancy
from moeaudit.receipts.state import state_receipts
from moeaudit.replay import replay

pytest.importorskip("transformers")

VOCAB = 96  # hfmodels.VOCAB
ROUTER = "model.layers.{layer}.block_sparse_moe.gate.weight"
EXPERT = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
DRIFTS = ("coordinate", "boundary", "transition", "content")


# ----- helpers ---------------------------------------------------------------------------


def rewrite(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a checkpoint directory and edit its tensors in place."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})
    return dst


def make_canary(path: Path, *, windows: int = 8, length: int = 16, seed: int = 3) -> Path:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (windows, length), generator=g, dtype=torch.int32)
    domains = torch.arange(windows, dtype=torch.int32) % 2
    canary_mod.save(canary_mod.Canary(tokens, domains, ("code", "prose")), path)
    return path


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stderr


@pytest.fixture()
def ckpt(hf_checkpoint, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("mixtral"), dst)
    return dst


@pytest.fixture()
def probe(tmp_path: Path) -> Path:
    return make_canary(tmp_path / "canary.safetensors")


# ----- identity laws -----------------------------------------------------------------------


def test_compare_with_itself_gives_exactly_zero_drift(ckpt: Path, probe: Path, tmp_path: Path) -> None:
    twin = tmp_path / "twin"
    shutil.copytree(ckpt, twin)  # a distinct directory with the same bytes
    out = tmp_path / "self.json"
    code, stderr = run(
        "compare",
        str(ckpt),
        str(twin),
        "--canary",
        str(probe),
        "--reference",
        str(ckpt),
        "--json",
        str(out),
    )
    assert code == 0, stderr
    doc = json.loads(out.read_text())
    tau = Policy().margins.tau
    for entry in doc["layers"]:
        for name in DRIFTS:
            assert entry["drift"][name] == 0.0, (entry["layer"], name, entry["drift"][name])
        assert entry["weights"]["router_drift"] == 0.0
        assert entry["weights"]["expert_relative_change"] == [0.0] * 4
    refinement = doc["margins"]["refinement"]
    assert refinement["exact"] == tau
    assert refinement["tau"] == tau
    assert doc["margins"]["handoff"]["exact"] == 0.0
    # `003` Eq. 27 is not zero at θ = θ̄, so the smooth margin need not equal τ.
    assert refinement["smooth"] < tau
    assert doc["base"]["nll"] == doc["candidate"]["nll"]


def _permute_experts(perms: dict[int, list[int]]) -> Callable[[dict[str, torch.Tensor]], None]:
    """New expert i is old expert perm[i]: router rows and expert tensors move together."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        for layer, perm in perms.items():
            key = ROUTER.format(layer=layer)
            t[key] = t[key][perm].contiguous()
            old = {
                (e, w): t[EXPERT.format(layer=layer, expert=e, w=w)].clone()
                for e in range(len(perm))
                for w in ("w1", "w2", "w3")
            }
            for new, src in enumerate(perm):
                for w in ("w1", "w2", "w3"):
                    t[EXPERT.format(layer=layer, expert=new, w=w)] = old[(src, w)]

    return edit


def test_relabelling_experts_changes_no_label_free_receipt(ckpt: Path, probe: Path, tmp_path: Path) -> None:
    perms = {0: [2, 0, 3, 1], 1: [3, 2, 1, 0], 2: [1, 3, 0, 2]}
    relabelled = rewrite(ckpt, tmp_path / "relabelled", _permute_experts(perms))
    canary = canary_mod.load(probe)
    a = state_receipts(Checkpoint(ckpt), canary)
    b = state_receipts(Checkpoint(relabelled), canary)
    assert abs(a["nll"] - b["nll"]) <= 1e-6
    moved = False
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        perm = perms[la["layer"]]
        oa, ob = la["occupancy"], lb["occupancy"]
        assert sorted(oa["counts"]) == sorted(ob["counts"])
        assert ob["counts"] == [oa["counts"][src] for src in perm]  # and they moved with the labels
        moved |= oa["counts"] != ob["counts"]
        for name in ("pi_min", "dead", "cv", "entropy_norm"):
            assert ob[name] == pytest.approx(oa[name], abs=1e-12)
        assert lb["overlap"]["c2"] == pytest.approx(la["overlap"]["c2"], abs=1e-6)
        assert lb["overlap"]["c2_smooth"] == pytest.approx(la["overlap"]["c2_smooth"], abs=1e-6)
        assert lb["boundary"]["margin_mean"] == pytest.approx(la["boundary"]["margin_mean"], abs=1e-6)
        ga, gb = la["gradients"]["grad_norms"], lb["gradients"]["grad_norms"]
        assert gb == pytest.approx([ga[src] for src in perm], rel=1e-4)
    assert moved, "the permutation should move at least one layer's counts"


# ----- smin / smax (`003` Eq. 18–19) --------------------------------------------------------

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)
betas = st.floats(min_value=1e-2, max_value=1e4, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(finite, min_size=1, max_size=40), beta=betas)
def test_smin_smax_bracket_min_max(values: list[float], beta: float) -> None:
    n, lo, hi = len(values), min(values), max(values)
    slack = 1e-12 * (1.0 + abs(lo) + abs(hi))  # rounding of the subtraction only
    s_min, s_max = smin(values, beta), smax(values, beta)
    assert s_min <= lo <= s_min + math.log(n) / beta + slack
    assert hi <= s_max <= hi + math.log(n) / beta + slack


@settings(max_examples=100, deadline=None)
@given(values=st.lists(finite, min_size=1, max_size=40))
def test_smin_smax_converge_as_beta_grows(values: list[float]) -> None:
    lo, hi = min(values), max(values)
    gaps_min = [lo - smin(values, b) for b in (1.0, 10.0, 1e2, 1e4, 1e6)]
    gaps_max = [smax(values, b) - hi for b in (1.0, 10.0, 1e2, 1e4, 1e6)]
    for gaps in (gaps_min, gaps_max):
        assert all(g >= 0 for g in gaps)
        assert all(later <= earlier + 1e-12 for earlier, later in zip(gaps, gaps[1:], strict=False))
        assert gaps[-1] <= math.log(len(values)) / 1e6 + 1e-9


def test_smin_of_equal_values_is_shifted_by_exactly_log_n_over_beta() -> None:
    assert smin([0.3] * 8, 50.0) == pytest.approx(0.3 - math.log(8) / 50.0, abs=1e-15)
    assert smax([0.3] * 8, 50.0) == pytest.approx(0.3 + math.log(8) / 50.0, abs=1e-15)


# ----- Jensen–Shannon divergence ---------------------------------------------------------

weights = st.lists(st.floats(min_value=0.0, max_value=1.0, allow_nan=False), min_size=2, max_size=16)


def _distribution(w: list[float]) -> torch.Tensor:
    t = torch.tensor(w, dtype=torch.float64)
    if float(t.sum()) == 0.0:
        t[0] = 1.0
    return t / t.sum()


@settings(max_examples=300, deadline=None)
@given(data=st.data(), w=weights)
def test_js_divergence_is_bounded_symmetric_and_zero_on_equal(data: st.DataObject, w: list[float]) -> None:
    p = _distribution(w)
    q = _distribution(data.draw(st.lists(st.floats(0.0, 1.0), min_size=len(w), max_size=len(w))))
    js = float(js_divergence(p, q))
    assert 0.0 <= js <= math.log(2) + 1e-12
    assert float(js_divergence(q, p)) == js
    assert float(js_divergence(p, p)) == 0.0
    assert float(js_divergence(p, p.clone())) == 0.0


def test_js_divergence_of_disjoint_supports_is_ln2_and_batches() -> None:
    p = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    js = js_divergence(p, q)
    assert js.shape == (2,)
    assert float(js[0]) == pytest.approx(math.log(2), abs=1e-15)
    assert float(js[1]) == 0.0


# ----- occupancy (`003` Eq. 16–17) --------------------------------------------------------


def test_occupancy_matches_hand_computation() -> None:
    # N = 6 tokens, k = 2, E = 4; expert 3 is never chosen.
    topk = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0], [2, 0], [0, 1]])
    probs = torch.softmax(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    occ = occupancy(topk, probs)
    assert occ["counts"] == [6, 4, 2, 0]
    assert sum(occ["counts"]) == 2 * 6
    assert occ["pi"] == pytest.approx([1.0, 4 / 6, 2 / 6, 0.0])
    assert occ["pi_min"] == 0.0
    assert occ["dead"] == 1
    assert occ["cv"] == pytest.approx(math.sqrt(5) / 3)  # population std √((9+1+1+9)/4) over mean 3
    assert occ["imbalance"] == pytest.approx(2.0)
    p = [6 / 12, 4 / 12, 2 / 12]
    entropy = -sum(x * math.log(x) for x in p)
    assert occ["entropy"] == pytest.approx(entropy)
    assert occ["entropy_norm"] == pytest.approx(entropy / math.log(4))
    assert occ["pi_smooth"] == pytest.approx(probs.double().mean(0).tolist())
    sets = occ["active_sets"]  # {0,1} four times, {0,2} twice
    assert sets["distinct"] == 2
    assert sets["entropy"] == pytest.approx(-(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3))
    assert sets["top10_mass"] == pytest.approx(1.0)


def test_occupancy_of_uniform_load_has_unit_entropy_and_no_spread() -> None:
    E, k = 8, 2
    topk = torch.stack([torch.arange(E), torch.arange(E).roll(1)], dim=1).repeat(5, 1)  # N = 40
    occ = occupancy(topk, torch.full((topk.shape[0], E), 1.0 / E))
    assert occ["counts"] == [k * 5] * E
    assert occ["entropy_norm"] == pytest.approx(1.0, abs=1e-12)
    assert occ["cv"] == 0.0 and occ["imbalance"] == 1.0 and occ["dead"] == 0
    assert occ["pi_min"] == pytest.approx(k / E)


def test_active_sets_ignore_order_within_a_set() -> None:
    assert active_sets(torch.tensor([[0, 1], [1, 0], [2, 3]]))["distinct"] == 2


# ----- window bootstrap -------------------------------------------------------------------


def test_window_bootstrap_is_seeded() -> None:
    values = torch.randn(10 * 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, b = WindowBootstrap(10, 500, seed=7), WindowBootstrap(10, 500, seed=7)
    assert a.mean(values) == b.mean(values)
    assert WindowBootstrap(10, 500, seed=8).mean(values) != a.mean(values)
    lo, hi = a.mean(values)
    assert lo <= float(values.mean()) <= hi
    assert WindowBootstrap(10, 0, seed=7).mean(values) is None  # bootstrap = 0 disables


def _mean_type(layer: dict[str, Any]) -> list[tuple[str, float | None, list[float] | None]]:
    b, o = layer["boundary"], layer["overlap"]
    rows = [
        ("margin_mean", b["margin_mean"], b["ci95"]["margin_mean"]),
        ("flip_rate", b["flip_rate"], b["ci95"]["flip_rate"]),
    ]
    rows += [
        (f"boundary_mass[{eta}]", b["boundary_mass"][eta], b["ci95"]["boundary_mass"][eta])
        for eta in b["boundary_mass"]
    ]
    rows += [
        ("c2", o["c2"], o["ci95"]["c2"]),
        ("c2_smooth", o["c2_smooth"], o["ci95"]["c2_smooth"]),
        ("adjacency_specificity", o["adjacency_specificity"], o["ci95"]["adjacency_specificity"]),
        (
            "transition_all",
            o["transition_incompatibility"]["all"],
            o["ci95"]["transition_incompatibility_all"],
        ),
    ]
    return rows


def test_bootstrap_intervals_contain_mean_receipts(ckpt: Path, probe: Path) -> None:
    doc = state_receipts(Checkpoint(ckpt), canary_mod.load(probe))
    for layer in doc["layers"]:
        for name, point, ci in _mean_type(layer):
            assert ci is not None and point is not None, name
            lo, hi = ci
            slack = 1e-12 * (1.0 + abs(point))
            assert lo - slack <= point <= hi + slack, (layer["layer"], name, point, ci)


@pytest.mark.parametrize("experts", [2, 3])
def test_top_k_equal_to_experts_has_no_boundary_and_c2_over_every_pair(
    hf_checkpoint, probe: Path, experts: int
) -> None:
    """E = k (allowed by the config): no (k+1)-th score, so no margin, no transition and no
    adjacency receipt; but R_k is every expert, so the co-active pairs exist and c2 and
    c2_smooth are the means over them (`003` Eq. 20–22) — checked against a token-by-token reference
    written from the equations (`003` Eq. 10, 20–22) on the replay's own taps."""
    ckpt = Checkpoint(hf_checkpoint("mixtral", num_local_experts=experts, num_experts_per_tok=experts))
    probe_ = canary_mod.load(probe)
    taps: dict[int, tuple[torch.Tensor, ...]] = {}

    def keep(tap: Any, lw: Any) -> None:
        r = tap.routing
        taps[tap.layer] = tuple(t.detach().double().clone() for t in (tap.u_NKH, tap.z_NH, r.probs_NE, r.scores_NE))
        taps[tap.layer] += (r.topk_NK.clone(),)

    replay(ckpt, probe_.tokens, backward=False, observers=[keep])
    doc = state_receipts(ckpt, probe_)
    beta = Policy().receipts.beta_adj
    for layer in doc["layers"]:
        b, o = layer["boundary"], layer["overlap"]
        assert b["margin_mean"] is None and "E = k" in b["reason"]
        assert set(b["boundary_mass"].values()) == {0.0} and b["flip_rate"] == 0.0
        assert layer["occupancy"]["counts"] == [8 * 16] * experts
        assert o["transition_incompatibility"] is None and o["adjacency_specificity"] is None
        assert "E = k" in o["reason"]
        assert o["c2_smooth_candidates"] == experts and o["c2_smooth_truncation_mass"] == 0.0
        u, z, probs, scores, topk = taps[layer["layer"]]
        d = z.shape[1]
        c2, c2s = [], []
        for t in range(u.shape[0]):
            v = [u[t, i] - z[t] * float(u[t, i] @ z[t]) / d for i in range(experts)]
            rho = [float(probs[t, topk[t, i]]) for i in range(experts)]
            s_ = [float(scores[t, topk[t, i]]) for i in range(experts)]
            num = den = nums = dens = 0.0
            for i in range(experts):
                for j in range(experts):
                    if i != j:
                        kap = float(v[i] @ v[j]) / (float(v[i].norm()) * float(v[j].norm()) + 1e-8)
                        w, ws = rho[i] * rho[j], rho[i] * rho[j] * math.exp(-beta * abs(s_[i] - s_[j]))
                        num, den, nums, dens = num + w * kap, den + w, nums + ws * kap, dens + ws
            c2.append(num / den)
            c2s.append(nums / dens)
        # the receipts form v in the replay's float32, this reference in float64: κ ∈ [−1, 1]
        # differs by float32 rounding (measured ≤ 6e-10 here), far below any change of weighting
        assert o["c2"] == pytest.approx(sum(c2) / len(c2), rel=0, abs=1e-8)
        assert o["c2_smooth"] == pytest.approx(sum(c2s) / len(c2s), rel=0, abs=1e-8)
        if experts > 2:  # one pair per token at k = 2: any weights give its κ; at k = 3 they matter
            assert o["c2"] != pytest.approx(o["c2_smooth"], rel=0, abs=1e-8)
        lo, hi = o["ci95"]["c2"]
        assert lo <= o["c2"] <= hi and o["c2_excluded_tokens"] == 0


@pytest.mark.parametrize("experts", [3, 4])
def test_one_expert_outside_the_active_set_has_adjacency_specificity_exactly_zero(
    hf_checkpoint, probe: Path, experts: int
) -> None:
    """E = k + 1: the random expert outside R_k can only be e(k+1), so κ(e(k), e_rand) −
    κ(e(k), e(k+1)) is 0 on every token by definition (`003` Table 2) — exactly, not the last bits
    of two separately batched expert products; the other overlap receipts are read as usual."""
    ckpt = Checkpoint(hf_checkpoint("mixtral", num_local_experts=experts, num_experts_per_tok=experts - 1))
    doc = state_receipts(ckpt, canary_mod.load(probe))
    for layer in doc["layers"]:
        o = layer["overlap"]
        assert o["adjacency_specificity"] == 0.0 and o["ci95"]["adjacency_specificity"] == [0.0, 0.0]
        assert o["c2"] is not None and o["transition_incompatibility"]["all"] > 0


# ----- determinism ------------------------------------------------------------------------


def test_receipts_json_is_byte_identical_across_runs(ckpt: Path, probe: Path, tmp_path: Path) -> None:
    outs = [tmp_path / "r1.json", tmp_path / "r2.json"]
    for out in outs:
        code, stderr = run("receipts", str(ckpt), "--canary", str(probe), "--json", str(out))
        assert code == 0, stderr
    assert outs[0].read_bytes() == outs[1].read_bytes()
    doc = json.loads(outs[0].read_text())
    assert doc["schema"] == "moeaudit.receipts/v1"
    for layer in doc["layers"]:
        occ = layer["occupancy"]
        assert sum(occ["counts"]) == doc["checkpoint"]["top_k"] * 8 * 16  # k·N, N = W·T


@pytest.mark.parametrize("run", ["healthy", "resume", "deepseek"])  # mixtral, qwen2_moe, MLA
def test_backward_through_scalar_roots_is_bit_identical(monkeypatch, run: str) -> None:
    """``backward_from`` (Σ root ⊙ grad, to skip torch's sympy import) gives exactly the
    gradients of ``torch.autograd.backward(roots, grads)``, shared expert and MLA included."""
    from moeaudit.replay import engine, head, replay

    samples = Path(__file__).resolve().parent.parent / "sample_checkpoints"
    ckpt = Checkpoint(sorted((samples / run).glob("checkpoint-1500"))[0])
    tokens = canary_mod.load(samples / "canary.safetensors").tokens[:6]
    ours = replay(ckpt, tokens)

    def plain(roots, grads):
        torch.autograd.backward(list(roots), list(grads))

    for module in (engine, head):  # the layers' backward and the LM head's
        monkeypatch.setattr(module, "backward_from", plain)
    ref = replay(ckpt, tokens)
    assert ours.grads.keys() == ref.grads.keys() and ours.grads
    for layer, g in ours.grads.items():
        r = ref.grads[layer]
        assert torch.equal(g.experts_E, r.experts_E), layer
        assert (g.router, g.shared, g.attention) == (r.router, r.shared, r.attention), layer
