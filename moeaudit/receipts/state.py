"""State receipts of one checkpoint on one canary (docs/glossary.md, "Per checkpoint (state receipts)"), as a
``moeaudit.receipts/v1`` document. One forward + one backward; every other receipt is computed from its taps."""

from __future__ import annotations

import platform
from typing import Final, Literal, cast

import torch

from moeaudit import __version__
from moeaudit.canary import Canary
from moeaudit.canary_units import canary_units
from moeaudit.checkpoint import Checkpoint
from moeaudit.jsonio import finite_document
from moeaudit.limits import check_window_len
from moeaudit.policy import Policy
from moeaudit.precision import REFERENCE, current, ran
from moeaudit.receipts.domains import domain_windows
from moeaudit.receipts.gradients import grad_stats, gradients
from moeaudit.receipts.observer import StateObserver
from moeaudit.records import EnvironmentRecord, Receipts, ReceiptsCheckpoint, ReceiptsLayer
from moeaudit.replay import ReplayResult, replay
from moeaudit.replay.device import device_name
from moeaudit.replay.precision import check_supported
from moeaudit.replay.result import Progress

SCHEMA: Final[Literal["moeaudit.receipts/v1"]] = "moeaudit.receipts/v1"


def environment(device: str | None = None) -> EnvironmentRecord:
    """Where the receipts were computed: ``device`` is the device that computed every part of
    them (replay, conflict, generation), "cpu" on the default path."""
    env: EnvironmentRecord = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device_name(device),
        "dtype": "float32",
    }
    # --precision other than fp32 (the reference): what ran (docs/policy.md, "Reduced precision")
    if current() != REFERENCE:
        env["precision"] = ran(current(), device)
    return env


def run_state(
    ckpt: Checkpoint,
    canary: Canary,
    policy: Policy,
    *,
    keep_states: bool = False,
    conflict: bool = False,
    generate: int = 0,
    progress: Progress | None = None,
    device: str | None = None,
    stash_budget: float | None = None,
) -> tuple[Receipts, StateObserver]:
    """Replay once and return (receipts document, the observer holding per-layer states).

    ``conflict`` (one backward per domain) and ``generate`` (G streamed forwards) are the
    opt-in receipts; everything else comes from the one forward + backward. All of it is
    computed on ``device`` (default: the host, no copies; any explicit device, the CPU too,
    takes the device branch); receipts are deterministic per device, not across devices.
    ``stash_budget``: the replay's budget of kept expert products (``replay.stash``; None: its
    default), which changes the FLOPs it runs, not its receipts.
    """
    check_window_len(canary.window_len, canary.source or None)
    canary.check_vocab(ckpt.spec.vocab_size, where=str(ckpt.path))
    canary.check_context(ckpt.config, where=str(ckpt.path))
    check_supported(ckpt.spec, current())
    _ = ckpt.digest  # hash the files before reading them: fail fast; reads are pinned to them
    observer = StateObserver(ckpt.spec, canary, policy.receipts, keep_states=keep_states)
    result = replay(
        ckpt,
        canary.tokens,
        observers=[observer],
        progress=progress,
        device=device,
        keep_routing=False,
        stash_budget=stash_budget,
    )  # the observer took what the receipts need
    observer.kept_layers = list(result.kept_layers)  # what the replay's FLOPs depend on (receipts.flop_reuse)
    doc = receipts_document(ckpt, canary, result, observer, policy, device)
    if current() != REFERENCE:  # a lower precision is licensed only with its measured agreement
        from moeaudit.receipts.agreement import measure

        if (block := measure(ckpt, canary, doc, device)) is not None:
            doc["precision_agreement"] = block
    if conflict:  # on the replay's device, as environment.device says
        from moeaudit.receipts.conflict import domain_conflict

        doc["conflict"] = domain_conflict(ckpt, canary, device=device)
    if generate:
        from moeaudit.receipts.generation import generation_receipts

        doc["generation"] = generation_receipts(ckpt, canary, generate, device=device)
    ckpt.verify_unchanged()  # what was read is what was hashed (docs/decisions.md, "Pinned reads"), before any cache
    return finite_document(doc), observer


def state_receipts(
    ckpt: Checkpoint,
    canary: Canary,
    policy: Policy | None = None,
    *,
    conflict: bool = False,
    generate: int = 0,
    progress: Progress | None = None,
    device: str | None = None,
) -> Receipts:
    return run_state(
        ckpt, canary, policy or Policy(), conflict=conflict, generate=generate, progress=progress, device=device
    )[0]


def receipts_document(
    ckpt: Checkpoint,
    canary: Canary,
    result: ReplayResult,
    observer: StateObserver,
    policy: Policy,
    device: str | None = None,
) -> Receipts:
    s = ckpt.spec
    layers: list[ReceiptsLayer] = []
    for i in s.routed_layers:
        g = result.grads.get(i)
        # open: the observer's sections (occupancy, boundary, overlap, domains, a router's gate)
        entry = cast(ReceiptsLayer, {"layer": i, **observer.layers[i]})
        if g is not None:
            entry["gradients"] = gradients(g.experts_E, g.router, g.shared if s.shared_dim else None)
        layers.append(entry)
    checkpoint: ReceiptsCheckpoint = {
        "name": ckpt.path.name,
        "digest": {"sha256": ckpt.digest},
        "family": s.family,
        "routed_layers": list(s.routed_layers),
        "experts": s.num_experts,
        "top_k": s.top_k,
    }
    if q := ckpt.quantization:
        checkpoint["quantization"] = q
    if ckpt.left_out:
        checkpoint["left_out"] = [x.to_json() for x in ckpt.left_out]
    # an expert-parallel replay adds world_size, backend and rank_devices (docs/decisions.md, "Expert-parallel replay")
    env: EnvironmentRecord = environment(device)
    if result.parallel:
        env = cast(EnvironmentRecord, {**env, **result.parallel})
    doc: Receipts = {
        "schema": SCHEMA,
        "tool": {"name": "moeaudit", "version": __version__},
        "checkpoint": checkpoint,
        "canary": {
            "digest": {"sha256": canary.digest},
            "windows": canary.num_windows,
            "window_len": canary.window_len,
            "domains": list(canary.domains),
            **canary_units(canary),
        },
        "settings": {"receipts": policy.to_json()["receipts"], "policy_digest": policy.digest},
        "environment": env,
        "nll": result.nll,
        "nll_by_domain": _nll_by_domain(canary, result.nll_windows_W),
        "nll_windows": result.nll_windows_W.double().tolist(),
        "predictive_entropy": result.entropy,
        "nonfinite_weights": result.nonfinite_weights,
        "layers": layers,
    }
    if result.grads:
        pooled = torch.cat([result.grads[i].experts_E for i in s.routed_layers])
        doc["pooled"] = {"gradients": grad_stats(pooled)}
    return doc


def _nll_by_domain(canary: Canary, nll_W: torch.Tensor) -> dict[str, float | None]:
    # each domain's windows in canary order, copied out: the same sum as nll_W[mask].mean()
    return {
        name: float(nll_W[idx].double().mean())
        for name, idx in zip(canary.domains, domain_windows(canary), strict=True)
        if idx.numel()
    }
