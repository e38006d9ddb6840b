"""The measured agreement of a reduced-precision replay with the fp32 reference (docs/decisions.md,
"Reduced-precision replay (`--precision tf32|bf16`)"): the same seeded subset of canary windows replayed in both, and
how far apart their routing, loss and per-expert gradient norms land. docs/policy.md ("Reduced precision")
says how the gates read it."""

from __future__ import annotations

import statistics
from typing import TypedDict

import torch

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint
from moeaudit.precision import REFERENCE, current, precision_mode, ran
from moeaudit.records import FlipRates, GradNormAgreement, NllAgreement, PrecisionAgreement, Receipts
from moeaudit.replay import ReplayResult, replay
from moeaudit.replay import precision as replay_precision

WINDOWS = 4  # windows of the canary replayed twice (min(W, 4))
RESOLUTION_RULE = "max(the layer's router-perturbation flip rate (sigma = 0.01), 1/N), N = W*T canary tokens"


def agreement_windows(canary: Canary, n: int = WINDOWS) -> list[int]:
    """min(W, n) window indices, sorted, drawn by a generator seeded from the canary's digest:
    the same subset for every checkpoint audited on this canary."""
    g = torch.Generator().manual_seed(int(canary.digest[:15], 16))
    return sorted(torch.randperm(canary.num_windows, generator=g)[: min(canary.num_windows, n)].tolist())


def _relative(a: float, ref: float) -> float | None:
    return abs(a - ref) / abs(ref) if ref != 0 else (0.0 if a == ref else None)


def flip_rates(ref: ReplayResult, low: ReplayResult) -> dict[int, float]:
    """Per routed layer, the fraction of tokens whose top-k set (as a set) differs between the two."""
    out = {}
    for layer, r in ref.routing.items():
        a = r.topk_NK.sort(-1).values
        b = low.routing[layer].topk_NK.sort(-1).values
        out[layer] = float((a != b).any(-1).double().mean())
    return out


class Replayed(TypedDict):
    """What two replays of the same windows say of each other (:func:`compare_results`)."""

    topk_flip_rate: FlipRates
    nll: NllAgreement
    grad_norm_relative_difference: GradNormAgreement


class _Kernel(TypedDict, total=False):
    expert_kernel: str


def compare_results(ref: ReplayResult, low: ReplayResult) -> Replayed:
    """The numbers of the agreement block from two replays of the same windows."""
    flips = flip_rates(ref, low)
    rel: list[float] = []
    for layer, g in ref.grads.items():
        a, b = g.experts_E.double(), low.grads[layer].experts_E.double()
        rel += [abs(y - x) / x for x, y in zip(a.tolist(), b.tolist(), strict=True) if x > 0]
    return {
        "topk_flip_rate": {
            "overall": statistics.fmean(flips.values()) if flips else 0.0,
            "max": max(flips.values(), default=0.0),
            "layers": {str(k): v for k, v in sorted(flips.items())},
        },
        "nll": {"reference": ref.nll, "measured": low.nll, "relative_difference": _relative(low.nll, ref.nll)},
        "grad_norm_relative_difference": {
            "max": max(rel, default=0.0),
            "median": statistics.median(rel) if rel else 0.0,
            "experts": len(rel),
        },
    }


def resolution(doc: Receipts) -> dict[str, float]:
    """Per routed layer, the boundary receipts' own resolution (:data:`RESOLUTION_RULE`): the
    flip rate their router perturbation already causes, at least one token in N."""
    n = doc["canary"]["windows"] * doc["canary"]["window_len"]
    out = {}
    for entry in doc["layers"]:
        flip = entry.get("boundary", {}).get("flip_rate")
        out[str(entry["layer"])] = max(float(flip) if flip is not None else 0.0, 1.0 / n)
    return out


def measure(ckpt: Checkpoint, canary: Canary, doc: Receipts, device: str | None = None) -> PrecisionAgreement | None:
    """The agreement block for receipts ``doc`` computed in the current precision (None for fp32,
    the reference, and for tf32 off CUDA, which ran as fp32)."""
    asked = current()
    done = ran(asked, device)
    if done == REFERENCE:
        return None
    windows = agreement_windows(canary)
    tokens = canary.tokens[windows]
    with precision_mode(REFERENCE):
        ref = replay(ckpt, tokens, device=device)
    replay_precision.KERNELS_RUN.clear()
    low = replay(ckpt, tokens, device=device)
    kernels = sorted(replay_precision.KERNELS_RUN)
    kernel: _Kernel = {"expert_kernel": kernels[0] if len(kernels) == 1 else "mixed"} if kernels else {}
    compared = compare_results(ref, low)
    res = resolution(doc)
    inside = {k: v <= res[k] for k, v in compared["topk_flip_rate"]["layers"].items() if k in res}
    return {
        "reference": REFERENCE,
        "precision": done,
        **kernel,
        "windows": windows,
        "tokens_per_layer": len(windows) * canary.window_len,
        **compared,
        "resolution": {"rule": RESOLUTION_RULE, "layers": res},
        "within_resolution": all(inside.values()),
    }
