"""Layer-local streaming replay: one forward + one backward over the canary (SPEC §3).

Forward: read layer ℓ's weights, run it, keep its *input* (not its activations), hand the
taps to observers while the weights are resident, drop the weights. Backward: walk the
layers in reverse, re-read each layer's weights, recompute it from its stored input with
autograd on, and push the incoming gradient through it. At any time one decoder layer's
weights are resident; the per-layer state kept is the N×H input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moeaudit.checkpoint.checkpoint import Checkpoint, LayerWeights
from moeaudit.replay.model import MoETap, Routing, decoder_layer, rms_norm, rope_tables, token_nll

Observer = Callable[[MoETap, LayerWeights], None]
Progress = Callable[[str, int, int], None]


@dataclass
class LayerGrads:
    """‖∇L‖₂ per weight group of one layer (`000` Def. 6.1)."""

    experts_E: torch.Tensor  # over all of expert e's weights
    router: float = 0.0
    shared: float = 0.0
    attention: float = 0.0


@dataclass
class ReplayResult:
    nll: float
    nll_windows_W: torch.Tensor  # mean NLL of each window
    entropy: float  # teacher-forced predictive entropy, mean over the W·(T−1) positions
    routing: dict[int, Routing] = field(default_factory=dict)
    grads: dict[int, LayerGrads] = field(default_factory=dict)
    nonfinite_weights: list[str] = field(default_factory=list)  # "layer 3 router", "lm_head", ...


def _detached(r: Routing) -> Routing:
    return Routing(r.scores_NE.detach(), r.probs_NE.detach(), r.topk_NK, r.combine_NK.detach())


def nonfinite_names(lw: LayerWeights) -> list[str]:
    """Which of a layer's tensors hold NaN or Inf (checked once, in the forward pass)."""
    bad = [f"layer {lw.layer} {n}" for n, t in lw.params.items() if not bool(torch.isfinite(t).all())]
    bad += [f"layer {lw.layer} expert {e} {n}" for e, w in enumerate(lw.experts)
            for n, t in w.items() if not bool(torch.isfinite(t).all())]
    return bad


def forward_pass(
    ckpt: Checkpoint,
    tokens_WT: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    *,
    observers: Sequence[Observer] = (),
    tick: Progress = lambda *_: None,
    total_steps: int | None = None,
    dtype: torch.dtype = torch.float32,
    nonfinite: list[str] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[int, Routing]]:
    """Stream the decoder once: (final hidden state, each layer's input, routing per layer).
    Names of weights holding NaN/Inf are appended to ``nonfinite`` when it is given."""
    spec = ckpt.spec
    embed = ckpt.read_global("embed", dtype)
    if nonfinite is not None and not bool(torch.isfinite(embed).all()):
        nonfinite.append("embed")
    with torch.no_grad():
        x = torch.nn.functional.embedding(tokens_WT.long(), embed)
    del embed
    inputs: list[torch.Tensor] = []
    routing: dict[int, Routing] = {}
    for i in range(spec.num_layers):
        lw = ckpt.layer_weights(i, dtype)
        if nonfinite is not None:
            nonfinite.extend(nonfinite_names(lw))
        inputs.append(x)
        with torch.no_grad():
            x, tap = decoder_layer(spec, lw, x, rope)
        if tap is not None:
            routing[i] = _detached(tap.routing)
            for observe in observers:
                observe(tap, lw)
        del lw, tap
        tick("forward", i + 1, total_steps or spec.num_layers)
    return x, inputs, routing


def replay(
    ckpt: Checkpoint,
    tokens_WT: torch.Tensor,
    *,
    backward: bool = True,
    observers: Sequence[Observer] = (),
    grad_observers: Sequence[Callable[[LayerWeights], None]] = (),
    window_weights_W: torch.Tensor | None = None,
    progress: Progress | None = None,
    dtype: torch.dtype = torch.float32,
) -> ReplayResult:
    """One forward (+ one backward) of L = mean next-token NLL over the canary (SPEC §3).

    ``window_weights_W`` replaces the plain mean by Σ_w weight_w · mean_t nll_wt (a domain's
    mean NLL, for gradient conflict); ``grad_observers`` see each layer's weights with their
    ``.grad`` filled during the reverse walk.
    """
    spec = ckpt.spec
    torch.use_deterministic_algorithms(True)
    tokens_WT = tokens_WT.long()
    rope = rope_tables(spec, tokens_WT.shape[1])
    n_steps = spec.num_layers * (2 if backward else 1)
    tick = progress or (lambda *_: None)
    bad: list[str] = []
    x, inputs, routing = forward_pass(ckpt, tokens_WT, rope, observers=observers, tick=tick,
                                      total_steps=n_steps, dtype=dtype, nonfinite=bad)

    final_norm, lm_head = ckpt.read_global("final_norm", dtype), ckpt.read_global("lm_head", dtype)
    bad += [n for n, t in (("final_norm", final_norm), ("lm_head", lm_head)) if not bool(torch.isfinite(t).all())]
    x = x.detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        nll_WT1, logits = token_nll(spec, final_norm, lm_head, x, tokens_WT)
        if window_weights_W is None:
            loss = nll_WT1.mean()
        else:
            loss = (nll_WT1.mean(1) * window_weights_W.to(nll_WT1.dtype)).sum()
    with torch.no_grad():
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        entropy = float(-(logp.exp() * logp).sum(-1).mean())
    result = ReplayResult(float(nll_WT1.detach().mean()), nll_WT1.detach().mean(1), entropy, routing,
                          nonfinite_weights=bad)
    del logits, logp
    if not backward:
        return result

    loss.backward()
    grad = x.grad
    for step, i in enumerate(reversed(range(spec.num_layers))):
        lw = ckpt.layer_weights(i, dtype).requires_grad_()
        x_in = inputs[i].requires_grad_(True)
        with torch.enable_grad():
            out, _ = decoder_layer(spec, lw, x_in, rope)
        torch.autograd.backward(out, grad)
        grad = x_in.grad
        if lw.routed:
            result.grads[i] = layer_grads(lw)
        for observe_grad in grad_observers:
            observe_grad(lw)
        inputs[i] = None  # type: ignore[call-overload]
        del lw, out, x_in
        tick("backward", spec.num_layers + step + 1, n_steps)
    return result


def greedy_generate(ckpt: Checkpoint, prompts_PT: torch.Tensor, new_tokens: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Greedy continuation [P, new_tokens] (no KV cache: each step re-streams the decoder, which
    keeps one layer resident; the generation receipts are opt-in because of that cost)."""
    spec = ckpt.spec
    final_norm, lm_head = ckpt.read_global("final_norm", dtype), ckpt.read_global("lm_head", dtype)
    seq = prompts_PT.long()
    for _ in range(new_tokens):
        rope = rope_tables(spec, seq.shape[1])
        x, _, _ = forward_pass(ckpt, seq, rope, dtype=dtype)
        with torch.no_grad():
            logits = torch.nn.functional.linear(rms_norm(x[:, -1], final_norm, spec.rms_eps), lm_head)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompts_PT.shape[1]:]


def _norm(tensors: Sequence[torch.Tensor | None]) -> float:
    sq = sum(float(t.grad.double().pow(2).sum()) for t in tensors if t is not None and t.grad is not None)
    return sq**0.5


def layer_grads(lw: LayerWeights) -> LayerGrads:
    experts = torch.tensor(
        [_norm(list(e.values())) for e in lw.experts], dtype=torch.float64
    )
    p = lw.params
    attn = [p.get(n) for n in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias",
                               "q_norm", "k_norm", "input_norm")]
    shared = [p.get(n) for n in ("shared_w1", "shared_w3", "shared_w2", "shared_gate")]
    return LayerGrads(experts, router=_norm([p["router"]]), shared=_norm(shared), attention=_norm(attn))
