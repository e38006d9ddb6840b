"""Layer-local streaming replay: one forward + one backward over the canary (SPEC §3).

Forward: read layer ℓ's weights, run it, keep its *input* (not its activations), hand the
taps to observers while the weights are resident, drop the weights. Backward: walk the
layers in reverse, re-read each layer's weights, recompute it from its stored input with
autograd on, and push the incoming gradient through it. At any time one decoder layer's
weights are resident; the per-layer state kept is the N×H input (N×S×H: HY-V4's S residual streams).

Memory (issue 6): a layer's routed experts stay in their on-disk dtype and are converted to
the compute dtype one expert at a time; in the backward each expert's weight gradients are
formed, measured and dropped before the next (``experts_backward``); the LM head works on
row chunks, so the [N, V] logits never exist at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from moeaudit.checkpoint.checkpoint import (
    KDA_NAMES,
    LIGHTNING_NAMES,
    LINEAR_ATTENTION_NAMES,
    Checkpoint,
    LayerWeights,
)
from moeaudit.replay.device import (
    Device,
    moved,
    on_device,
    prepare_device,
    replay_scope,
    to_host,
)
from moeaudit.replay.device import DeviceExperts as DeviceExperts  # re-exported
from moeaudit.replay.model import (
    ExtraExperts,
    MoETap,
    Routing,
    attention_block,
    block_norm,
    decoder_layer,
    expert_slots,
    experts_backward,
    experts_forward_sets,
    hc_add,
    hc_attention_block,
    hc_mix,
    input_scales,
    mlp_input,
    moe_router,
    rms_norm,
    rope_tables,
    shared_expert,
    shortcut_rest,
)
from moeaudit.replay.model import (
    embed as embed_tokens,
)
from moeaudit.replay.offload import StoredInputs
from moeaudit.replay.stash import ExpertStash, Kept, activation_budget, reserved_bytes
from moeaudit.spec.config import HC_NAMES, MAMBA_NAMES, MOA_NAMES, SECOND_BLOCK, SHORT_CONV_NAMES, ModelSpec

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
    parallel: dict[str, Any] | None = None  # expert-parallel replay: world size, backend, devices
    kept_layers: list[int] = field(default_factory=list)  # layers whose W1/W3 products the backward reused


def _detached(r: Routing) -> Routing:
    return Routing(
        r.scores_NE.detach(),
        r.probs_NE.detach(),
        r.topk_NK,
        r.combine_NK.detach(),
        None if r.logits_NE is None else r.logits_NE.detach(),
        r.margin_N,
    )


def _load_trim() -> Callable[[], object]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return lambda: None
    return lambda: trim(0)


# glibc keeps freed blocks below its (dynamic, up to 32 MB) mmap threshold in the heap, and a
# layer's many short-lived tensors fragment it: without a trim after each layer the peak RSS
# of a 32-layer replay grows by ~25% with memory that is free but not returned (issue 6).
release_freed_memory = _load_trim()


def trimmer(device: Device) -> Callable[[], object]:
    """What to call after each layer: the trim on the host; nothing on an accelerator, where the
    host holds the pinned copies and little else, and a trim costs ~12 ms a layer (0.2 s of the
    1.32 B GPU benchmark's replay, docs/benchmarks.md "GPU")."""
    dev = prepare_device(device)
    return release_freed_memory if dev is None or dev.type == "cpu" else (lambda: None)


_SUMMABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t``. Fast path: a NaN or ±Inf anywhere makes the float32 sum non-finite,
    so a finite sum settles it in one pass; only a non-finite sum (which finite values can also
    reach by overflow) needs the element-wise check."""
    if t.dtype in _SUMMABLE and bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


class FiniteCheck:
    """Which weights hold NaN or Inf, over a whole forward: tensors on the host are checked at
    once (``all_finite``), tensors on a device queue an exact flag there (``isfinite(t).all()``,
    no fallback needed) and are read back together at the end — one host read for the pass,
    not one per layer (a read waits for the device's queue; tests/test_host_syncs.py)."""

    def __init__(self, device: Device = None) -> None:
        self.device = prepare_device(device)
        self.entries: list[tuple[str, bool | int]] = []  # name, host verdict or index of a device flag
        self.flags: list[torch.Tensor] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.device is None or t.device != self.device:
            self.entries.append((name, all_finite(t)))
        else:
            self.entries.append((name, len(self.flags)))
            self.flags.append(torch.isfinite(t).all())

    def nonfinite(self) -> list[str]:
        read = torch.stack(self.flags).tolist() if self.flags else []
        return [n for n, f in self.entries if not (f if isinstance(f, bool) else read[f])]


def nonfinite_names(lw: LayerWeights) -> list[str]:
    """Which of a layer's tensors hold NaN or Inf (checked once, in the forward pass, on the
    tensors as stored: converting to float32 neither creates nor removes a NaN/Inf)."""
    check = FiniteCheck()
    for n, t in lw.stored_tensors():
        check.add(f"layer {lw.layer} {n}", t)
    return check.nonfinite()


def _extra_requests(observers: Sequence[Observer]) -> ExtraExperts | None:
    """Merge the observers' ``extra_experts(layer, routing)`` requests (optional method): the
    expert outputs they need beyond R_k, computed in the replay's own sweep over the experts."""
    asks = [ask for o in observers if (ask := getattr(o, "extra_experts", None)) is not None]
    if not asks:
        return None

    def extra(layer: int, routing: Routing) -> dict[str, torch.Tensor]:
        return {name: idx for ask in asks for name, idx in ask(layer, routing).items()}

    return extra


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
    those (issue 31 §4; ``receipts.deferred``). The routing returned is on the host (one copy
    per layer, N·E numbers, only when kept). The layer inputs stay on the device up to a memory
    budget, the first layers' beyond it wait in host memory (``replay.offload``, issue 31 §6).
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
    extra = _extra_requests(observers)
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
                routing[i] = _detached(tap.routing if device is None else to_host(tap.routing, device))
            for observe in observers:
                observe(tap, lw)
        del lw, tap
        trim()
        tick(f"forward layer {i + 1}/{spec.num_layers}", i + 1, total_steps or spec.num_layers)
    if nonfinite is not None:
        nonfinite.extend(check.nonfinite())
    return x, inputs, routing


HEAD_CHUNK_ELEMENTS = 1 << 23  # logits rows per LM-head chunk × vocabulary (32 MB of float32)


@dataclass
class Head:
    """The LM head over all W·(T−1) predicted positions, computed in row chunks so that the
    [N, V] logits never exist at once."""

    nll_WT1: torch.Tensor
    entropy_WT1: torch.Tensor
    grad_x_WTH: torch.Tensor | None  # dL/dx of the final hidden state, when asked


def lm_head_pass(
    spec: ModelSpec,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
    x_WTH: torch.Tensor,
    tokens_WT: torch.Tensor,
    grad_nll_WT1: torch.Tensor | None,
    *,
    final_norm_bias: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
) -> Head:
    """NLL and predictive entropy per position; with ``grad_nll_WT1`` = dL/dnll also dL/dx.
    Rows are independent through the final norm, the head and the softmax, so chunking them
    changes no value; the last position of each window predicts nothing and is skipped."""
    W, T, H = x_WTH.shape
    x_RH = x_WTH[:, :-1].reshape(-1, H)
    target_R = tokens_WT[:, 1:].reshape(-1)
    nll_R, ent_R = x_RH.new_empty(x_RH.shape[0]), x_RH.new_empty(x_RH.shape[0])
    grad_RH = torch.zeros_like(x_RH) if grad_nll_WT1 is not None else None
    g_R = None if grad_nll_WT1 is None else grad_nll_WT1.reshape(-1)
    step = max(1, HEAD_CHUNK_ELEMENTS // lm_head.shape[0])
    for a in range(0, x_RH.shape[0], step):
        rows = slice(a, a + step)
        xc = x_RH[rows].detach().requires_grad_(g_R is not None)
        with torch.set_grad_enabled(g_R is not None):
            xn = block_norm(spec, xc, final_norm, final_norm_bias, spec.final_eps)
        with torch.no_grad():
            logits = F.linear(xn, lm_head, lm_head_bias).float()
            if spec.logits_scaling != 1.0:  # Granite: logits ÷ s
                logits = logits / spec.logits_scaling
            logp = torch.log_softmax(logits, dim=-1)
            tgt = target_R[rows, None]
            nll_R[rows] = -logp.gather(1, tgt).squeeze(1)  # = F.cross_entropy
            p_RV = logp.exp()
            ent_R[rows] = -(p_RV * logp).sum(-1)
            del logp
        if g_R is not None and grad_RH is not None:
            # d nll / d logits = softmax − onehot(target) (what autograd's log_softmax backward
            # forms), scaled by dL/dnll; the head's own weight gradient is never needed.
            g = g_R[rows, None]
            dlogits = p_RV.mul_(g)
            dlogits.scatter_add_(1, tgt, -g)
            if spec.logits_scaling != 1.0:
                dlogits.div_(spec.logits_scaling)
            backward_from([xn], [(dlogits @ lm_head).to(xn.dtype)])
            assert xc.grad is not None
            grad_RH[rows] = xc.grad
        del p_RV, xn, xc
    grad = None
    if grad_RH is not None:
        grad = torch.zeros_like(x_WTH)
        grad[:, :-1] = grad_RH.view(W, T - 1, H)
    return Head(nll_R.view(W, T - 1), ent_R.view(W, T - 1), grad)


def head_biases(ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The final LayerNorm's bias and the LM head's bias, where the family has them (Phi-3.5-MoE)."""
    s = ckpt.spec
    names = (["final_norm_bias"] if s.layer_norm and s.norm_bias else []) + (["lm_head_bias"] if s.lm_head_bias else [])
    return {n: ckpt.read_global(n, dtype) for n in names}


def backward_from(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(roots, grads)``, through the scalar roots Σ root ⊙ grad.

    The gradients are the same bits: d/d(root) of Σ root ⊙ g is 1·g = g exactly, and the new
    sum and product nodes all run before any node of the original graph, which then runs in
    its own order (tested bit for bit against ``torch.autograd.backward`` on mixtral, qwen2_moe
    and deepseek checkpoints). What it avoids is torch's explicit-gradient path, whose first use
    in a process imports ``torch.fx``'s symbolic shapes and with them sympy — 0.55 s (482
    modules) of every replay (docs/benchmarks.md §1e).
    """
    torch.autograd.backward([(r * g.detach()).sum() for r, g in zip(roots, grads, strict=True)])


def _loss_grad(W: int, T1: int, window_weights_W: torch.Tensor | None) -> torch.Tensor:
    """dL/dnll_wt for L = mean_wt nll (or Σ_w weight_w · mean_t nll_wt), as autograd forms it."""
    if window_weights_W is None:
        return torch.ones(W, T1) / (W * T1)
    return window_weights_W.to(torch.float32)[:, None].expand(W, T1) / T1


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
) -> ReplayResult:
    """One forward (+ one backward) of L = mean next-token NLL over the canary (SPEC §3).

    ``window_weights_W`` replaces the plain mean by Σ_w weight_w · mean_t nll_wt (a domain's
    mean NLL, for gradient conflict); ``grad_observers`` see each layer's weights with the
    ``.grad`` of its non-expert parameters filled during the reverse walk (expert gradients
    are measured and dropped one expert at a time, see ``experts_backward``). ``device``
    (e.g. "cuda") computes there, one layer's weights at a time; receipts come back on the host.
    ``keep_routing=False`` leaves ``ReplayResult.routing`` empty (on a device: no N·E copy back
    per layer for a caller whose observers took what they need).
    """
    from moeaudit.limits import check_window_len

    check_window_len(tokens_WT.shape[-1])  # callers check first, naming the canary file
    check_shared_index(ckpt.spec, tokens_WT.shape[-1])
    dev = prepare_device(device)
    from moeaudit.replay import dist

    sess = dist.active()  # torchrun or --nproc: experts across the ranks (issue 28)
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
) -> ReplayResult:
    spec = ckpt.spec
    tokens_WT = tokens_WT.long()
    W, T = tokens_WT.shape
    rope = rope_tables(spec, T) if device is None else moved(rope_tables(spec, T), device, non_blocking=True)
    n_steps = spec.num_layers * (2 if backward else 1)
    tick = progress or (lambda *_: None)
    bad: list[str] = []
    stash = (
        ExpertStash(spec, W * T, activation_budget(device, reserved_bytes(spec, W * T, dtype)), dtype)
        if backward
        else None
    )
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
    grad_nll = _loss_grad(W, T - 1, window_weights_W) if backward else None
    if device is not None:
        final_norm, lm_head, tokens_WT, grad_nll, biases = moved(
            (final_norm, lm_head, tokens_WT, grad_nll, biases), device, non_blocking=True
        )
    streams = None
    if spec.hc_mult:  # HY-V4: the streams mixed into one before the final norm, under autograd
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


def layer_backward(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTH: torch.Tensor,
    grad_BTH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    device: torch.device | None = None,
    kept: Kept | None = None,
) -> tuple[torch.Tensor, LayerGrads | None]:
    """Recompute one layer from its input and push dL/d(output) through it: (dL/d(input),
    gradient norms). Autograd covers attention, norms, router and shared expert (whose
    ``.grad`` it fills); the routed experts go through ``experts_backward`` one at a time,
    with the forward's W1/W3 products where it ``kept`` them (``replay.stash``)."""
    for t in lw.params.values():
        t.requires_grad_(True)
    x = x_BTH.detach().requires_grad_(True)
    if not lw.routed:
        with torch.enable_grad():
            out, _ = decoder_layer(spec, lw, x, rope)
        backward_from([out], [grad_BTH])
        assert x.grad is not None
        return x.grad, None
    if spec.hc_mult:  # HY-V4: the layer's input and output are its residual streams
        return _hc_layer_backward(spec, lw, x, grad_BTH, rope, device, kept)
    B, T, H = x.shape
    with torch.enable_grad():
        h = attention_block(spec, lw, x, rope)
        y_NH, routing = moe_router(spec, lw, mlp_input(spec, x, h).reshape(-1, H))
        shared = shared_expert(spec, lw.params, y_NH, lw.layer) if spec.shared_dim else None
        bias = lw.params["moe_bias"].expand_as(y_NH) if spec.moe_bias else None  # JetMoE
        if spec.shortcut_moe:  # LongCat: out = rest(h, y) + MoE(y); the rest takes dL/d(out) as h does elsewhere
            h = shortcut_rest(spec, lw, h, y_NH.view_as(h), rope)
    g_NH = grad_BTH.reshape(-1, H)  # dL/d(MoE output): × Granite's residual multiplier
    g_NH = g_NH if spec.residual_multiplier == 1.0 else g_NH * spec.residual_multiplier
    scales = spec.residual_scales[2] if spec.residual_scales is not None else None
    g_NH = g_NH if scales is None else g_NH * scales[1]  # MiniMax-01: out = α·y + β·MoE(y)
    out_norm, slots = None, None
    if spec.moe_out_norm:  # A.X-K1: out = h + norm(routed + shared); dL/d(routed + shared) through the norm
        slots = expert_slots(routing.topk_NK, len(lw.experts))  # one sync for both sweeps
        g_NH, out_norm = _through_out_norm(spec, lw, y_NH, routing, shared, g_NH, slots)
    back = experts_backward(
        lw.experts,
        y_NH.detach(),
        routing.topk_NK,
        routing.combine_NK.detach(),
        g_NH,
        spec.expert_glu(lw.layer),
        spec.scaled_expert_inputs,
        sorted_slots=slots,
        kept=kept,
    )
    roots, grads = [h, y_NH, routing.combine_NK], [grad_BTH, back.y_NH, back.combine_NK]
    if scales is not None:  # no identity path from h: dL/dy = α·dL/d(out) + the experts'
        roots, grads = roots[1:], [back.y_NH + scales[0] * grad_BTH.reshape(-1, H), back.combine_NK]
    if shared is not None:
        roots.append(shared)
        grads.append(g_NH)
    if bias is not None:  # JetMoE: the bias on the MoE output gets dL/d(MoE output), summed over tokens
        roots.append(bias)
        grads.append(g_NH)
    if out_norm is not None:  # the norm's gain (its input is a detached leaf: nothing else moves)
        roots.append(out_norm[0])
        grads.append(out_norm[1])
    backward_from(roots, grads)
    assert x.grad is not None
    # a zero-computation expert (LongCat) has no weights, hence no gradient norm: not reported
    return x.grad, layer_grads(lw, back.sq_E[: spec.parametric_experts], device)


def _hc_layer_backward(
    spec: ModelSpec,
    lw: LayerWeights,
    x_BTSH: torch.Tensor,
    grad_BTSH: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    device: torch.device | None,
    kept: Kept | None,
) -> tuple[torch.Tensor, LayerGrads | None]:
    """:func:`layer_backward` of a routed HY-V4 layer, out = x1 + post ⊗ (routed + shared)(y):
    dL/d(block output) and dL/dpost need the block's output, so the routed part is formed again
    (one more sweep over the chosen experts, as for A.X-K1's output norm) and autograd takes the
    hyper-connection's output on a detached copy of it; the experts then get Σ_s post_s dL/dout_s."""
    p = lw.params
    B, T, S, H = x_BTSH.shape
    with torch.enable_grad():
        x1 = hc_attention_block(spec, lw, x_BTSH, rope)
        post, m_BTH = hc_mix(spec, p["ffn_hc_fn"], p["ffn_hc_base"], p["ffn_hc_scale"], x1)
        assert post is not None
        y_NH, routing = moe_router(spec, lw, m_BTH.reshape(-1, H))
        shared = shared_expert(spec, p, y_NH, lw.layer) if spec.shared_dim else None
    slots = expert_slots(routing.topk_NK, len(lw.experts))  # one sync for both sweeps
    with torch.no_grad():
        sets = [routing.topk_NK]
        (u_NKH,) = experts_forward_sets(
            lw.experts, y_NH.detach(), sets, spec.expert_glu(lw.layer), sorted_slots=[slots]
        )
        s_NH = (u_NKH * routing.combine_NK.detach().to(u_NKH.dtype)[..., None]).sum(1)
        del u_NKH
        if shared is not None:
            s_NH = s_NH + shared.detach()
    s_NH = s_NH.requires_grad_(True)
    with torch.enable_grad():
        out = hc_add(post, s_NH.view(B, T, H), x1)
    (g_NH,) = torch.autograd.grad(out, s_NH, grad_BTSH, retain_graph=True)
    back = experts_backward(
        lw.experts,
        y_NH.detach(),
        routing.topk_NK,
        routing.combine_NK.detach(),
        g_NH,
        spec.expert_glu(lw.layer),
        sorted_slots=slots,
        kept=kept,
    )
    roots, grads = [out, y_NH, routing.combine_NK], [grad_BTSH, back.y_NH, back.combine_NK]
    if shared is not None:
        roots.append(shared)
        grads.append(g_NH)
    backward_from(roots, grads)
    assert x_BTSH.grad is not None
    return x_BTSH.grad, layer_grads(lw, back.sq_E, device)


def _through_out_norm(
    spec: ModelSpec,
    lw: LayerWeights,
    y_NH: torch.Tensor,
    routing: Routing,
    shared: torch.Tensor | None,
    g_out_NH: torch.Tensor,
    slots: tuple[torch.Tensor, list[int]],
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A MoE block whose output s = routed + shared passes an RMSNorm: the routed output is
    recomputed (one more sweep over the chosen experts), and dL/ds = J_norm^T dL/d(out) taken by
    autograd on a detached s; returns (dL/ds, (the normed output, dL/d it) for the gain's gradient)."""
    with torch.no_grad():
        sets = [routing.topk_NK]
        (u_NKH,) = experts_forward_sets(
            lw.experts,
            y_NH.detach(),
            sets,
            spec.expert_glu(lw.layer),
            input_scales(spec, routing, sets),
            sorted_slots=[slots],
        )
        s_NH = (u_NKH * routing.combine_NK.detach().to(u_NKH.dtype)[..., None]).sum(1)
        if shared is not None:
            s_NH = s_NH + shared.detach()
        if spec.moe_bias:
            s_NH = s_NH + lw.params["moe_bias"].detach()
    s_NH = s_NH.requires_grad_(True)
    with torch.enable_grad():
        out_NH = rms_norm(s_NH, lw.params["moe_out_norm"], spec.rms_eps)
    (g_s_NH,) = torch.autograd.grad(out_NH, s_NH, g_out_NH, retain_graph=True)
    return g_s_NH, (out_NH, g_out_NH)


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
        hc_head = moved(hc_head_weights(ckpt, dtype), dev, non_blocking=True) if spec.hc_mult else None
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


ATTENTION_GRADS = (
    "q",
    "k",
    "v",
    "o",
    "q_bias",
    "k_bias",
    "v_bias",
    "o_bias",
    "q_norm",
    "k_norm",
    "input_norm",
    "input_norm_bias",
    "attn_out_norm",
    "q_a",
    "q_a_bias",
    "q_a_norm",
    "q_b",
    "kv_a",
    "kv_a_bias",
    "kv_a_norm",
    "kv_b",
    "sinks",
    "qkv",
    "qkv_bias",
    "g_proj",
    *(SECOND_BLOCK + n for n in ("input_norm", "q_a", "q_a_bias", "q_a_norm", "q_b", "kv_a", "kv_a_bias")),
    *(SECOND_BLOCK + n for n in ("kv_a_norm", "kv_b", "o", "o_bias")),  # LongCat's second attention
    *LIGHTNING_NAMES,
    *LINEAR_ATTENTION_NAMES,
    *KDA_NAMES,
    *MAMBA_NAMES,
    *SHORT_CONV_NAMES,
    *MOA_NAMES,
    *HC_NAMES[:3],  # HY-V4: the attention sub-block's hyper-connection (it forms the attention's input)
)


def _sum_sq(tensors: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """Σ ‖grad‖² over ``tensors`` in float64, where the gradients live (no host sync)."""
    total = like.new_zeros(())
    for t in tensors:
        if t is not None and t.grad is not None:
            total = total + t.grad.double().pow(2).sum()
    return total


def layer_grads(lw: LayerWeights, sq_E: torch.Tensor, device: torch.device | None = None) -> LayerGrads:
    """Gradient norms of one layer from ``sq_E`` = ‖∇_{θ_e} L‖² per expert (float64, on the
    compute device) and the ``.grad`` of its other weights: every number of the layer comes to
    the host in one transfer (issue 31 §4), not one sync per tensor."""
    p = lw.params
    groups = (
        [p["router"], p.get("router_logit_bias")],
        [p.get(n) for n in ATTENTION_GRADS],
        # JetMoE's bias on the MoE output: an always-on term of the block, with the shared expert
        [p.get(n) for n in ("shared_w1", "shared_w3", "shared_w2", "shared_gate", "moe_bias")],
    )
    sq = to_host(torch.cat([sq_E, torch.stack([_sum_sq(g, sq_E) for g in groups])]), device)
    router, attention, shared = (float(v) ** 0.5 for v in sq[len(sq_E) :].tolist())
    return LayerGrads(sq[: len(sq_E)].sqrt(), router=router, shared=shared, attention=attention)
