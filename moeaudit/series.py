"""Gradient-variance series of a run for the envelope (docs/envelope.md): from the training hook's
``metrics.jsonl`` (every logged step), from replaying every checkpoint on the canary, or from
the hook's canary probe at saves (``canary_probe.jsonl``, the replay's quantity logged by the
training process itself)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from moeaudit.errors import CanaryError, InputError
from moeaudit.limits import check_window_len, iter_lines
from moeaudit.records import EnvelopeComparison, EnvelopeReport, Receipts
from moeaudit.run import PROBE_FILE


def norms_from_receipts(docs: Mapping[int, Receipts]) -> tuple[list[int], dict[str, list[list[float]]]]:
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


def replay_norms(
    run: Any, canary: Any, progress: Any = None, cache: Any = None
) -> tuple[list[int], dict[str, list[list[float]]]]:
    """Replay (forward + backward) every checkpoint of ``run`` on the canary.

    ``cache`` (a :class:`moeaudit.cache.ReceiptsCache`) keeps each checkpoint's per-expert
    gradient norms under (checkpoint digest, canary digest, tool version), so an unchanged run
    is replayed once.
    """
    steps: list[int] = []
    norms: dict[str, list[list[float]]] = {}
    check_window_len(canary.window_len, canary.source or None)
    for n, (step, ckpt) in enumerate(run.checkpoints, 1):
        canary.check_vocab(ckpt.spec.vocab_size, where=str(ckpt.path))
        canary.check_context(ckpt.config, where=str(ckpt.path))
        if progress:
            progress(f"replaying {ckpt.path.name}", n - 1, len(run.checkpoints))
        steps.append(step)
        for layer, g_E in _checkpoint_norms(ckpt, canary, cache).items():
            norms.setdefault(layer, []).append(g_E)
    return steps, norms


def _checkpoint_norms(ckpt: Any, canary: Any, cache: Any) -> dict[str, list[float]]:
    layers = [str(layer) for layer in ckpt.spec.routed_layers]
    use = cache is not None and cache.enabled
    key = cache.key("grad_norms", ckpt.digest, canary.digest) if use else None
    doc = (
        cache.get(key, check=lambda d: _norms_shape(d["norms"], layers, ckpt.spec.parametric_experts))
        if key is not None
        else None
    )
    if doc is not None:
        return doc["norms"]
    from moeaudit.replay import replay

    result = replay(ckpt, canary.tokens)
    norms = {str(layer): result.grads[layer].experts_E.tolist() for layer in ckpt.spec.routed_layers}
    ckpt.verify_unchanged()  # what was read is what was hashed (docs/decisions.md, "Pinned reads"), before caching it
    if key is not None:
        cache.put(key, {"norms": norms})
    return norms


def _norms_shape(norms: Any, layers: list[str], experts: int) -> bool:
    """Per routed layer, ``experts`` numbers (a cache entry of another shape is recomputed)."""
    return (
        isinstance(norms, dict)
        and list(norms) == layers
        and all(
            isinstance(v, list) and len(v) == experts and all(isinstance(x, (int, float)) for x in v)
            for v in norms.values()
        )
    )


def choose_source(requested: str, has_logs: bool, n_checkpoints: int, where: Path, has_probe: bool = False) -> str:
    if requested == "auto":
        requested = "logs" if has_logs else "replay"
    if requested == "logs" and not has_logs:
        raise InputError(
            "no metrics.jsonl in the run directory",
            path=where,
            hint="log with moeaudit.integrations.hooks.ExpertGradLogger, or use --source replay",
        )
    if requested == "probe" and not has_probe:
        raise InputError(
            "no canary_probe.jsonl in the run directory",
            path=where,
            hint="call ExpertGradLogger.probe(step, canary_loss) at every save, or use --source replay",
        )
    if requested == "replay" and n_checkpoints < 2:
        raise InputError(f"a replay series needs at least two checkpoints, found {n_checkpoints}", path=where)
    return requested


def run_series(
    path: Path,
    source: str,
    variant: str,
    canary_path: str | Path | None,
    progress: Any = None,
    warn: Any = None,
    cache: Any = None,
    check_probe: bool = True,
) -> tuple[Any, list[int]]:
    """(EnvelopeSeries, break steps) for a run directory or a bare metrics.jsonl. A probe series
    is refused when its lines name another canary (:func:`check_probe_canary`) unless
    ``check_probe`` is False (``--compare`` drops such a probe with a note instead)."""
    from moeaudit.judge import envelope as env
    from moeaudit.metrics import read_metrics

    if path.exists() and not path.is_dir():  # a log file (read_metrics refuses a FIFO or device)
        if source == "replay":
            raise InputError("a replay series needs a run directory, not a log file", path=path)
        kind = "probe" if source == "probe" or path.name == PROBE_FILE else "logs"
        series = env.from_metrics(read_metrics(path), variant, kind)
        if kind == "probe" and check_probe:
            check_probe_canary(path, canary_path, path)
        return series, []
    from moeaudit.run import discover

    run = discover(path)
    for skipped, why in run.skipped:
        if warn:
            warn(f"warning: skipped {skipped.name}: {why}")
    breaks = [e.step for e in run.events]
    chosen = choose_source(source, run.metrics is not None, len(run.checkpoints), path, run.probe is not None)
    if chosen == "logs":
        assert run.metrics is not None
        return env.from_metrics(read_metrics(run.metrics), variant), breaks
    if chosen == "probe":
        assert run.probe is not None
        series = env.from_metrics(read_metrics(run.probe), variant, "probe")  # validated first
        if check_probe:
            check_probe_canary(run.probe, canary_path, path)
        return series, breaks
    from moeaudit import canary as canary_mod
    from moeaudit.locate import require_canary

    canary = canary_mod.load(require_canary(canary_path, path))
    steps, norms = replay_norms(run, canary, progress, cache)
    return env.from_norms("replay", steps, norms, variant, origin=str(path)), breaks


def model_tag(spec: Any) -> str:
    """The architecture an envelope calibration was fitted on (family and MoE shape)."""
    return (
        f"{spec.family} L={spec.num_layers} H={spec.hidden_size} E={spec.num_experts} "
        f"k={spec.top_k} routed={list(spec.routed_layers)}"
    )


def envelope_applies(settings: Any, stage: str, spec: Any) -> str | None:
    """None when the policy's envelope constants apply to this run, else why they do not."""
    if settings.calibrated_stage and settings.calibrated_stage != stage:
        return (
            f"envelope constants were calibrated on a {settings.calibrated_stage} run; this is a "
            f"{stage} run — calibrate on a healthy {stage} run to gate it"
        )
    if settings.calibrated_model and settings.calibrated_model != model_tag(spec):
        return (
            f"envelope constants were calibrated on {settings.calibrated_model}; this run is "
            f"{model_tag(spec)} — calibrate on a healthy run of this model to gate it"
        )
    return None


class _Note(TypedDict, total=False):
    """The ``envelope --compare`` comparison's ``note`` (without ``--calibrate-on``) and its probe report."""

    note: str
    probe_report: EnvelopeReport


def evaluate_run(
    path: Path,
    settings: Any,
    *,
    source: str,
    canary_path: str | Path | None = None,
    compare: bool = False,
    calibrate_on: Path | None = None,
    policy_path: str | None = None,
    progress: Any = None,
    warn: Any = None,
    cache: Any = None,
) -> EnvelopeReport:
    """The ``moeaudit.envelope/v1`` report of a run (or a bare metrics.jsonl) under ``settings``.

    ``compare``: also evaluate the other source and add ``comparison`` — the logs and the
    replays window by window between consecutive checkpoints (:mod:`moeaudit.judge.envelope_compare`).
    ``calibrate_on``: a healthy run; every source is then judged under constants fitted on it
    from the same source and sampling, instead of the policy's.
    """
    from moeaudit.judge import envelope as env
    from moeaudit.judge import envelope_compare as cmp
    from moeaudit.judge.envelope_columns import ENVELOPE_NUMPY_ROWS

    def get(where: Path, src: str, check_probe: bool = False) -> tuple[Any, list[int]]:
        return run_series(where, src, settings.variant, canary_path, progress, warn, cache, check_probe)

    primary, breaks = get(path, source, check_probe=True)
    series = {primary.source: primary}
    other = "replay" if primary.source == "logs" else "logs"
    probe_note = None
    if compare:
        if path.is_file():
            raise InputError("comparing logs with replays needs a run directory", path=path)
        for src in ("logs", "replay"):
            if src not in series:
                series[src] = get(path, src)[0]
        if "probe" not in series and (path / PROBE_FILE).is_file():
            series["probe"] = get(path, "probe")[0]
        if "probe" in series:
            probe_note = _probe_mismatch(path / PROBE_FILE, canary_path, path)
            if probe_note is not None:
                del series["probe"]
    constants = {view: settings for view in (*cmp.VIEWS, "probe")}
    if calibrate_on is not None and "probe" in series and not (calibrate_on / PROBE_FILE).is_file():
        del series["probe"]  # its constants could not be fitted like for like
        probe_note = f"not compared: {calibrate_on} has no {PROBE_FILE} to fit the probe's constants on"
    if calibrate_on is not None:
        w = settings.warmup_steps
        ref = {src: get(calibrate_on, src) for src in series}
        ref_breaks = [b for b in next(iter(ref.values()))[1] if b >= w]
        constants.update(
            cmp.calibrate_sources(settings, breaks=ref_breaks, **{src: s.since(w) for src, (s, _) in ref.items()})
        )
    trimmed = {src: s.since(settings.warmup_steps) for src, s in series.items()}
    reports = {
        src: env.evaluate(s, constants[src], breaks=breaks, policy_path=policy_path, numpy_rows=ENVELOPE_NUMPY_ROWS)
        for src, s in trimmed.items()
    }
    report = reports[primary.source]
    if compare:
        note: _Note = (
            {}
            if calibrate_on is not None
            else {
                "note": (
                    "every verdict uses the policy's constants; fit each source on a healthy run "
                    "from the same source and sampling (--calibrate-on) to compare like with like"
                )
            }
        )
        comparison: EnvelopeComparison = {
            "calibrated_on": None if calibrate_on is None else str(calibrate_on),
            **note,
            **cmp.compare(trimmed["logs"], trimmed["replay"], constants, breaks=breaks, probe=trimmed.get("probe")),
            "report": reports[other],
        }
        if "probe" in reports and primary.source != "probe":
            comparison["probe_report"] = reports["probe"]
        if probe_note is not None:
            comparison["skipped"].append({"series": "probe", "reason": probe_note})
        report["comparison"] = comparison
    return report


def check_probe_canary(probe: Path, canary_path: str | Path | None, where: Path) -> None:
    """A probe series stands for the replay's quantity only on the same canary (the check
    ``--compare`` makes): its lines must name the canary given with ``--canary``, else the one
    found (README.md, "Commands"), else the run's own copy (``canary.safetensors`` beside the probe), and
    one canary throughout. Refused with both digests named (exit 4)."""
    from moeaudit import canary as canary_mod
    from moeaudit.locate import locate_canary

    run_dir = probe.parent
    reference: Path | None = None
    try:
        reference = locate_canary(canary_path, where)[0]
    except InputError:
        if (run_dir / canary_mod.RUN_COPY).is_file():
            reference = run_dir / canary_mod.RUN_COPY
    if reference is not None:
        mismatch = canary_mod.probe_mismatch(canary_mod.load(reference), probe)
        if mismatch is not None:
            raise canary_mod.mismatch_error(mismatch)
        return
    named = sorted({d for d in canary_mod.probe_digests(probe) if d is not None})
    if len(named) > 1:
        raise CanaryError(
            f"the canary probe's lines name {len(named)} canaries (sha256:{named[0]} and sha256:{named[1]})",
            path=probe,
            hint="a probe series needs one canary throughout; pass --canary with the run's canary",
        )


def _probe_mismatch(probe: Path, canary_path: str | Path | None, run_dir: Path) -> str | None:
    """Why the hook's canary probe cannot stand next to the replays (another canary), or None."""
    from moeaudit import canary as canary_mod
    from moeaudit.locate import require_canary

    digest = canary_mod.load(require_canary(canary_path, run_dir)).digest
    logged = set()
    for _, line, _ in iter_lines(probe, "canary probe log"):  # read_metrics has validated it
        if line.strip():
            try:
                logged.add(json.loads(line).get("canary"))
            except (ValueError, RecursionError):  # the torn last line read_metrics let through
                continue
    if logged == {digest}:
        return None
    shown = ", ".join(sorted(str(d)[:12] for d in logged))
    return (
        f"not compared: the probe logged canary {shown}, the replays use {digest[:12]} "
        "(the probe is only the replay's quantity on the same canary)"
    )


def envelope_evidence(
    logs: Any,
    docs: Mapping[int, Receipts],
    policy: Any,
    stage: str,
    spec: Any,
    *,
    start: int,
    end: int,
    breaks: Sequence[int] = (),
    origin: str = "",
    whole_log: bool = False,
) -> tuple[EnvelopeReport | None, str | None]:
    """(report, None) or (None, why not): the envelope over the window a verdict speaks for.

    One rule for ``certify`` and ``gate``. The series is the training logs (``metrics.jsonl``,
    every logged step in (start, end]: the training after ``start``), else the hook's canary
    probe or the checkpoint replays ([start, end]: states at the checkpoints, ``start`` being
    the anchor), as the policy's ``envelope.source`` allows. Warm-up samples are dropped.
    ``whole_log``: the logs from their first line to ``end`` (certify of a run: every logged
    step of the run is its training, also before its first kept checkpoint when older ones
    were rotated away by ``save_total_limit``).
    """
    from moeaudit.judge import envelope as env
    from moeaudit.judge.envelope_columns import CERTIFY_NUMPY_ROWS
    from moeaudit.metrics import read_metrics

    settings = policy.envelope
    metrics = getattr(logs, "metrics", None)
    probe = getattr(logs, "probe", None)
    parsed = getattr(logs, "parsed", {})  # the logs as read once, hashed (Run.read_logs_once)
    # A policy's envelope that cannot be evaluated on this run (its constants fitted on another
    # stage or model, or its source file absent) never leaves the envelope unjudged: the
    # built-in rules are evaluated instead, on the series they would read — the logs, else the
    # replays' per-expert canary gradients (docs/policy.md, "envelope fallback").
    fallback = envelope_applies(settings, stage, spec)
    if fallback is None and settings.source in ("logs", "probe"):
        named = metrics if settings.source == "logs" else probe
        if named is None:
            file = "metrics.jsonl" if settings.source == "logs" else PROBE_FILE
            fallback = (
                f"the policy's envelope reads {file} (envelope.source = {settings.source!r}) and the run has none"
            )
    if fallback is not None:
        from moeaudit.policy import EnvelopeSettings

        settings = EnvelopeSettings()
    in_window = [s for s in sorted(docs) if start <= s <= end]
    if metrics is not None and settings.source in ("auto", "logs"):
        logged = parsed["metrics"] if "metrics" in parsed else read_metrics(metrics)
        series = env.from_metrics(logged, settings.variant)
        series = series.between(None if whole_log else start, end, include_start=False)
    elif probe is not None and settings.source == "probe":
        logged = parsed["probe"] if "probe" in parsed else read_metrics(probe, "canary probe log")
        series = env.from_metrics(logged, settings.variant, "probe")
        series = series.between(start, end, include_start=True)
    elif len(in_window) >= 2 and settings.source in ("auto", "replay"):
        steps, norms = norms_from_receipts({s: docs[s] for s in in_window})
        series = env.from_norms("replay", steps, norms, settings.variant, origin=origin)
    else:
        have = {
            "logs": "metrics.jsonl " + ("present" if metrics else "absent"),
            "probe": f"{PROBE_FILE} " + ("present" if probe else "absent"),
            "replay": f"{len(in_window)} checkpoint(s) in steps {start}–{end}",
        }
        why = f"no series for policy source {settings.source!r}: {'; '.join(have.values())}"
        return None, why if fallback is None else f"{fallback}; the built-in rules found {why}"
    series = series.since(settings.warmup_steps)
    if len(series.steps) < 2:
        from moeaudit.judge.decide import NotEvaluable

        # a series exists and the rules could not judge it: INCONCLUSIVE, never a pass
        return None, NotEvaluable(
            f"could not be evaluated: fewer than two samples of the {series.source} series in steps "
            f"{start}–{end} after the warm-up (step {settings.warmup_steps})"
        )
    report = env.evaluate(series, settings, breaks=breaks, policy_path=policy.source, numpy_rows=CERTIFY_NUMPY_ROWS)
    if fallback is not None:
        report["fallback"] = fallback
    return report, None


TRAINER_STATE = "trainer_state.json"
MAX_TRAINER_STATE_BYTES = 64 << 20  # log_history grows ~200 bytes a logged step


@dataclass(frozen=True)
class Warmup:
    """The learning-rate warm-up of a run: its step, how it was found, and what was found wrong
    on the way (non-finite learning rates, entries or files skipped) — each said to the user."""

    step: int
    how: str
    findings: tuple[str, ...] = ()


def infer_warmup(run: Any) -> Warmup:
    """The step the logged learning rate first peaks, from the last checkpoint's
    ``trainer_state.json`` that has a usable history (else 0). An Infinity or NaN learning rate
    is a finding, never the peak; entries and files that cannot be read are reported, not
    silently passed over (docs/decisions.md, "Warm-up inference")."""
    findings: list[str] = []
    for _, ckpt in reversed(run.checkpoints):
        state = Path(ckpt.path) / TRAINER_STATE
        if not os.path.lexists(state):
            continue
        history, sha = _log_history(ckpt, state, findings)
        if history is None:
            continue
        rates = _learning_rates(history, state, findings)
        if len(rates) >= 2:
            peak = max(lr for _, lr in rates)
            step = next(s for s, lr in rates if lr >= peak * (1 - 1e-6))
            return Warmup(step, f"learning-rate peak at step {step} in {state} (sha256 {sha[:16]}…)", tuple(findings))
        findings.append(f"{state}: fewer than two finite learning rates logged; not used")
    return Warmup(0, f"no {TRAINER_STATE} with a learning-rate history", tuple(findings))


def _log_history(ckpt: Any, state: Path, findings: list[str]) -> tuple[list[Any] | None, str]:
    """(``log_history`` of a trainer_state.json, SHA-256 of the bytes parsed), or None with the
    reason in ``findings``. Read through the checkpoint (``Checkpoint.read_member``): once,
    pinned, and the checkpoint's root digest covers the very bytes parsed."""
    import hashlib

    from moeaudit.jsonio import NotStrictJSON, strict_loads
    from moeaudit.limits import read_regular

    try:
        if hasattr(ckpt, "read_member"):
            raw = ckpt.read_member(TRAINER_STATE, MAX_TRAINER_STATE_BYTES)
        else:  # a bare directory (no Checkpoint): read once all the same
            raw = read_regular(state, "trainer state", MAX_TRAINER_STATE_BYTES)
        sha = hashlib.sha256(raw).hexdigest()
        doc = strict_loads(raw, nonfinite=True)
    except InputError as exc:  # not a regular file, too large, unreadable, changed
        findings.append(f"skipped {exc.diagnostics()}")
        return None, ""
    except NotStrictJSON as exc:
        findings.append(f"skipped {state}: {exc}")
        return None, ""
    except (ValueError, RecursionError) as exc:
        findings.append(f"skipped {state}: not JSON ({exc})")
        return None, ""
    history = doc.get("log_history") if isinstance(doc, dict) else None
    if not isinstance(history, list):
        findings.append(f"skipped {state}: no log_history list")
        return None, ""
    return history, sha


def _learning_rates(history: list[Any], state: Path, findings: list[str]) -> list[tuple[int, float]]:
    """(step, learning rate) of each entry that logs one; the rest reported in ``findings``."""
    rates, skipped = [], []
    for i, h in enumerate(history):
        if not isinstance(h, dict) or "learning_rate" not in h:
            continue  # evaluation and summary entries log no learning rate
        step, lr = h.get("step"), h["learning_rate"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            skipped.append(f"log_history[{i}] (step {step!r})")
        elif not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr < 0:
            skipped.append(f"log_history[{i}] (learning_rate {lr!r})")
        elif not math.isfinite(lr):
            findings.append(
                f"{state}: learning rate {lr} at step {step} (log_history[{i}]) is not "
                "finite — a diverged or broken schedule; not taken as the warm-up peak"
            )
        else:
            rates.append((step, float(lr)))
    if skipped:
        findings.append(
            f"{state}: skipped {len(skipped)} log_history entr"
            f"{'y' if len(skipped) == 1 else 'ies'} without a step and a learning rate "
            f"≥ 0: {', '.join(skipped[:3])}{', …' if len(skipped) > 3 else ''}"
        )
    return rates
