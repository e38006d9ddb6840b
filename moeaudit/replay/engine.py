"""Layer-local streaming replay: one forward + one backward over the canary (docs/glossary.md, "Replay").

Forward: read layer ℓ's weights, run it, keep its *input* (not its activations), hand the
taps to observers while the weights are resident, drop the weights. Backward: walk the
layers in reverse, re-read each layer's weights, recompute it from its stored input with
autograd on, and push the incoming gradient through it. At any time one decoder layer's
weights are resident; the per-layer state kept is the N×H input (N×S×H: HY-V4's S residual streams).

Memory (docs/benchmarks.md §2): a layer's routed experts stay in their on-disk dtype and are converted to
the compute dtype one expert at a time; in the backward each expert's weight gradients are
formed, measured and dropped before the next (``experts_backward``); the LM head works on
row chunks, so the [N, V] logits never exist at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from moeaudit.checkpoint.checkpoint import Checkpoint, LayerWeights
from moeaudit.replay.blocks.backward import layer_backward as layer_backward  # re-exported
from moeaudit.replay.device import (
    Device,
    moved,
    on_device,
    prepare_device,
    replay_scope,
    to_host,
    trimmer,
)
from moeaudit.replay.device import DeviceExperts as DeviceExperts  # re-exported
from moeaudit.replay.finite import FiniteCheck, all_finite
from moeaudit.replay.head import backward_from, head_biases, lm_head_pass, loss_grad
from moeaudit.replay.model import Routing, block_norm, decoder_layer, hc_mix, rope_tables
from moeaudit.replay.model import (
    embed as embed_tokens,
)
from moeaudit.replay.offload import StoredInputs
from moeaudit.replay.result import Observer, Progress, ReplayResult, detached, extra_requests
from moeaudit.replay.stash import ExpertStash, default_budget
from moeaudit.spec.config import ModelSpec


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
    device: Device = None,
    keep_routing: bool = True,
    stash: ExpertStash | None = None,
) -> tuple[torch.Tensor, StoredInputs, dict[int, Routing]]:
    """Stream the decoder once: (final hidden state, each layer's input, routing per layer —
    none unless ``keep_routing``). Names of weights holding NaN/Inf are appended to
    ``nonfinite`` when it is given.

    On a ``device`` each layer is computed there, and observers get the taps and the layer's
    weights there: they compute their statistics where the tensors live and bring back only
    those (``receipts.deferred``; docs/decisions.md, "The GPU path: receipts on the device, copies
    ahead, inputs offloaded"). The routing returned is on the host (one copy
    per layer, N·E numbers, only when kept). The layer inputs stay on the device up to a memory
    budget, the first layers' beyond it wait in host memory (``replay.offload``; docs/decisions.md, "Input
    offload is an environment setting").
    ``stash``: the routed experts' W1/W3 products are kept there for the backward, for the
    layers its budget has room for (``replay.stash``)."""
    spec = ckpt.spec
    embed = ckpt.read_global("embed", None)  # on-disk dtype; only the canary's rows are converted
    if nonfinite is not None and not all_finite(embed):
        nonfinite.append("embed")
    with torch.no_grad():
        x = embed_tokens(spec, embed, tokens_WT.cpu(), dtype)
    del embed
    x = moved(x, device, non_blocking=True) if device is not None else x
    inputs = StoredInputs(device, spec.num_layers)
    routing: dict[int, Routing] = {}
    extra = extra_requests(observers)
    trim = trimmer(device)
    check = FiniteCheck(device)
    for i in range(spec.num_layers):
        lw = ckpt.layer_weights(i, dtype, lazy_experts=True, device=device)
        if nonfinite is not None:
            for n, t in lw.stored_tensors():
                check.add(f"layer {i} {n}", t)
        inputs.append(x)
        lw = on_device(lw, device)
        keep = stash.offer(i) if stash is not None and lw.routed else None
        with torch.no_grad():
            x, tap = decoder_layer(spec, lw, x, rope, extra, keep)
        if tap is not None:
            if keep_routing:
                routing[i] = detached(tap.routing if device is None else to_host(tap.routing, device))
            for observe in observers:
                observe(tap, lw)
        del lw, tap
        trim()
        tick(f"forward layer {i + 1}/{spec.num_layers}", i + 1, total_steps or spec.num_layers)
    if nonfinite is not None:
        nonfinite.extend(check.nonfinite())
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
    device: Device = None,
    keep_routing: bool = True,
    stash_budget: float | None = None,
) -> ReplayResult:
    """One forward (+ one backward) of L = mean next-token NLL over the canary (docs/glossary.md, "Replay").

    ``window_weights_W`` replaces the plain mean by Σ_w weight_w · mean_t nll_wt (a domain's
    mean NLL, for gradient conflict); ``grad_observers`` see each layer's weights with the
    ``.grad`` of its non-expert parameters filled during the reverse walk (expert gradients
    are measured and dropped one expert at a time, see ``experts_backward``). ``device``
    (e.g. "cuda") computes there, one layer's weights at a time; receipts come back on the host.
    ``keep_routing=False`` leaves ``ReplayResult.routing`` empty (on a device: no N·E copy back
    per layer for a caller whose observers took what they need).
    ``stash_budget``: bytes of kept expert products (``replay.stash``) instead of the default
    ``default_budget`` (a replay whose FLOP count is carried runs with its reference's).
    """
    from moeaudit.limits import check_window_len

    check_window_len(tokens_WT.shape[-1])  # callers check first, naming the canary file
    check_shared_index(ckpt.spec, tokens_WT.shape[-1])
    dev = prepare_device(device)
    from moeaudit.replay import dist

    sess = dist.active()  # torchrun or --nproc: experts across the ranks (docs/decisions.md, "Expert-parallel replay")
    if sess is not None and not grad_observers and window_weights_W is None and not ckpt.is_dcp:
        from moeaudit.replay.sharded import sharded_replay

        with replay_scope(dev):
            return sharded_replay(
                sess,
                ckpt,
                tokens_WT,
                backward=backward,
                observers=observers,
                progress=progress,
                dtype=dtype,
                device=dev,
            )
    with replay_scope(dev):
        return _replay(
            ckpt,
            tokens_WT,
            backward=backward,
            observers=observers,
            grad_observers=grad_observers,
            window_weights_W=window_weights_W,
            progress=progress,
            dtype=dtype,
            device=dev,
            keep_routing=keep_routing,
            stash_budget=stash_budget,
        )


def check_shared_index(spec: ModelSpec, window_len: int) -> None:
    """HY-V4 layers that reuse the previous layer's DSA key selection (``shared_index_layers``)
    are replayed only where that selection keeps every causal key (windows of at most index_topk
    tokens): the streaming replay recomputes each layer from its own input, without the other
    layer's selection."""
    si = spec.sparse_index
    if spec.shared_index_layers and si is not None and window_len > si.topk:
        from moeaudit.errors import CanaryError

        raise CanaryError(
            f"canary windows are {window_len} tokens long; {spec.family} layers "
            f"{list(spec.shared_index_layers[:5])} reuse another layer's sparse-attention key selection "
            f"(indexer_types 'shared'), which moeaudit replays only for windows of at most index_topk = "
            f"{si.topk} tokens (there every causal key is kept)",
            hint=f"build the canary from windows of at most {si.topk} tokens",
        )


def hc_head_weights(ckpt: Checkpoint, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """HY-V4's final stream mix (fn, base, scale), kept in float32 as transformers keeps them."""
    return tuple(ckpt.read_global(n, torch.float32) for n in ("hc_head_fn", "hc_head_base", "hc_head_scale"))


def hc_collapse(spec: ModelSpec, head: Sequence[torch.Tensor], x_BTSH: torch.Tensor) -> torch.Tensor:
    """The streams mixed into one hidden state before the final norm (``HYV4HyperHead``)."""
    fn, base, scale = head
    return hc_mix(spec, fn, base, scale, x_BTSH, head=True)[1]


def _replay(
    ckpt: Checkpoint,
    tokens_WT: torch.Tensor,
    *,
    backward: bool,
    observers: Sequence[Observer],
    grad_observers: Sequence[Callable[[LayerWeights], None]],
    window_weights_W: torch.Tensor | None,
    progress: Progress | None,
    dtype: torch.dtype,
    device: torch.device | None,
    keep_routing: bool = True,
    stash_budget: float | None = None,
) -> ReplayResult:
    spec = ckpt.spec
    tokens_WT = tokens_WT.long()
    W, T = tokens_WT.shape
    rope = rope_tables(spec, T) if device is None else moved(rope_tables(spec, T), device, non_blocking=True)
    n_steps = spec.num_layers * (2 if backward else 1)
    tick = progress or (lambda *_: None)
    bad: list[str] = []
    if stash_budget is None:
        stash_budget = default_budget(device, spec, W * T, dtype) if backward else 0.0
    stash = ExpertStash(spec, W * T, stash_budget, dtype) if backward else None
    x, inputs, routing = forward_pass(
        ckpt,
        tokens_WT,
        rope,
        observers=observers,
        tick=tick,
        total_steps=n_steps,
        dtype=dtype,
        nonfinite=bad,
        device=device,
        keep_routing=keep_routing,
        stash=stash,
    )

    final_norm, lm_head = ckpt.read_global("final_norm", dtype), ckpt.read_global("lm_head", dtype)
    biases = head_biases(ckpt, dtype)
    bad += [n for n, t in (("final_norm", final_norm), ("lm_head", lm_head), *biases.items()) if not all_finite(t)]
    grad_nll = loss_grad(W, T - 1, window_weights_W) if backward else None
    if device is not None:
        final_norm, lm_head, tokens_WT, grad_nll, biases = moved(
            (final_norm, lm_head, tokens_WT, grad_nll, biases), device, non_blocking=True
        )
    streams = None
    if spec.hc is not None:  # HY-V4: the streams mixed into one before the final norm, under autograd
        hc_head = hc_head_weights(ckpt, dtype)
        bad += [n for n, t in zip(("hc_head_fn", "hc_head_base", "hc_head_scale"), hc_head) if not all_finite(t)]
        hc_head = hc_head if device is None else moved(hc_head, device, non_blocking=True)
        streams = x.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            x = hc_collapse(spec, hc_head, streams)
    head = lm_head_pass(spec, final_norm, lm_head, x.detach(), tokens_WT, grad_nll, **biases)
    if streams is not None and head.grad_x_WTH is not None:
        backward_from([x], [head.grad_x_WTH])
        assert streams.grad is not None
        head.grad_x_WTH = streams.grad
    del final_norm, lm_head, x, streams
    nll, nll_W, entropy = to_host((head.nll_WT1.mean(), head.nll_WT1.mean(1), head.entropy_WT1.mean()), device)
    result = ReplayResult(float(nll), nll_W, float(entropy), routing, nonfinite_weights=bad)
    if not backward:
        return result
    result.kept_layers = stash.layers if stash is not None else []

    grad = head.grad_x_WTH
    assert grad is not None
    trim = trimmer(device)
    for step, i in enumerate(reversed(range(spec.num_layers))):
        lw = on_device(ckpt.layer_weights(i, dtype, lazy_experts=True, device=device), device)
        kept = stash.take(i) if stash is not None else None
        grad, layer = layer_backward(spec, lw, inputs[i], grad, rope, device, kept)
        if layer is not None:
            result.grads[i] = layer
        for observe_grad in grad_observers:
            observe_grad(lw)
        inputs[i] = None
        del lw
        trim()
        tick(f"backward layer {i + 1}/{spec.num_layers}", spec.num_layers + step + 1, n_steps)
    return result


def greedy_generate(
    ckpt: Checkpoint,
    prompts_PT: torch.Tensor,
    new_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: Device = None,
) -> torch.Tensor:
    """Greedy continuation [P, new_tokens] (no KV cache: each step re-streams the decoder, which
    keeps one layer resident; the generation receipts are opt-in because of that cost), computed
    on ``device`` as the replay is; the tokens come back to the host after each step."""
    dev = prepare_device(device)
    check_shared_index(ckpt.spec, prompts_PT.shape[1] + new_tokens - 1)  # the longest sequence run
    with replay_scope(dev):
        spec = ckpt.spec
        final_norm, lm_head, biases = moved(
            (ckpt.read_global("final_norm", dtype), ckpt.read_global("lm_head", dtype), head_biases(ckpt, dtype)),
            dev,
            non_blocking=True,
        )
        hc_head = moved(hc_head_weights(ckpt, dtype), dev, non_blocking=True) if spec.hc is not None else None
        seq = prompts_PT.long()
        for _ in range(new_tokens):
            rope = moved(rope_tables(spec, seq.shape[1]), dev, non_blocking=True)
            x, _, _ = forward_pass(ckpt, seq, rope, dtype=dtype, device=dev)
            with torch.no_grad():
                x = x if hc_head is None else hc_collapse(spec, hc_head, x)
            seq = torch.cat([seq, _next_token(spec, final_norm, lm_head, biases, x[:, -1]).cpu()], dim=1)
    return seq[:, prompts_PT.shape[1] :]


@torch.no_grad()
def _next_token(
    spec: ModelSpec,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
    biases: dict[str, torch.Tensor],
    x_PH: torch.Tensor,
) -> torch.Tensor:
    logits = F.linear(
        block_norm(spec, x_PH, final_norm, biases.get("final_norm_bias"), spec.final_eps),
        lm_head,
        biases.get("lm_head_bias"),
    )
    return logits.argmax(-1, keepdim=True)
