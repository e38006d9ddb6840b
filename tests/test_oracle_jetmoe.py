"""JetMoE (``jetmoe``) replayed against transformers.

Every JetMoE layer routes twice: its mixture of attention heads (MoA: per-expert q/o projections
over a shared kv projection, its own top-k router, a bias on its output) and its routed SwiGLU
MLP (a bias on the block's output). The replay runs the MoA exactly, as the layer's attention
(``replay.moa``); the receipts audit the MLP block (docs/decisions.md). JetMoE has no shared
expert and no dense layer, so the configurations vary what it has: top-k (1, 2, 3), the expert
count (4, 6, 8), the kv heads and head size (so the query heads, kv heads × top-k), tied or
untied embeddings and the final norm's eps (the layer norms are at 1e-6 whatever the config
says). Each in float32 and from a bfloat16 checkpoint (transformers computing in float32 from
the same stored values, as ``test_oracle_dtypes``), with the float32 tolerances of
``test_oracle``: NLL, hidden states and router logits (``FORWARD``), gradient norms within 2e-3
relative (``GRADIENT``), identical top-k sets on tokens whose k-th and (k+1)-th logits differ by
more than ``TIE_GAP``.

The gradient groups compared: each MLP expert's input_linear and output_linear rows; the MLP
router; the bias on the MoE output (the replay's "shared" group: an always-on term of the
block); and the attention group — the whole MoA (its router, expert q/o projections, kv
projection, output bias) with the input norm.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny  # noqa: E402
from oracle_log import worst as _worst  # noqa: E402
from support.oracle import (  # noqa: E402
    FORWARD,
    TIE_GAP,
    Observed,
    _by_expert,
    _cross_entropy,
    _norm,
    assert_identical,
)
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError, InputError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402
from moeaudit.replay.moa import moa_route  # noqa: E402
from moeaudit.replay.model import rms_norm  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

CASES: dict[str, dict[str, Any]] = {
    # 3 layers, top-2 of 4 (attention and MLP experts alike), 2 kv heads of 8 (4 query heads),
    # tied embeddings, the final norm at eps 1e-2
    "top2-4-experts-tied": {},
    # 4 layers, top-3 of 6, one kv head of 8 (3 query heads), untied embeddings, default eps
    "top3-6-experts-one-kv-head-untied": {
        "num_hidden_layers": 4,
        "num_experts_per_tok": 3,
        "num_local_experts": 6,
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
    },
    # top-1 of 8: one attention expert per token (its gate is 1), 4 kv heads of 4
    "top1-8-experts": {
        "num_experts_per_tok": 1,
        "num_local_experts": 8,
        "num_key_value_heads": 4,
        "kv_channels": 4,
    },
}


def jetmoe_observed(model: Any, tokens_WT: torch.Tensor) -> Observed:
    """transformers' side, read from the MLP block's modules: its input (what
    ``post_attention_layernorm`` reads), its router's logits, and the active sets and combine
    weights unsorted from ``JetMoeTopKGating``'s expert-sorted outputs."""
    layers = model.model.layers
    seen: dict[tuple[str, int], Any] = {}

    def keep(kind: str, i: int) -> Any:
        def hook(_module: Any, args: Any, out: Any) -> None:
            seen[kind, i] = args[0].detach().flatten(0, -2) if kind == "h" else out

        return hook

    hooks = [layer.post_attention_layernorm.register_forward_hook(keep("h", i)) for i, layer in enumerate(layers)]
    hooks += [layer.mlp.router.register_forward_hook(keep("gate", i)) for i, layer in enumerate(layers)]
    moa = [layer.self_attention.experts.router for layer in layers]
    hooks += [router.register_forward_hook(keep("moa", i)) for i, router in enumerate(moa)]
    try:
        out = model(tokens_WT, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    nll_WT1, loss, entropy = _cross_entropy(out.logits, tokens_WT)
    loss.backward()
    hidden = [h.detach() for h in out.hidden_states]
    obs = Observed(loss.detach(), nll_WT1.detach().mean(1), entropy, hidden, *({} for _ in range(8)))
    obs.moa = {i: _unsorted(seen["moa", i], moa[i].num_experts, moa[i].top_k) for i in range(len(layers))}  # type: ignore[attr-defined]
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        obs.topk[i], obs.combine[i] = _unsorted(seen["gate", i], mlp.router.num_experts, mlp.router.top_k)
        obs.moe_inputs[i], obs.scores[i] = seen["h", i], seen["gate", i][4].detach()
        w_in, w_out = mlp.input_linear.weight.grad, mlp.output_linear.weight.grad
        obs.expert_grads[i] = (w_in.double().pow(2).flatten(1).sum(1) + w_out.double().pow(2).flatten(1).sum(1)).sqrt()
        obs.router_grads[i] = _norm([mlp.router.layer.weight.grad])
        obs.shared_grads[i] = _norm([mlp.bias.grad])
        attention = [p.grad for p in (*layer.self_attention.parameters(), *layer.input_layernorm.parameters())]
        obs.attention_grads[i] = _norm(attention)
    return obs


def _unsorted(gating: Any, E: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen experts [N, K], gates [N, K]) in each token's slot order, from ``JetMoeTopKGating``'s
    outputs sorted by expert (slot positions, gates, tokens per expert)."""
    sorted_slots, _, sorted_gates, sizes, logits = gating
    N = logits.shape[0]
    topk, gates = torch.empty(N * K, dtype=torch.long), torch.empty(N * K)
    topk[sorted_slots] = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes))
    gates[sorted_slots] = sorted_gates.detach()
    return topk.view(N, K), gates.view(N, K)


def assert_moa_routing_agrees(ref: Any, ours: Observed, ckpt: Checkpoint) -> None:
    """The attention experts each token's MoA router picks, and their gates, recomputed from our
    replay's layer inputs, agree with transformers' (tokens within ``TIE_GAP`` of a tie aside)."""
    spec = ckpt.spec
    for i, (want_NK, want_gates) in ref.moa.items():
        p = ckpt.layer_weights(i).params
        x_NH = rms_norm(ours.layer_inputs[i], p["input_norm"], spec.rms_eps).flatten(0, -2)
        got_NK, got_gates = moa_route(p["moa_router"], x_NH, spec.top_k)
        top = F.linear(x_NH, p["moa_router"]).topk(min(spec.top_k + 1, spec.num_experts), dim=-1).values
        ok = top[:, -2] - top[:, -1] > TIE_GAP if spec.top_k < spec.num_experts else torch.ones_like(top[:, 0]) > 0
        assert ok.float().mean() >= 0.9, "too many near-ties to test the attention experts"
        (got_NK, got_gates), (want_NK, want_gates) = _by_expert(got_NK, got_gates), _by_expert(want_NK, want_gates)
        assert torch.equal(got_NK[ok], want_NK[ok]), f"layer {i}: the attention experts differ"
        torch.testing.assert_close(got_gates[ok], want_gates[ok], **FORWARD)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_jetmoe_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "jetmoe", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    ref, ours = jetmoe_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert_moa_routing_agrees(ref, ours, ckpt)
    assert ckpt.warnings == [] and ckpt.notes == []
    c = model.config
    # the query heads of transformers' forward: kv heads × top-k (its num_attention_heads attribute
    # is the file's when the file has one, and the forward does not read it)
    assert (ckpt.spec.num_heads, ckpt.spec.num_kv_heads, ckpt.spec.head_dim) == (
        c.num_key_value_heads * c.num_experts_per_tok,
        c.num_key_value_heads,
        c.kv_channels,
    )
    assert ckpt.spec.tie_embeddings == c.tie_word_embeddings
    assert min(float(layer.mlp.bias.detach().abs().min()) for layer in model.model.layers) > 0  # real biases
    if log := os.environ.get("MOEAUDIT_JETMOE_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_jetmoe_each_moa_weight_and_bias_matters(tmp_path: Path) -> None:
    """The replay reads every MoA tensor and both output biases: each changed in the file changes
    the loss (a replay that skipped one, or routed the attention experts otherwise, would not move)."""
    import safetensors.torch as st

    save_tiny(tmp_path, "jetmoe")
    tokens = random_tokens()
    base = observed(Checkpoint(tmp_path), tokens).loss
    (path,) = tmp_path.glob("*.safetensors")
    original = st.load_file(path)
    for key in (
        "model.layers.1.self_attention.experts.router.layer.weight",
        "model.layers.1.self_attention.experts.input_linear.weight",
        "model.layers.1.self_attention.experts.output_linear.weight",
        "model.layers.1.self_attention.experts.bias",
        "model.layers.1.self_attention.kv_proj.weight",
        "model.layers.1.mlp.bias",
    ):
        st.save_file({**original, key: original[key] * 3.0}, path, metadata={"format": "pt"})
        assert abs(float(observed(Checkpoint(tmp_path), tokens).loss) - float(base)) > 1e-3, key
    st.save_file(original, path, metadata={"format": "pt"})


def test_jetmoe_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("jetmoe")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.expert_dim) == (8, 2, 5632)
    assert (
        (spec.num_heads, spec.num_kv_heads, spec.head_dim)
        == (32, 16, 128)
        == (
            hf.num_attention_heads,
            hf.num_key_value_heads,
            hf.kv_channels,
        )
    )
    assert (spec.rms_eps, spec.final_eps, spec.tie_embeddings, spec.rope.theta) == (1e-6, 1e-6, True, 10000.0)
    assert spec.settings.moa and spec.settings.moe_bias and spec.routed_layers == tuple(range(hf.num_hidden_layers))
    # transformers derives the query heads from the kv heads and top-k, whatever the file says
    cfg = {k: v for k, v in hf.to_dict().items() if k not in ("num_attention_heads", "tie_word_embeddings")}
    assert spec_from_config({**cfg, "num_experts_per_tok": 3}).num_heads == 48
    assert spec_from_config({**cfg, "num_attention_heads": 7}).num_heads == 32
    assert spec_from_config(cfg).tie_embeddings  # JetMoE ties by default
    assert spec_from_config({**cfg, "rms_norm_eps": 1e-5}).final_eps == 1e-5
    with pytest.raises(CheckpointError, match="activation_function"):
        spec_from_config({**cfg, "activation_function": "gelu"})
    with pytest.raises(CheckpointError, match="kv_channels"):
        spec_from_config({**cfg, "kv_channels": 0})


def test_expert_parallel_replay_refuses_jetmoe_by_name(tmp_path: Path) -> None:
    from moeaudit.replay.sharded import check_shardable

    save_tiny(tmp_path, "jetmoe")
    with pytest.raises(InputError, match="does not replay jetmoe's mixture of attention heads") as err:
        check_shardable(Checkpoint(tmp_path).spec)
    assert "without --nproc" in (err.value.hint or "")


def test_jetmoe_replay_is_deterministic_and_attention_expert_labels_do_not_matter(tmp_path: Path) -> None:
    """Two replays are bit-identical. Relabelling the attention experts of every layer (router
    rows, q and o projections moved together) changes no forward number (each expert gets the same
    rows in the same order under its new label) and moves the gradients by float32 rounding only:
    the backward of the expert-sorted gather sums a token's k slot gradients in the new order."""
    import safetensors.torch as st

    save_tiny(tmp_path / "a", "jetmoe")
    tokens = random_tokens()
    base = replay(Checkpoint(tmp_path / "a"), tokens)
    assert_identical(base, replay(Checkpoint(tmp_path / "a"), tokens))
    perm = torch.tensor([2, 0, 3, 1])
    tensors = st.load_file(tmp_path / "a" / "model.safetensors")
    moved = {k: v[perm] if ".self_attention.experts." in k and v.dim() >= 2 else v for k, v in tensors.items()}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_bytes((tmp_path / "a" / "config.json").read_bytes())
    st.save_file(moved, tmp_path / "b" / "model.safetensors", metadata={"format": "pt"})
    other = replay(Checkpoint(tmp_path / "b"), tokens)
    assert other.nll == base.nll and torch.equal(other.nll_windows_W, base.nll_windows_W)
    for i, r in base.routing.items():
        assert torch.equal(other.routing[i].topk_NK, r.topk_NK) and torch.equal(other.routing[i].scores_NE, r.scores_NE)
        g, h = base.grads[i], other.grads[i]
        torch.testing.assert_close(h.experts_E, g.experts_E, rtol=1e-6, atol=0)
        for a, b in ((g.router, h.router), (g.shared, h.shared), (g.attention, h.attention)):
            assert b == pytest.approx(a, rel=1e-6)
