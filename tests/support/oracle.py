"""Helpers of tests/test_oracle.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
import oracle_log  # noqa: E402
from hfmodels import load  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.replay import ReplayResult, replay  # noqa: E402
from moeaudit.replay.model import MoETap, block_norm, decoder_layer, embed, rope_tables  # noqa: E402

# Float32 agreement with transformers, per quantity, in one place. Both sides run the same
# float32 model but sum in different orders (fused or unfused ops, chunked or recurrent
# DeltaNet, GEMMs blocked for 8 (AVX2) or 16 (AVX-512) lanes, 1 or many threads); a reordered sum
# of n terms moves by about √n·u·Σ|terms| (u = 2⁻²⁴ ≈ 6e-8), and that is carried through layers.
FORWARD = {"rtol": 1e-4, "atol": 1e-5}  # loss, per-window NLL, entropy, combine weights: order 1


# Hidden states, MoE inputs and router logits: an element is a sum over its token's vector, so
# its error scales with that vector (RMS over the last dim), not with the element; one near 0 in
# a row of RMS 4.5 carries the whole row's rounding. Absolute part: ACTIVATION_SCALE × row RMS
# (never below FORWARD's atol). Worst measured beyond the rtol part, over every oracle test on an
# AVX-512 CPU under ATen's AVX-512, AVX2 and scalar kernels and MKL's default and CBWR=COMPATIBLE
# GEMMs: 5.4e-6 × row RMS (18× inside). A fixed atol of 1e-5 failed on a DeltaNet family
# (Qwen3.5-MoE, MoE input off by 2.0e-5 in a tensor of RMS 4.5).
ACTIVATION_SCALE = 1e-4


GRADIENT = {"rtol": 2e-3, "atol": 1e-6}  # gradient norms: backward sums over every token


TIE_GAP = 1e-5  # top-k sets are compared where the k-th and (k+1)-th gate values differ by more


@dataclass
class Observed:
    """One forward + backward over a token block, keyed by decoder layer index."""

    loss: torch.Tensor
    nll_windows_W: torch.Tensor
    entropy: torch.Tensor
    layer_inputs: list[torch.Tensor]  # input of each decoder layer, then the final-normed state
    moe_inputs: dict[int, torch.Tensor]  # h: residual entering the MoE block, [N, H]
    scores: dict[int, torch.Tensor]  # router logits [N, E]
    topk: dict[int, torch.Tensor]  # [N, K]
    combine: dict[int, torch.Tensor]  # [N, K], aligned with topk
    expert_grads: dict[int, torch.Tensor]  # [E]
    router_grads: dict[int, float]
    shared_grads: dict[int, float]
    attention_grads: dict[int, float]


def _norm(tensors: list[torch.Tensor | None]) -> float:
    return sum(float(t.double().pow(2).sum()) for t in tensors if t is not None) ** 0.5


def transformers_observed(
    model: Any, tokens_WT: torch.Tensor, moe: str = "mlp", gate: str = "gate", chosen: Any = None
) -> Observed:
    """Run the HF model; the loss is our CE from its logits (no auxiliary loss, docs/glossary.md, "Replay").
    ``moe``/``gate``: the decoder layer's MoE block and its router module (Granite:
    ``block_sparse_moe``/``router``); ``chosen(router output) → (top-k [N, K], combine [N, K])``
    where the router does not return them as (…, combine, top-k) (Llama 4)."""
    chosen = chosen or (lambda out: (out[2], out[1]))
    layers = model.model.layers
    routed = [i for i, layer in enumerate(layers) if hasattr(getattr(layer, moe), "experts")]
    seen: dict[tuple[str, int], Any] = {}

    def keep(kind: str, i: int):
        def hook(_module, args, out):
            seen[kind, i] = args[0].detach().flatten(0, -2) if kind == "h" else out

        return hook

    hooks = [layers[i].post_attention_layernorm.register_forward_hook(keep("h", i)) for i in routed]
    hooks += [getattr(getattr(layers[i], moe), gate).register_forward_hook(keep("gate", i)) for i in routed]
    try:
        out = model(tokens_WT, output_hidden_states=True, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    nll_WT1, loss, entropy = _cross_entropy(out.logits, tokens_WT)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}

    def layer_grads(i: int, prefix: str) -> list[torch.Tensor | None]:
        head = f"model.layers.{i}."
        return [g for n, g in grads.items() if n.startswith(head + prefix)]

    experts = {}
    for i in routed:
        fused = getattr(layers[i], moe).experts
        names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")  # biases: gpt-oss
        sq = [p.grad.double().pow(2).flatten(1).sum(1) for n in names if (p := getattr(fused, n, None)) is not None]
        experts[i] = sum(sq).sqrt()
    return Observed(
        loss=loss.detach(),
        nll_windows_W=nll_WT1.detach().mean(1),
        entropy=entropy,
        layer_inputs=[h.detach() for h in out.hidden_states],
        moe_inputs={i: seen["h", i] for i in routed},
        scores={i: logits.detach() for i, logits in zip(routed, out.router_logits, strict=True)},
        topk={i: chosen(seen["gate", i])[0] for i in routed},
        combine={i: chosen(seen["gate", i])[1].detach() for i in routed},
        expert_grads=experts,
        router_grads={i: _norm(layer_grads(i, f"{moe}.{gate}.")) for i in routed},
        shared_grads={i: _norm(layer_grads(i, f"{moe}.shared_expert")) for i in routed},
        attention_grads={i: _norm(layer_grads(i, "self_attn.") + layer_grads(i, "input_layernorm.")) for i in routed},
    )


def _cross_entropy(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor):
    B, T, V = logits_BTV.shape
    logits = logits_BTV[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, V), tokens_BT[:, 1:].reshape(-1), reduction="none")
    logp = torch.log_softmax(logits.detach(), -1)
    return nll.view(B, T - 1), nll.mean(), -(logp.exp() * logp).sum(-1).mean()


def moeaudit_observed(ckpt: Checkpoint, tokens_WT: torch.Tensor) -> Observed:
    """The engine's replay; layer inputs by chaining the same decoder layers it runs."""
    taps: dict[int, torch.Tensor] = {}

    def observe(tap: MoETap, _lw: Any) -> None:
        taps[tap.layer] = tap.h_NH.detach().clone()

    result = replay(ckpt, tokens_WT, observers=[observe])
    return Observed(
        loss=torch.tensor(result.nll),
        nll_windows_W=result.nll_windows_W,
        entropy=torch.tensor(result.entropy),
        layer_inputs=_layer_inputs(ckpt, tokens_WT),
        moe_inputs=taps,
        scores={i: r.scores_NE for i, r in result.routing.items()},
        topk={i: r.topk_NK for i, r in result.routing.items()},
        combine={i: r.combine_NK for i, r in result.routing.items()},
        expert_grads={i: g.experts_E for i, g in result.grads.items()},
        router_grads={i: g.router for i, g in result.grads.items()},
        shared_grads={i: g.shared for i, g in result.grads.items()},
        attention_grads={i: g.attention for i, g in result.grads.items()},
    )


@torch.no_grad()
def _layer_inputs(ckpt: Checkpoint, tokens_WT: torch.Tensor) -> list[torch.Tensor]:
    spec = ckpt.spec
    rope = rope_tables(spec, tokens_WT.shape[1])
    x = embed(spec, ckpt.read_global("embed"), tokens_WT)
    inputs = []
    for i in range(spec.num_layers):
        inputs.append(x)
        x, _ = decoder_layer(spec, ckpt.layer_weights(i), x, rope)
    bias = ckpt.read_global("final_norm_bias") if spec.layer_norm and spec.norm_bias else None
    return inputs + [block_norm(spec, x, ckpt.read_global("final_norm"), bias, spec.final_eps)]


def _decisive(probs_NE: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens whose active set is not within float32 noise of a tie."""
    top = probs_NE.topk(min(k + 1, probs_NE.shape[-1]), dim=-1).values
    return torch.ones_like(top[:, 0], dtype=torch.bool) if top.shape[-1] == k else (top[:, k - 1] - top[:, k] > TIE_GAP)


def _by_expert(topk_NK: torch.Tensor, combine_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = topk_NK.argsort(-1)
    return topk_NK.gather(-1, order), combine_NK.gather(-1, order)


def _same_topk(ours: Observed, ref: Observed, decisive: dict[int, torch.Tensor]) -> dict[int, bool]:
    """Per routed layer: are the active sets equal on every decisive token?"""
    same = {}
    for i, ok in decisive.items():
        ours_topk, ref_topk = _by_expert(ours.topk[i], ours.combine[i])[0], _by_expert(ref.topk[i], ref.combine[i])[0]
        same[i] = bool(torch.equal(ours_topk[ok], ref_topk[ok]))
    return same


def assert_close_activations(got: torch.Tensor, want: torch.Tensor, forward: dict, what: str) -> None:
    """|got − want| ≤ rtol·|want| + max(atol, ACTIVATION_SCALE · RMS of want's row), elementwise."""
    assert (got.shape, got.dtype) == (want.shape, want.dtype), f"{what}: {got.shape}, {want.shape}"
    g, w = got.double(), want.double()
    rms = w.pow(2).mean(-1, keepdim=True).sqrt()
    bound = forward["rtol"] * w.abs() + (ACTIVATION_SCALE * rms).clamp_min(forward["atol"])
    excess = (g - w).abs() - bound
    if not bool((excess <= 0).all()):  # NaN fails too
        at = tuple(int(j) for j in torch.unravel_index(excess.nan_to_num(float("inf")).argmax(), w.shape))
        raise AssertionError(
            f"{what}: {int((~(excess <= 0)).sum())} of {w.numel()} elements off; at {at}: "
            f"{g[at].item()!r} vs {w[at].item()!r}, allowed {bound[at].item():.2e} "
            f"(row RMS {rms[at[:-1]].item():.3g})"
        )


def assert_agree(ref: Observed, ours: Observed, k: int, forward: dict, gradient: dict) -> None:
    decisive = {i: _decisive(torch.softmax(ref.scores[i].float(), -1), k) for i in ref.scores}
    oracle_log.record(ref, ours, decisive, _same_topk(ours, ref, decisive))
    torch.testing.assert_close(ours.loss, ref.loss, **forward)
    torch.testing.assert_close(ours.nll_windows_W, ref.nll_windows_W, **forward)
    torch.testing.assert_close(ours.entropy, ref.entropy, **forward)
    for i, (x, x_ref) in enumerate(zip(ours.layer_inputs, ref.layer_inputs, strict=True)):
        assert_close_activations(x, x_ref, forward, f"hidden {i}")
    assert sorted(ours.scores) == sorted(ref.scores), "routed layers differ"
    for i in ref.scores:
        assert_close_activations(ours.moe_inputs[i], ref.moe_inputs[i], forward, f"MoE input {i}")
        assert_close_activations(ours.scores[i], ref.scores[i], forward, f"router logits {i}")
        probs = torch.softmax(ref.scores[i].float(), -1)
        ok = _decisive(probs, k)
        assert ok.float().mean() >= 0.9, "too many near-ties to test the active sets"
        topk_sets = probs.topk(k, dim=-1).indices.sort(-1).values
        ours_topk, ours_c = _by_expert(ours.topk[i], ours.combine[i])
        ref_topk, ref_c = _by_expert(ref.topk[i], ref.combine[i])
        assert torch.equal(ours_topk[ok], topk_sets[ok]), f"layer {i}: top-k sets differ"
        assert torch.equal(ref_topk[ok], topk_sets[ok])
        torch.testing.assert_close(ours_c[ok], ref_c[ok].float(), **forward)
        torch.testing.assert_close(ours.expert_grads[i], ref.expert_grads[i], **gradient)
        for name in ("router_grads", "shared_grads", "attention_grads"):
            got, want = getattr(ours, name)[i], getattr(ref, name)[i]
            assert got == pytest.approx(want, rel=gradient["rtol"], abs=gradient["atol"]), name


def check_against_transformers(
    path: Path, tokens_WT: torch.Tensor, forward: dict = FORWARD, gradient: dict = GRADIENT
) -> Checkpoint:
    ckpt = Checkpoint(path)
    ref = transformers_observed(load(path), tokens_WT)
    assert_agree(ref, moeaudit_observed(ckpt, tokens_WT), ckpt.spec.top_k, forward, gradient)
    return ckpt


def assert_identical(a: ReplayResult, b: ReplayResult) -> None:
    assert a.nll == b.nll
    assert torch.equal(a.nll_windows_W, b.nll_windows_W)
    assert sorted(a.routing) == sorted(b.routing) == sorted(a.grads) == sorted(b.grads)
    for i in a.routing:
        for field in ("scores_NE", "probs_NE", "topk_NK", "combine_NK"):
            assert torch.equal(getattr(a.routing[i], field), getattr(b.routing[i], field)), field
        assert torch.equal(a.grads[i].experts_E, b.grads[i].experts_E)
        assert (a.grads[i].router, a.grads[i].shared, a.grads[i].attention) == (
            b.grads[i].router,
            b.grads[i].shared,
            b.grads[i].attention,
        )


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint, passing its tensors through ``edit(ckpt, tensors)``."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    save_file(edit(Checkpoint(src), tensors), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def fuse_experts(ckpt: Checkpoint, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused layout (docs/decisions.md, "Checkpoints"): ``gate_up [E, 2I, H]`` (gate rows first), ``down [E, H,
    I]``."""
    out = dict(tensors)
    for i in ckpt.spec.routed_layers:
        per_expert = ckpt.expert_keys(i)
        assert isinstance(per_expert, list)
        w = [{name: out.pop(key) for name, key in keys.items()} for keys in per_expert]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e["w1"], e["w3"]]) for e in w])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([e["w2"] for e in w])
        router = ckpt.layer_keys(i)["router"]
        out[f"model.layers.{i}.mlp.gate.weight"] = out.pop(router)  # v5 names Mixtral's too
    return out
