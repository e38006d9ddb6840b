"""The ablation receipt (``certify --ablate``; docs/decisions.md, "Ablation receipt").

* removing an expert agrees with transformers running the same checkpoint with that expert's router
  logit at −inf (and, where the router has one, its selection bias), per canary window;
* an expert the router never chooses changes nothing when removed: ΔNLL exactly 0, interval [0, 0];
* an expert trained to carry a domain is needed: ΔNLL above 0 beyond its interval;
* certify signs the receipt, its sentences and the HTML section; the flags follow the health floors.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, tiny_model  # noqa: E402
from support.oracle import FORWARD  # noqa: E402  (the float32 agreement with transformers used elsewhere)

from moeaudit.canary import Canary  # noqa: E402
from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.judge.ablation import (  # noqa: E402
    RARELY_NEEDED,
    RARELY_UNNEEDED,
    RARELY_UNSHOWN,
    USED_NEEDED,
    assemble,
    flagged_experts,
    removals,
)
from moeaudit.policy import ReceiptSettings  # noqa: E402
from moeaudit.receipts.ablation import ablation_receipt  # noqa: E402
from moeaudit.replay.ablation import ablation_nll  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = ROOT / "tests" / "golden" / "test-signing-key.pem"


def _window_nll(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens).logits[:, :-1].float()
    return -torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0].mean(1).double()


@contextlib.contextmanager
def _hf_removed(router: torch.nn.Module, expert: int) -> Iterator[None]:
    """transformers' own router with one expert's logit at −inf: its forward runs with the one
    ``F.linear`` it calls (the router projection) returning that column at −inf; a selection bias
    (DeepSeek-V3's ``e_score_correction_bias``) is −inf there too."""
    forward, bias = router.forward, getattr(router, "e_score_correction_bias", None)
    saved = None if bias is None else bias.clone()

    def patched(*args: Any, **kwargs: Any) -> Any:
        real = F.linear

        def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            return real(x, w, b).index_fill(-1, torch.tensor([expert]), float("-inf"))

        F.linear = linear
        try:
            return forward(*args, **kwargs)
        finally:
            F.linear = real

    router.forward = patched  # type: ignore[method-assign]
    if bias is not None:
        bias[expert] = float("-inf")
    try:
        yield
    finally:
        router.forward = forward  # type: ignore[method-assign]
        if bias is not None:
            bias.copy_(saved)


ORACLE_CASES = {
    "mixtral": ("mixtral", {}),  # softmax, top-k renormalised
    "olmoe": ("olmoe", {}),  # softmax, not renormalised: the removed probability leaves the softmax
    "qwen2_moe": ("qwen2_moe", {}),  # softmax, and a gated shared expert that stays
    "deepseek_v2": ("deepseek_v2", {}),  # softmax, group-limited greedy
    "deepseek_v3": ("deepseek_v3", {"n_group": 2, "topk_group": 1}),  # sigmoid + selection bias + groups
    "glm4_moe": ("glm4_moe", {}),  # sigmoid + selection bias + groups
    "ernie4_5_moe": ("ernie4_5_moe", {}),  # softmax probabilities + a selection bias
    "gpt_oss": ("gpt_oss", {}),  # top-k of biased logits, softmax over the chosen
    "llama4_text": ("llama4_text", {}),  # top-1 of the logits, σ of the chosen
    "minimax_m2": ("minimax_m2", {}),  # sigmoid + selection bias, renormalised
    "phimoe": ("phimoe", {}),  # sparsemixer
    "granitemoe": ("granitemoe", {}),  # softmax over the top-k logits
}


def _router(layer: torch.nn.Module) -> torch.nn.Module:
    block = next(getattr(layer, n) for n in ("mlp", "block_sparse_moe", "feed_forward") if hasattr(layer, n))
    return block.gate if hasattr(block, "gate") else block.router


@pytest.mark.parametrize("case", sorted(ORACLE_CASES))
def test_removal_agrees_with_transformers(tmp_path: Path, case: str) -> None:
    family, overrides = ORACLE_CASES[case]
    model = tiny_model(family, **overrides)
    model.save_pretrained(tmp_path)
    model = load(tmp_path)
    ckpt = Checkpoint(tmp_path)
    layers = list(ckpt.spec.routed_layers)
    tokens = random_tokens(4, 12)
    E = ckpt.spec.num_experts
    ours = ablation_nll(ckpt, tokens, {layer: list(range(E)) for layer in layers})
    assert ours.layer_forwards == ckpt.spec.num_layers + sum(E * (ckpt.spec.num_layers - i) for i in layers)
    with torch.no_grad():
        torch.testing.assert_close(ours.base_W, _window_nll(model, tokens), **FORWARD)
        moved = 0.0
        for (layer, e), removed_W in ours.removed_W.items():
            with _hf_removed(_router(model.model.layers[layer]), e):
                theirs = _window_nll(model, tokens)
            torch.testing.assert_close(removed_W, theirs, **FORWARD, msg=f"{case} layer {layer} expert {e}")
            moved = max(moved, float((removed_W - ours.base_W).abs().max()))
    assert moved > 1e-3  # the removals do change the NLL: the agreement is not of two baselines


def _canary(tokens: torch.Tensor, domains: int = 1) -> Canary:
    W = tokens.shape[0]
    ids = torch.arange(W) * domains // W
    return Canary(tokens.int().numpy(), ids.int().numpy(), tuple(f"d{i}" for i in range(domains)))


def test_an_expert_never_chosen_changes_nothing(tmp_path: Path) -> None:
    """DeepSeek-V3 routing with expert 5's selection bias at −10⁴: σ + b never reaches the top-k,
    so removing it leaves every active set and combine weight as it was — ΔNLL is exactly 0 in
    every window and the interval is [0, 0]; the other experts' removals do move the NLL."""
    model = tiny_model("deepseek_v3", n_group=2, topk_group=1)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias[5] = -1e4
    model.save_pretrained(tmp_path)
    ckpt = Checkpoint(tmp_path)
    canary = _canary(random_tokens(8, 12))
    measured = ablation_receipt(ckpt, canary, ReceiptSettings(bootstrap=200), {1: [4, 5], 2: [5]})
    rows = {(r["layer"], r["expert"]): r for r in measured["experts"]}
    for key in ((1, 5), (2, 5)):
        assert rows[key]["nll_delta"] == 0.0
        assert rows[key]["ci95"] == [0.0, 0.0]
    assert abs(rows[(1, 4)]["nll_delta"]) > 1e-4
    doc = {
        "checkpoint": {"name": "c", "experts": 8, "top_k": 2},
        "layers": [
            {"layer": i, "occupancy": {"counts": [9, 9, 9, 9, 9, 0, 9, 9], "pi": [0.25] * 5 + [0.0] + [0.25] * 2}}
            for i in (1, 2)
        ],
    }
    todo, flags = removals(doc, "low-occupancy", 0.1)
    assert todo == {1: [5], 2: [5]} and flags[1] == {5: ["no token"]}
    signed = assemble(measured, flags, doc, "low-occupancy", 0.1, 7)
    readings = {(r["layer"], r["expert"]): r["reading"] for r in signed["experts"]}
    assert readings[(1, 5)] == readings[(2, 5)] == RARELY_UNNEEDED
    assert readings[(1, 4)] != RARELY_UNNEEDED  # not flagged: a "used" reading


def test_flags_follow_the_health_floors() -> None:
    """Dead (no token, or no gradient while routed) and π_e·E/k below gates.floor_pi_share."""
    doc = {
        "checkpoint": {"name": "c", "experts": 4, "top_k": 2},
        "layers": [
            {
                "layer": 0,
                # π·E/k: 0, 0.08, 0.1 (at the floor: not below), 3.82
                "occupancy": {"counts": [0, 4, 5, 191], "pi": [0.0, 0.04, 0.05, 1.91]},
                "gradients": {"grad_norms": [0.0, 1.0, 1.0, 0.0]},  # expert 3 routed, no gradient
            },
            {"layer": 1, "occupancy": {"counts": [50, 50, 50, 50], "pi": [0.5] * 4}},
        ],
    }
    assert flagged_experts(doc, 0.1) == {0: {0: ["no token"], 1: ["π below floor"], 3: ["no gradient"]}}
    todo, _ = removals(doc, "all", 0.1)
    assert todo == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}


def test_rounding_is_not_need() -> None:
    """A never-chosen expert's removal moves a plain softmax's NLL by rounding, possibly of one sign
    in every window: an interval wholly above 0 but within float32 resolution is not "needed"."""
    from moeaudit.judge.ablation import NLL_RESOLUTION, needed

    assert needed(3e-8, [1e-8, 5e-8]) is False
    assert needed(0.0, [0.0, 0.0]) is False
    assert needed(2e-5, [NLL_RESOLUTION * 2, 4e-5]) is True
    assert needed(2e-8, None) is False and needed(1e-3, None) is True and needed(None, None) is None


def test_an_interval_that_holds_zero_and_a_rise_shows_neither() -> None:
    """A rarely used expert whose interval holds 0 but also a rise beyond the resolution is not
    shown to be needed, nor shown not to be: it is not called "unused and not needed"."""
    from moeaudit.judge.ablation import RARELY_NEEDED, USED_UNSHOWN, needed, not_needed, reading

    wide = (0.004977, [-1.8e-8, 0.0149])  # π 0.002: used a little, evidence either way missing
    assert reading(True, needed(*wide), not_needed(*wide)) == RARELY_UNSHOWN
    assert reading(False, needed(*wide), not_needed(*wide)) == USED_UNSHOWN
    tight = (2e-8, [-1e-7, 5e-7])
    assert reading(True, needed(*tight), not_needed(*tight)) == RARELY_UNNEEDED
    high = (0.0018, [0.0004, 0.0031])
    assert reading(True, needed(*high), not_needed(*high)) == RARELY_NEEDED


def _train_two_domains(path: Path) -> tuple[Canary, int]:
    """A one-layer Mixtral (top-1 of 4) trained on two domains with disjoint token bands and their own
    successor rules; returns the canary (8 windows per domain) and the expert carrying domain 1
    (the one most of its tokens are routed to)."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=1,
        max_position_embeddings=16,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    gen = torch.Generator().manual_seed(0)

    def windows(domain: int, n: int) -> torch.Tensor:
        start = torch.randint(0, 16, (n, 1), generator=gen)
        steps = torch.arange(16)[None, :] * (1 if domain == 0 else 5)
        return (start + steps) % 16 + 16 * domain

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        batch = torch.cat([windows(0, 8), windows(1, 8)])
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(path)
    tokens = torch.cat([windows(0, 8), windows(1, 8)])
    from moeaudit.replay import replay

    routing = replay(Checkpoint(path), tokens, backward=False).routing[0]
    chosen_b = routing.topk_NK.view(16, 16, 1)[8:].reshape(-1)  # domain 1's tokens
    carrier = int(torch.bincount(chosen_b, minlength=4).argmax())
    return Canary(tokens.int().numpy(), (torch.arange(16) // 8).int().numpy(), ("a", "b")), carrier


def test_an_expert_carrying_a_domain_is_needed(tmp_path: Path) -> None:
    canary, carrier = _train_two_domains(tmp_path)
    ckpt = Checkpoint(tmp_path)
    measured = ablation_receipt(ckpt, canary, ReceiptSettings(bootstrap=500), {0: [0, 1, 2, 3]})
    row = next(r for r in measured["experts"] if r["expert"] == carrier)
    # hidden size 8: the embeddings alone cannot hold both successor rules, the experts do; the
    # carrier's removal costs ≈ 0.036 nats (NLL ≈ 0.455 as trained), its interval ≈ [0.026, 0.047]
    assert row["ci95"][0] > 0 and row["nll_delta"] > 0.01, row
    doc = {
        "checkpoint": {"name": "c", "experts": 4, "top_k": 1},
        "layers": [{"layer": 0, "occupancy": {"counts": [1] * 4, "pi": [0.25] * 4}}],
    }
    signed = assemble(measured, {}, doc, "all", 0.1, 1)
    assert next(r for r in signed["experts"] if r["expert"] == carrier)["reading"] == USED_NEEDED
    flagged = assemble(measured, {0: {carrier: ["π below floor"]}}, doc, "low-occupancy", 0.1, 1)
    assert next(r for r in flagged["experts"] if r["expert"] == carrier)["reading"] == RARELY_NEEDED
    assert any(s.startswith("Rarely used but needed: layer 0 expert") for s in flagged["sentences"])


def test_all_experts_chosen_is_refused(tmp_path: Path) -> None:
    tiny_model("mixtral", num_local_experts=2).save_pretrained(tmp_path)  # top-2 of 2
    ckpt = Checkpoint(tmp_path)
    measured = ablation_receipt(ckpt, _canary(random_tokens(4, 12)), ReceiptSettings(bootstrap=0), {0: [0], 1: [1]})
    assert measured["experts"] == [] and measured["nll"] is None
    assert [r["layer"] for r in measured["refused"]] == [0, 1]
    assert "all 2 experts" in measured["refused"][0]["reason"]


def _predicate(out: Path) -> dict[str, Any]:
    env = json.loads((out / "certificate.json").read_text(encoding="utf-8"))
    return json.loads(base64.b64decode(env["payload"]))["predicate"]


def test_certify_signs_the_ablation_receipt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collapse sample's flagged experts: the never-routed ones change the NLL by at most
    rounding (their probability leaves the softmax) with an interval around 0; the signed
    receipt, its sentences and the HTML section say which are needed."""
    from click.testing import CliRunner

    from moeaudit.cli import cli

    monkeypatch.setenv("MOEAUDIT_HOME", str(tmp_path / "home"))
    out = tmp_path / "cert"
    args = ["certify", str(ROOT / "sample_checkpoints" / "collapse"), "--out", str(out), "--key", str(KEY)]
    res = CliRunner().invoke(cli, [*args, "--no-cache", "--ablate", "low-occupancy"])
    assert res.exit_code == 0, res.output
    assert "ablation: Rarely used but needed: layer" in " ".join(res.output.split())
    a = _predicate(out)["ablation"]
    assert a["mode"] == "low-occupancy" and a["step"] == 1500 and a["experts"]
    assert all(e["flagged"] for e in a["experts"])
    never = [e for e in a["experts"] if e["flags"] == ["no token"]]
    assert never
    for e in never:
        # float32 rounding may move every window the same way (the interval then misses 0 by
        # ~1e-8, more threads or fewer): the whole interval lies within the 1e-6 floor
        assert abs(e["nllDelta"]) < 1e-6 and -1e-6 < e["ci95"][0] <= e["ci95"][1] < 1e-6
        assert e["reading"] == RARELY_UNNEEDED
    needed = [e for e in a["experts"] if e["reading"] == RARELY_NEEDED]
    assert needed and all(e["ci95"][0] > 0 for e in needed)
    assert a["cost"]["layerForwards"] == 4 + sum(4 - e["layer"] for e in a["experts"])
    html = (out / "certificate.html").read_text(encoding="utf-8")
    assert 'id="ablation"' in html and "Rarely used but needed: layer" in html
    res = CliRunner().invoke(cli, [*args, "--force", "--ablate", "some"])
    assert res.exit_code == 2


@pytest.mark.fresh_runs
def test_a_zeroed_frozen_expert_is_flagged_and_not_needed(fresh_runs: Any, tmp_path: Path) -> None:
    """tests/fresh_runs.py "killed-expert": expert 1 of layer 0 zeroed and frozen from step 240 on.
    The router still sends it about half the tokens, so it is flagged by its missing gradient, not
    by its share; removing it (its tokens go to their next choice) does not raise the canary NLL
    beyond the interval — the least needed expert of its layer under ``--ablate all``."""
    from moeaudit.cache import ReceiptsCache
    from moeaudit.canary import load as load_canary
    from moeaudit.certify import audit_run
    from moeaudit.policy import Policy

    run = fresh_runs["killed-expert"]
    probe = load_canary(run / "canary.safetensors")
    pred = audit_run(run, probe, Policy(), cache=ReceiptsCache(tmp_path), ablate="all").statement["predicate"]
    rows = {(e["layer"], e["expert"]): e for e in pred["ablation"]["experts"]}
    killed = rows[(0, 1)]
    assert killed["flags"] == ["no gradient"] and killed["pi"] > 0.1
    assert killed["ci95"][0] <= 0 and killed["reading"] in (RARELY_UNNEEDED, RARELY_UNSHOWN)
    assert killed["nll_delta"] == min(e["nll_delta"] for (layer, _), e in rows.items() if layer == 0)
    assert [k for k, e in rows.items() if e["flagged"]] == [(0, 1)]


@pytest.mark.parametrize("family", __import__("hfmodels").ALL)
def test_every_family_removes_an_expert(tmp_path: Path, family: str) -> None:
    """In every replayed family, on the first routed layer: the receipt's baseline is the replay's
    per-window NLL bit for bit; removing the expert the canary uses most moves the NLL; every
    number is finite. Removing one the canary never chooses moves it by rounding at most where
    the chosen weights do not depend on it: no group limit, and the weights renormalised over the
    chosen (softmax with ``norm_topk_prob``) or per-expert scores (sigmoid). Elsewhere it may
    matter — a softmax that is not renormalised scales the chosen weights by 1/(1 − ρ_e), and a
    group's score counts its unchosen experts (docs/decisions.md, "Ablation receipt")."""
    import hfmodels

    from moeaudit.replay import replay

    ckpt = Checkpoint(hfmodels.save_any(tmp_path, family))
    tokens = random_tokens(2, 8, vocab=ckpt.spec.vocab_size)
    layer = ckpt.spec.routed_layers[0]
    counts = torch.bincount(
        replay(ckpt, tokens, backward=False).routing[layer].topk_NK.flatten(), minlength=ckpt.spec.num_experts
    )
    used, unused = int(counts.argmax()), [e for e, c in enumerate(counts.tolist()) if c == 0][:1]
    got = ablation_nll(ckpt, tokens, {layer: [used, *unused]})
    torch.testing.assert_close(got.base_W, replay(ckpt, tokens, backward=False).nll_windows_W.double(), rtol=0, atol=0)
    assert all(bool(torch.isfinite(v).all()) for v in got.removed_W.values())
    assert float((got.removed_W[(layer, used)] - got.base_W).abs().max()) > 1e-4
    g = ckpt.spec.gate
    if not g.grouped and (ckpt.spec.settings.norm_topk_prob or g.scoring in ("sigmoid", "sqrtsoftplus")):
        for e in unused:
            assert float((got.removed_W[(layer, e)] - got.base_W).abs().max()) <= 1e-6
