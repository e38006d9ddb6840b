"""The replay's compute precision (``--precision fp32|tf32|bf16``; docs/policy.md, "Reduced precision").

fp32 is the reference and the default, and nothing here runs on it: every function below does
nothing (or is not called) unless a lower precision was asked for with
``moeaudit.precision.precision_mode``, so fp32 receipts are the bytes they were before the mode
existed (tests/test_precision.py).

* ``tf32``: float32 storage, cuBLAS / cuDNN products in TF32 inside the replay scope
  (:func:`moeaudit.replay.device.replay_scope`). Only CUDA has TF32 kernels here; on any other
  device the products stay IEEE float32 and the receipts record ``fp32``, what actually ran
  (``moeaudit.precision.ran``).
* ``bf16``: the routed experts' products in bfloat16 — the weights and the gathered token rows
  cast to bf16, the matmuls accumulating in float32 inside the GEMM (cuBLAS and the CPU's
  kernels do), their outputs and the element-wise SwiGLU in bf16 as transformers' bf16 forward
  computes them, the combine-weight gradient summed in float32, each expert's weight-gradient
  norm taken in float64 from its bf16 gradient. Attention, norms, router and LM head stay in
  float32, so the routing decision is taken on float32 scores of a state the bf16 experts moved
  (docs/decisions.md "Reduced-precision replay"). The products of a layer run as grouped GEMMs
  (``torch._grouped_mm``: one kernel per product over all of the layer's chosen experts) where
  the kernel exists (CUDA sm_90 / sm_100, sizes a multiple of 8) and as one bf16 matmul per
  expert otherwise — the same products of the same operands (bit for bit on the CPU; on a GPU
  up to the kernels' accumulation order) (:func:`grouped_kernel`).

A lower precision is only licensed with a measured agreement with fp32 on the canary
(:mod:`moeaudit.receipts.agreement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn.functional as F

from moeaudit.precision import current, forced_kernel
from moeaudit.replay.device import announce


def low_precision_experts() -> bool:
    """True when the routed experts compute in bf16 (the replay's expert sweeps branch here)."""
    return current() == "bf16"


LOW: Final = torch.bfloat16
GROUPED: Final = "grouped_mm"  # torch._grouped_mm, one kernel per product over a layer's experts
PER_EXPERT: Final = "per-expert matmul"
KERNELS_RUN: set[str] = set()  # which of the two ran since it was last cleared (the agreement records it)


def grouped_kernel(device: torch.device, dims: Sequence[int]) -> bool:
    """Whether the layer's products run as grouped GEMMs: forced by ``precision_mode``'s
    ``kernel``, else on CUDA devices of compute capability 9.x or 10.x (where torch's grouped bf16
    GEMM is a CUTLASS kernel) when every size is a multiple of 8 (its 16-byte stride rule)."""
    forced = forced_kernel()
    aligned = hasattr(torch, "_grouped_mm") and all(d % 8 == 0 for d in dims)
    if forced is not None:
        return forced == "grouped" and aligned
    # torch builds its CUTLASS grouped bf16 GEMM for sm_90 and sm_100 (ATen GroupMM.cu); each
    # group's operand starts at a row offset × a row stride that the size rule keeps 16-byte aligned
    return aligned and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)


@dataclass
class _Group:
    """The rows of one expert-index set sorted by expert, over the experts that get any."""

    slots: torch.Tensor  # [M] flat (token, slot) indices, sorted by expert (stable)
    used: list[int]  # the experts with rows, in order
    sizes: list[int]  # rows per used expert


def _group(order: torch.Tensor, counts: Sequence[int]) -> _Group:
    used = [e for e, c in enumerate(counts) if c]
    return _Group(order, used, [counts[e] for e in used])


class _Products:
    """x @ W_eᵀ for consecutive row blocks, one block per used expert: one grouped GEMM, or one
    bf16 matmul per expert — the same bf16 operands either way."""

    def __init__(self, weights: dict[str, torch.Tensor], sizes: Sequence[int], grouped: bool):
        KERNELS_RUN.add(GROUPED if grouped else PER_EXPERT)
        self.w, self.sizes, self.grouped = weights, list(sizes), grouped
        self._offs: torch.Tensor | None = None
        if grouped:  # the group ends, int32, sent once without a stream synchronisation (device.to_device)
            ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            self._offs = ends.to(next(iter(weights.values())).device, non_blocking=True)

    def _blocks(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.split(self.sizes))

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Row block j times W_jᵀ (F.linear per expert): [M, out]."""
        W = self.w[name]  # [G, out, in]
        if self._offs is not None:
            return torch._grouped_mm(x, W.transpose(1, 2), offs=self._offs)
        return torch.cat([F.linear(xb, W[j]) for j, xb in enumerate(self._blocks(x))])

    def matmul(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Row block j times W_j (the transposed product, for dL/dx): [M, in]."""
        W = self.w[name]
        if self._offs is not None:
            return torch._grouped_mm(x, W, offs=self._offs)
        return torch.cat([xb @ W[j] for j, xb in enumerate(self._blocks(x))])

    def outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Per block, a_jᵀ @ b_j (a weight gradient): [G, a.cols, b.cols]."""
        if self._offs is not None:
            return torch._grouped_mm(a.t(), b, offs=self._offs)
        return torch.stack([ab.t() @ bb for ab, bb in zip(self._blocks(a), self._blocks(b), strict=True)])


def _stacked(experts: Sequence[dict[str, torch.Tensor]], used: Sequence[int], names: Sequence[str]) -> dict[str, Any]:
    """The used experts' weights in bf16, stacked [G, out, in] per name: one layer's chosen
    experts at a time (the layer-local bound, docs/glossary.md, "Replay"), each converted from its stored dtype once."""
    announce(experts, list(used))
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for e in used:
        w = experts[e]
        for n in names:
            parts[n].append(w[n].to(LOW))
        del w
    return {n: torch.stack(ts) for n, ts in parts.items()}


def unsupported(spec: Any) -> str | None:
    """Why ``spec``'s routed experts have no bf16 path (None: plain SwiGLU experts, which it
    covers): the other expert forms keep the fp32 replay rather than an untested bf16 one."""
    layers = list(getattr(spec, "routed_layers", ()))
    if spec.mlp_act != "swiglu":
        return f"its experts are {spec.mlp_act} MLPs"
    if any(spec.expert_glu(i) is not None for i in layers) or spec.clamped_glu is not None:
        return "its experts use a clamped GLU"
    if spec.moe.scaled_inputs:
        return "its experts scale their inputs by the combine weight"
    if spec.zero_experts:
        return "it has zero-computation experts"
    if any(getattr(layer.ffn, "out_norm", False) for layer in spec.layers) or spec.hc is not None:
        return "its MoE output is normed or hyper-connected"
    return None


def check_supported(spec: Any, precision: str) -> None:
    """An input error (exit 4) naming why, when ``precision`` is bf16 and ``spec`` has no bf16 path."""
    from moeaudit.errors import InputError

    if precision == "bf16" and (why := unsupported(spec)) is not None:
        raise InputError(
            f"--precision bf16 covers plain SwiGLU experts; {spec.family}: {why}",
            hint="replay it with --precision fp32 (the reference)",
        )


def check_sweep(glu: bool, scaled: bool, sharded: bool) -> None:
    """Refuse a sweep the bf16 path does not cover (the entry points refuse first, by the spec:
    :func:`check_supported`; this is the replay's own guard, e.g. an expert-parallel replay)."""
    from moeaudit.errors import InputError

    if glu or scaled or sharded:
        what = "a clamped GLU" if glu else "scaled expert inputs" if scaled else "an expert-parallel replay"
        raise InputError(
            f"--precision bf16 covers plain SwiGLU experts on one process, not {what}",
            hint="replay with --precision fp32 (the reference)",
        )


def forward_sets(
    experts: Sequence[dict[str, torch.Tensor]],
    y_NH: torch.Tensor,
    sets: Sequence[torch.Tensor],
    slots: Sequence[tuple[torch.Tensor, list[int]]],
) -> list[torch.Tensor]:
    """``experts_forward_sets`` of plain SwiGLU experts in bf16 (module docstring): u_NXH per
    set, float32, each (token, slot) row the bf16 expert output it gets."""
    H = y_NH.shape[-1]
    used = sorted({e for _, counts in slots for e, c in enumerate(counts) if c})
    if not used:
        return [y_NH.new_zeros(idx.shape[0], idx.shape[1], H) for idx in sets]
    W = _stacked(experts, used, ("w1", "w3", "w2"))
    grouped = grouped_kernel(y_NH.device, (H, W["w1"].shape[1]))
    where = {e: j for j, e in enumerate(used)}
    out = []
    for idx, (order, counts) in zip(sets, slots, strict=True):
        g = _group(order, counts)
        sel = [where[e] for e in g.used]
        rows = torch.tensor(sel).to(y_NH.device, non_blocking=True)
        Wg = W if sel == list(range(len(used))) else {n: t.index_select(0, rows) for n, t in W.items()}
        P = _Products(Wg, g.sizes, grouped)
        x = y_NH[g.slots // idx.shape[1]].to(LOW)
        h = F.silu(P.linear(x, "w1")) * P.linear(x, "w3")
        u = y_NH.new_zeros(idx.numel(), H)
        u[g.slots] = P.linear(h, "w2").to(y_NH.dtype)
        out.append(u.view(idx.shape[0], idx.shape[1], H))
    return out


def backward(
    experts: Sequence[dict[str, torch.Tensor]],
    y_NH: torch.Tensor,
    topk_NK: torch.Tensor,
    combine_NK: torch.Tensor,
    grad_NH: torch.Tensor,
    order: torch.Tensor,
    counts: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``experts_backward`` of plain SwiGLU experts in bf16: (dL/dy [N, H] float32, dL/dc
    [N, K] float32, ‖∇_{θ_e} L‖² [E] float64) — the algebra of ``model._swiglu_grads``."""
    N, K = topk_NK.shape
    E = len(experts)
    dy_NH = torch.zeros_like(y_NH)
    dc_S = combine_NK.new_zeros(N * K)
    sq_E = y_NH.new_zeros(E, dtype=torch.float64)
    g = _group(order, counts)
    if not g.used:
        return dy_NH, dc_S.view(N, K), sq_E
    W = _stacked(experts, g.used, ("w1", "w3", "w2"))
    P = _Products(W, g.sizes, grouped_kernel(y_NH.device, (y_NH.shape[-1], W["w1"].shape[1])))
    tok = g.slots // K
    x = y_NH[tok].to(LOW)
    c = combine_NK.reshape(-1)[g.slots].to(LOW)[:, None]
    gout = grad_NH[tok].to(LOW)
    a1, a3 = P.linear(x, "w1"), P.linear(x, "w3")
    s, sig = F.silu(a1), torch.sigmoid(a1)
    h = s * a3
    p = P.matmul(gout, "w2")  # dL/dh before the combine weight
    dc_S[g.slots] = (h.float() * p.float()).sum(-1).to(dc_S.dtype)
    dh = p * c
    dw2 = P.outer(gout * c, h)
    da3 = dh * s
    da1 = dh * a3 * (sig * (1 + a1 * (1 - sig)))  # silu'(a) = σ(a)(1 + a(1 − σ(a)))
    dx = P.matmul(da1, "w1") + P.matmul(da3, "w3")
    dy_NH.index_add_(0, tok, dx.to(dy_NH.dtype))
    sq = sq_E.new_zeros(len(g.used))
    for d in (P.outer(da1, x), P.outer(da3, x), dw2):  # ‖dW1‖² + ‖dW3‖² + ‖dW2‖², as _sum_of_squares
        n = torch.linalg.vector_norm(d, dim=(1, 2), dtype=torch.float64)
        sq = sq + n * n
    sq_E[torch.tensor(g.used).to(sq_E.device, non_blocking=True)] = sq
    return dy_NH, dc_S.view(N, K), sq_E
