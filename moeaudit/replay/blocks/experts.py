"""The routed experts' forward and hand-written backward, one expert at a time (layer-local:
docs/glossary.md, "Replay")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeaudit.replay import precision
from moeaudit.replay.blocks.mlp import expert_mlp
from moeaudit.replay.blocks.router import (
    Routing,
)
from moeaudit.replay.device import announce
from moeaudit.spec.config import ClampedGLU, ModelSpec


def _expert_slots(topk_NK: torch.Tensor, E: int) -> tuple[torch.Tensor, list[int]]:
    """(slots of [N·K] sorted by expert, stable; tokens per expert)."""
    return _slots_of_sets([topk_NK], E)[0]


expert_slots = _expert_slots  # for callers that sweep the experts twice with one host sync (engine)


def _slots_of_sets(sets: Sequence[torch.Tensor], E: int) -> list[tuple[torch.Tensor, list[int]]]:
    """:func:`_expert_slots` of each set, the tokens per expert of all of them brought to the
    host together: one synchronisation per sweep over the experts, not one per set."""
    flat = [idx.reshape(-1) for idx in sets]
    counts = torch.stack([torch.bincount(f, minlength=E) for f in flat]).tolist()
    return [(torch.argsort(f, stable=True), c) for f, c in zip(flat, counts, strict=True)]


def experts_forward_sets(
    experts: Sequence[dict[str, torch.Tensor]],
    y_NH: torch.Tensor,
    sets: Sequence[torch.Tensor],
    glu: ClampedGLU | None = None,
    scales: Sequence[torch.Tensor] | None = None,
    only: range | None = None,
    sorted_slots: list[tuple[torch.Tensor, list[int]]] | None = None,
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """Raw expert outputs u_NXH (docs/glossary.md, "Taps") for several expert-index sets [N, X] in one sweep
    over the experts: each expert is fetched once (lazy experts are converted once), and each
    set gets its own gathered batch, so its values are exactly those it would get alone.
    Each expert's outputs are written into their rows of the result as the sweep goes, so
    besides the result only one expert's temporaries exist at a time (docs/decisions.md, "Input
    offload is an environment setting").

    ``scales`` (Llama 4, one [N, X] per set: the combine weight c each expert gets or would
    get) makes the input of expert e c·y and its output u_e(c·y)/c, so that Σ_k c_k u_k is the
    block's output Σ_k u_k(c_k y) and the receipts keep their (c, u) form (docs/families.md).

    ``only`` (expert-parallel replay, ``replay.sharded``): compute the experts in that range and
    leave the rows of the others zero; each expert's rows are those it gets in the full sweep.
    ``sorted_slots``: the sets' ``_slots_of_sets``, when the caller has them (one host sync fewer).

    ``keep`` (``replay.stash``): for the first set, each SwiGLU expert's products (W1 x, W3 x)
    are put there under its index, for the backward to use instead of forming them again; the
    output is the one :func:`swiglu` gives (the same products in the same order)."""
    slots = _slots_of_sets(sets, len(experts)) if sorted_slots is None else sorted_slots
    if precision.low_precision_experts():  # --precision bf16 (replay.precision)
        precision.check_sweep(glu is not None, scales is not None, only is not None)
        return precision.forward_sets(experts, y_NH, sets, slots)
    announce(
        experts,
        [
            e
            for e in range(len(experts))  # the experts read below, in order
            if any(counts[e] for _, counts in slots) and (only is None or e in only)
        ],
    )
    out = [y_NH.new_zeros(idx.numel(), y_NH.shape[-1]) for idx in sets]  # rows: flat (token, slot)
    # each slot's token in sweep order, one operator per set rather than one per (expert, set):
    # on a GPU each operator is a launch (docs/scaling.md, "Operators per routed layer")
    toks = [order // idx.shape[1] for (order, _), idx in zip(slots, sets, strict=True)]
    starts = [0] * len(sets)
    for e in range(len(experts)):
        if not any(counts[e] for _, counts in slots) or (only is not None and e not in only):
            for i, (_, counts) in enumerate(slots):
                starts[i] += counts[e]
            continue
        w = experts[e]
        for i, (order, counts) in enumerate(slots):
            c = counts[e]
            if c:
                slots_c = order[starts[i] : starts[i] + c]
                tok = toks[i][starts[i] : starts[i] + c]
                if keep is not None and i == 0 and glu is None and scales is None and "w3" in w:
                    x = y_NH[tok]
                    a1, a3 = F.linear(x, w["w1"]), F.linear(x, w["w3"])
                    u = F.linear(F.silu(a1) * a3, w["w2"])
                    keep[e] = (a1, a3)
                elif scales is None:
                    u = expert_mlp(w, y_NH[tok], glu)
                else:
                    s_C1 = scales[i].reshape(-1)[slots_c].to(y_NH.dtype)[:, None]
                    u = expert_mlp(w, y_NH[tok] * s_C1, glu)
                    u = torch.where(s_C1 > 0, u / s_C1.clamp_min(torch.finfo(u.dtype).tiny), 0.0)
                out[i][slots_c] = u
                del u
            starts[i] += c
        del w
    return [u.view(idx.shape[0], idx.shape[1], y_NH.shape[-1]) for u, idx in zip(out, sets, strict=True)]


def experts_forward(
    experts: Sequence[dict[str, torch.Tensor]],
    y_NH: torch.Tensor,
    topk_NK: torch.Tensor,
    glu: ClampedGLU | None = None,
    scales_NK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw expert outputs u_NKH (docs/glossary.md, "Taps"), batched per expert: gather its tokens, one MLP."""
    return experts_forward_sets(experts, y_NH, [topk_NK], glu, None if scales_NK is None else [scales_NK])[0]


def input_scales(spec: ModelSpec, routing: Routing, sets: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Llama 4: the combine weight σ(W_r y)_e each (token, expert) of ``sets`` gets, or would get
    were the expert chosen — the scale of that expert's input (``experts_forward_sets``); None
    for the other families."""
    if not spec.moe.scaled_inputs:
        return None
    assert routing.logits_NE is not None  # sigmoid routers keep their logits
    sig_NE = torch.sigmoid(routing.logits_NE.float())
    return [sig_NE.gather(1, idx) for idx in sets]


@dataclass
class ExpertsBackward:
    """Gradients through Σ_k c_k u_k(y) of one layer (see :func:`experts_backward`)."""

    y_NH: torch.Tensor  # dL/dy through the experts
    combine_NK: torch.Tensor  # dL/dc
    sq_E: torch.Tensor  # ‖∇_{θ_e} L‖² per expert, float64 (`000` Def. 6.1)
    dx_SH: torch.Tensor | None = None  # dL/dy per (token, slot) instead of y_NH (``slot_dx``)


def _swiglu_grads(
    x_MH: torch.Tensor,
    w: dict[str, torch.Tensor],
    g_out_MH: torch.Tensor,
    c_M1: torch.Tensor,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Backward of c·W2(silu(W1 x) ⊙ W3 x) given dL/d(out) = g_out: (dL/dx, dL/dc, [dW1, dW3, dW2]).
    The forward's W2 product is never needed: ⟨u, g⟩ = ⟨silu(a1)⊙a3, g W2⟩. ``kept``: the
    forward's (W1 x, W3 x) for these rows (``replay.stash``), instead of forming them again."""
    a1, a3 = (F.linear(x_MH, w["w1"]), F.linear(x_MH, w["w3"])) if kept is None else kept
    s, sig = F.silu(a1), torch.sigmoid(a1)
    h_MI = s * a3
    p_MI = g_out_MH @ w["w2"]  # dL/dh before the combine weight
    dc_M = (h_MI * p_MI).sum(-1)
    dh_MI = p_MI.mul_(c_M1)  # p is not needed again: the [M, I] temporaries are formed in place
    dw2 = (g_out_MH * c_M1).T @ h_MI
    da3 = dh_MI * s
    dsilu = torch.rsub(sig, 1).mul_(a1).add_(1).mul_(sig)  # silu'(a) = σ(a)(1 + a(1 − σ(a)))
    da1 = dh_MI.mul_(a3).mul_(dsilu)
    dx = da1 @ w["w1"] + da3 @ w["w3"]
    return dx, dc_M, [da1.T @ x_MH, da3.T @ x_MH, dw2]


def _relu2_grads(
    x_MH: torch.Tensor, w: dict[str, torch.Tensor], g_out_MH: torch.Tensor, c_M1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`_swiglu_grads` for Nemotron-H's non-gated c·W2 relu(a)², a = W1 x:
    (dL/dx, dL/dc, [dW1, dW2]); d relu(a)²/da = 2 relu(a)."""
    r_MI = F.relu(F.linear(x_MH, w["w1"]))
    h_MI = r_MI * r_MI
    p_MI = g_out_MH @ w["w2"]  # dL/dh before the combine weight
    dc_M = (h_MI * p_MI).sum(-1)
    dw2 = (g_out_MH * c_M1).T @ h_MI
    da1 = p_MI.mul_(c_M1).mul_(r_MI).mul_(2)
    return da1 @ w["w1"], dc_M, [da1.T @ x_MH, dw2]


def _clamped_glu_grads(
    glu: ClampedGLU, x_MH: torch.Tensor, w: dict[str, torch.Tensor], g_out_MH: torch.Tensor, c_M1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`_swiglu_grads` for gpt-oss's c·(W2 h + b2), h = (clamp(u, ±L) + 1) ⊙ g σ(α g),
    g = min(a, L), a = W1 x + b1, u = W3 x + b3: (dL/dx, dL/dc, [dW1, dW3, dW2, db1, db3, db2]).
    A clamped entry passes no gradient (torch's clamp backward: only min ≤ x ≤ max does).
    ``glu.after`` (Step 3.5): h = (clamp(u, ±L) + offset) ⊙ min(silu(a), L), the gate's gradient
    silu'(a) where silu(a) ≤ L, none where it is clamped."""
    L, alpha = glu.limit, glu.alpha
    a1, a3 = F.linear(x_MH, w["w1"], w.get("b1")), F.linear(x_MH, w["w3"], w.get("b3"))
    if glu.after:
        g, u = a1, a3.clamp(-L, L)
        sig, silu = torch.sigmoid(a1), F.silu(a1)
        act = silu.clamp(max=L)
    else:
        g, u = a1.clamp(max=L), a3.clamp(-L, L)
        sig = torch.sigmoid(alpha * g)
        act = g * sig
    h_MI = (u + glu.offset) * act
    p_MI = g_out_MH @ w["w2"]
    dc_M = (h_MI * p_MI).sum(-1)
    if "b2" in w:  # gpt-oss; HY-V4's clamped SwiGLU has no biases
        dc_M = dc_M + g_out_MH @ w["b2"]
    gc_MH = g_out_MH * c_M1
    dh_MI = p_MI * c_M1
    da3 = (dh_MI * act).masked_fill_((a3 < -L) | (a3 > L), 0.0)
    da1 = (dh_MI * (u + glu.offset) * sig * (1 + alpha * g * (1 - sig))).masked_fill_(
        (silu > L) if glu.after else (a1 > L), 0.0
    )
    dx = da1 @ w["w1"] + da3 @ w["w3"]
    biases = [da1.sum(0), da3.sum(0), gc_MH.sum(0)] if "b1" in w else []
    return dx, dc_M, [da1.T @ x_MH, da3.T @ x_MH, gc_MH.T @ h_MI, *biases]


def experts_backward(
    experts: Sequence[dict[str, torch.Tensor]],
    y_NH: torch.Tensor,
    topk_NK: torch.Tensor,
    combine_NK: torch.Tensor,
    grad_NH: torch.Tensor,
    glu: ClampedGLU | None = None,
    scaled_inputs: bool = False,
    only: range | None = None,
    slot_dx: bool = False,
    sorted_slots: tuple[torch.Tensor, list[int]] | None = None,
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> ExpertsBackward:
    """The backward pass of the routed experts, one expert at a time (layer-local: docs/glossary.md, "Replay"):
    each expert's weight gradients are formed, measured (sum of squares in float64) and
    dropped before the next expert is converted, so a layer's gradients never coexist.

    Expert-parallel replay (``replay.sharded``): ``only`` runs the experts in that range (the
    others' norms, dL/dc and dL/dy contributions stay zero); ``slot_dx`` returns each (token,
    slot)'s dL/dy in ``dx_SH`` [N·K, H] rather than their sum per token (``y_NH`` is then empty),
    so that the sum can be formed after the ranks' slots are brought together, in this order.
    ``sorted_slots``: ``expert_slots`` of ``topk_NK``, when the caller has them (one host sync fewer).
    ``kept``: the forward's (W1 x, W3 x) per expert (``replay.stash``), each dropped once used."""
    N, K = topk_NK.shape
    order, counts = _expert_slots(topk_NK, len(experts)) if sorted_slots is None else sorted_slots
    if precision.low_precision_experts():  # --precision bf16 (replay.precision)
        precision.check_sweep(glu is not None, scaled_inputs, only is not None or slot_dx)
        return ExpertsBackward(*precision.backward(experts, y_NH, topk_NK, combine_NK, grad_NH, order, counts))
    announce(experts, [e for e, c in enumerate(counts) if c and (only is None or e in only)])  # read below
    dy_NH = y_NH.new_zeros((0, y_NH.shape[1])) if slot_dx else torch.zeros_like(y_NH)
    dx_SH = y_NH.new_zeros((N * K, y_NH.shape[1])) if slot_dx else None
    dc_S = combine_NK.new_zeros(N * K)
    # each slot's token and combine weight in sweep order, gathered once for the sweep rather
    # than once per expert (docs/scaling.md, "Operators per routed layer")
    tok_S, c_S = order // K, combine_NK.reshape(-1).to(y_NH.dtype)[order]
    sq: dict[int, torch.Tensor] = {}  # ‖∇_{θ_e} L‖² of the experts computed here
    start = 0
    for e, c in enumerate(counts):
        if c and (only is None or e in only):
            slots = order[start : start + c]
            tok = tok_S[start : start + c]
            x, c_M1 = y_NH[tok], c_S[start : start + c, None]
            w = experts[e]  # fetched (converted, sent to the device) once
            if not w:  # LongCat's zero-computation expert: c·y; no weights, so no norm (sq_E[e] stays 0)
                g_M = grad_NH[tok]
                dx, dc = g_M * c_M1, (g_M * x).sum(-1)
                grads: list[torch.Tensor] = []
            elif "w3" not in w:  # Nemotron-H: non-gated ReLU²
                dx, dc, grads = _relu2_grads(x, w, grad_NH[tok], c_M1)
            elif scaled_inputs:  # Llama 4: out += u_e(c·y): backward through the input c·y
                xs, ones = x * c_M1, torch.ones_like(c_M1)
                if glu is None:
                    dxs, _, grads = _swiglu_grads(xs, w, grad_NH[tok], ones)
                else:
                    dxs, _, grads = _clamped_glu_grads(glu, xs, w, grad_NH[tok], ones)
                dx, dc = dxs * c_M1, (dxs * x).sum(-1)
            elif glu is None:
                dx, dc, grads = _swiglu_grads(x, w, grad_NH[tok], c_M1, None if kept is None else kept.pop(e, None))
            else:
                dx, dc, grads = _clamped_glu_grads(glu, x, w, grad_NH[tok], c_M1)
            if dx_SH is not None:
                dx_SH[slots] = dx
            else:
                dy_NH.index_add_(0, tok, dx)
            dc_S[slots] = dc.to(dc_S.dtype)
            norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
            del dx, dc, grads, x, c_M1, w  # before the next expert is converted
            if norms:
                sq[e] = _sum_of_squares(norms)
        start += c
    zero = y_NH.new_zeros((), dtype=torch.float64)
    sq_E = torch.stack([sq.get(e, zero) for e in range(len(experts))])  # stays where it is computed
    return ExpertsBackward(dy_NH, dc_S.view(N, K), sq_E, dx_SH)


def _sum_of_squares(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ n² in float64, summed left to right as the Python float sum it replaces; that sum's
    start, 0, is left out: 0 + n² is n² exactly (n² ≥ 0 or NaN)."""
    total = norms[0] * norms[0]
    for n in norms[1:]:
        total = total + n * n
    return total
