"""Gradient-variance series of a run for the envelope (SPEC §7): from the training hook's
``metrics.jsonl`` (every logged step) or from replaying every checkpoint on the canary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moeaudit.errors import InputError


def norms_from_receipts(docs: Mapping[int, Mapping[str, Any]]) -> tuple[list[int], dict[str, list[list[float]]]]:
    """(steps, {layer: [per-expert grad norms at each step]}) from receipts documents."""
    steps = sorted(docs)
    layers = [e["layer"] for e in docs[steps[0]]["layers"]]
    norms: dict[str, list[list[float]]] = {str(layer): [] for layer in layers}
    for s in steps:
        by_layer = {e["layer"]: e for e in docs[s]["layers"]}
        for layer in layers:
            g = by_layer[layer].get("gradients")
            if g is None:
                raise InputError(f"receipts of step {s} carry no gradients")
            norms[str(layer)].append(g["grad_norms"])
    return steps, norms


def replay_norms(run: Any, canary: Any, progress: Any = None) -> tuple[list[int], dict[str, list[list[float]]]]:
    """Replay (forward + backward) every checkpoint of ``run`` on the canary."""
    from moeaudit.replay import replay

    steps, norms = [], {}
    for n, (step, ckpt) in enumerate(run.checkpoints, 1):
        canary.check_vocab(ckpt.spec.vocab_size, where=str(ckpt.path))
        if progress:
            progress(f"replaying {ckpt.path.name}", n - 1, len(run.checkpoints))
        result = replay(ckpt, canary.tokens)
        steps.append(step)
        for layer in ckpt.spec.routed_layers:
            norms.setdefault(str(layer), []).append(result.grads[layer].experts_E.tolist())
    return steps, norms


def choose_source(requested: str, has_logs: bool, n_checkpoints: int, where: Path) -> str:
    if requested == "auto":
        requested = "logs" if has_logs else "replay"
    if requested == "logs" and not has_logs:
        raise InputError("no metrics.jsonl in the run directory", path=where,
                         hint="log with moeaudit.hooks.ExpertGradLogger, or use --source replay")
    if requested == "replay" and n_checkpoints < 2:
        raise InputError(f"a replay series needs at least two checkpoints, found {n_checkpoints}", path=where)
    return requested


def run_series(path: Path, source: str, variant: str, canary_path: str | None,
               progress: Any = None, warn: Any = None) -> tuple[Any, list[int]]:
    """(EnvelopeSeries, break steps) for a run directory or a bare metrics.jsonl."""
    from moeaudit import envelope as env
    from moeaudit.metrics import read_metrics

    if path.is_file():
        if source == "replay":
            raise InputError("a replay series needs a run directory, not a log file", path=path)
        return env.from_metrics(read_metrics(path), variant), []
    from moeaudit.run import discover

    run = discover(path)
    for skipped, why in run.skipped:
        if warn:
            warn(f"warning: skipped {skipped.name}: {why}")
    breaks = [e.step for e in run.events]
    chosen = choose_source(source, run.metrics is not None, len(run.checkpoints), path)
    if chosen == "logs":
        assert run.metrics is not None
        return env.from_metrics(read_metrics(run.metrics), variant), breaks
    from moeaudit import canary as canary_mod
    from moeaudit.locate import require_canary

    canary = canary_mod.load(require_canary(canary_path, path))
    steps, norms = replay_norms(run, canary, progress)
    return env.from_norms("replay", steps, norms, variant, origin=str(path)), breaks


def model_tag(spec: Any) -> str:
    """The architecture an envelope calibration was fitted on (family and MoE shape)."""
    return (f"{spec.family} L={spec.num_layers} H={spec.hidden_size} E={spec.num_experts} "
            f"k={spec.top_k} routed={list(spec.routed_layers)}")


def envelope_applies(settings: Any, stage: str, spec: Any) -> str | None:
    """None when the policy's envelope constants apply to this run, else why they do not."""
    if settings.calibrated_stage and settings.calibrated_stage != stage:
        return (f"envelope constants were calibrated on a {settings.calibrated_stage} run; this is a "
                f"{stage} run — calibrate on a healthy {stage} run to gate it")
    if settings.calibrated_model and settings.calibrated_model != model_tag(spec):
        return (f"envelope constants were calibrated on {settings.calibrated_model}; this run is "
                f"{model_tag(spec)} — calibrate on a healthy run of this model to gate it")
    return None
