"""``moeaudit certify``: audit a whole run and issue a signed certificate (docs/policy.md, "The rules in one place";
docs/security.md, "What the signature binds").

Discover the checkpoints → replay each once (state receipts) → pair receipts of each gate
against its active baseline → gates → envelope series (logs and replays) → margins → checks
→ verdict → in-toto statement → DSSE envelope → files. Only the last step writes, each file
atomically, the certificate last: an interrupted run leaves no partial certificate.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from moeaudit.attest.certificate import statement
from moeaudit.attest.predicate import canary_record, heatmaps, policy_record, run_record
from moeaudit.attest.predicate import predicate as build_predicate
from moeaudit.cache import ReceiptsCache
from moeaudit.canary import Canary
from moeaudit.errors import InputError
from moeaudit.jsonio import finite_document
from moeaudit.judge.decide import Evidence, decide, resolve_stage
from moeaudit.judge.gates import (
    Checkpointed,
    baselines,
    drift_summary,
    evaluate_gates,
    nonfinite_findings,
    paired_interval,
)
from moeaudit.lineage import abandoned
from moeaudit.margins import handoff, refinement
from moeaudit.policy import BUILTIN, Policy, protected_layers
from moeaudit.precision import current as current_precision
from moeaudit.receipts.measured import measured
from moeaudit.receipts.reference import Reference, check_same_model, open_reference, reference_input
from moeaudit.records import (
    AblationReceipt,
    CacheUse,
    CheckpointAgreement,
    CheckpointFiles,
    EnvironmentRecord,
    FileResource,
    GateEntry,
    InputFile,
    Inputs,
    Margin,
    Margins,
    PairDocument,
    PairLayer,
    Receipts,
    RouterCheckpoint,
    RouterLayer,
    RouterSection,
    RunEvent,
    Statement,
    Subject,
)
from moeaudit.report.monitors import section as monitors_section
from moeaudit.run import Run, discover, stage_at, stage_start, truncate
from moeaudit.run_names import run_name

if TYPE_CHECKING:
    from moeaudit.receipts.observer import AnchorStates

# The replay (torch) is imported only when something is not in the cache: a fully cached
# certify never loads torch (docs/decisions.md, "A fully cached certify loads neither torch nor numpy";
# test_torch_free.py).

Say = Callable[[str], None]
BUNDLE_NAME = "certificate.sigstore.json"  # the signed statement as a Sigstore bundle v0.3 (cosign)


@dataclass
class Audit:
    """Everything a certificate is made of, before signing."""

    run: Run
    statement: Statement
    receipts: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # file name → document
    warnings: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return self.statement["predicate"]["verdict"]


def audit_run(
    run_path: str | Path,
    canary: Canary,
    policy: Policy,
    *,
    reference: str | Path | Reference | None = None,
    say: Say = lambda _m: None,
    cache: ReceiptsCache | None = None,
    device: str | None = None,
    stage: str | None = None,
    canary_origin: str = "",
    progress: Callable[[str, int, int], None] | None = None,
    until: int | None = None,
    accept_canary_mismatch: bool = False,
    ablate: str | None = None,
) -> Audit:
    """``until``: audit the run as it stood at that step — only the checkpoints up to it
    (``moeaudit gate`` judges a candidate exactly as certify of the truncated run would).

    A run that records another canary than ``canary`` (its canary probe's lines, the callback's
    ``canary.safetensors``, a checkpoint's ``tokenizer.json`` against a text canary's
    ``tokenizer_sha256``) is refused; ``accept_canary_mismatch`` signs each mismatch as a
    finding under ``canary.mismatches`` instead (docs/decisions.md, "The canary must be the run's
    canary")."""
    run = discover(run_path)
    if until is not None:
        run = truncate(run, until)
    from moeaudit.canary import mismatch_error, run_mismatches

    # every log read once, before the replays, hashed as parsed (docs/security.md); the canary the
    # probe's lines name comes from that same read
    run.read_logs_once(parse_probe=policy.envelope.source == "probe")
    checkpoints = [ckpt.path for _, ckpt in run.checkpoints]
    mismatches = run_mismatches(canary, run.path, checkpoints, run.probe_canaries)
    if mismatches and not accept_canary_mismatch:
        raise mismatch_error(mismatches[0], "--accept-canary-mismatch (certify)")
    # a receipts file is read and checked now, before any replay (docs/security.md, "Resource caps")
    ref = open_reference(reference, canary, policy) if isinstance(reference, (str, Path)) else reference
    warnings = [f"skipped {p.name}: {why}" for p, why in run.skipped]
    warnings += [f"left out {name}: {why}" for name, why in run.left_out]
    left_behind = abandoned(run)  # still audited, and named (docs/decisions.md, "Abandoned checkpoints")
    warnings += [f"{a.name} is abandoned: {a.reason}" for a in left_behind]
    warnings += [
        f"canary mismatch signed as a finding: {m['source']} has sha256:{m['recorded'][:16]}…, "
        f"the audit used sha256:{m['given'][:16]}…"
        for m in mismatches
    ]
    for w in warnings:
        say(f"warning: {w}")
    first = run.checkpoints[0][1]
    for _, ckpt in run.checkpoints[1:]:
        from moeaudit.checkpoint.checkpoint import check_compatible

        check_compatible(first, ckpt)
    protected = protected_layers(policy, first.spec.routed_layers, str(first.path))
    if ref is not None:  # a receipts reference of another model, refused before the replay too
        check_same_model(ref, run.checkpoints[-1][1].path.name, first.spec)
    # each event with its source: events are written by the audited party, so they may start a
    # new drift baseline but never erase a regression (gates.evaluate_gates; docs/decisions.md,
    # "Events cannot improve a verdict")
    events: list[RunEvent] = [
        {"step": e.step, "event": e.event, "note": e.note, "source": e.source} for e in run.events
    ]
    base_at = baselines(run.steps, events)
    flag = stage
    stage, stage_source = resolve_stage(stage, policy.gates.stage, run.stage, "pretraining")

    def stage_of(step: int) -> str:
        """The stage in force at ``step``: --stage, else the run's declared stage at that step
        (a declared stage applies from its step on), else the policy's, else pretraining."""
        return flag or stage_at(run.stages, step) or policy.gates.stage or "pretraining"

    training_loss = _training_loss(run)
    replayer = _Replayer(
        canary, policy, cache or ReceiptsCache(enabled=False), say, len(run.checkpoints), device, progress
    )
    docs, points, pairs = {}, [], {}
    base: tuple[int, Any] | None = None
    for step, ckpt in run.checkpoints:
        docs[step] = replayer.receipts(step, ckpt)
        points.append(Checkpointed(step, docs[step], base_at.get(step), *training_loss(step)))
        if base is not None:  # a post-resume baseline is compared with the one before it too
            pairs[step] = replayer.pair(base, (step, ckpt))
        if step in base_at or base is None:
            replayer.new_base(step, ckpt)
            base = (step, ckpt)
        replayer.forget_states(keep=base[0])
    gates = evaluate_gates(
        points,
        protected,
        policy.gates,
        resamples=policy.receipts.bootstrap,
        seed=policy.receipts.seed,
        interval=replayer.nll_interval,
        stage=stage_of,
    )
    for gate in gates:
        if gate["step"] in pairs:
            gate["drift"] = drift_summary(pairs[gate["step"]])

    last = gates[-1]
    margins: Margins = {"refinement": None, "handoff": None}
    if last["step"] in pairs:
        refined = _worst_refinement(
            replayer, run, docs, pairs, last, base_at, protected, policy, None if flag else run.stages
        )
        margins["refinement"] = {**refined, "stage": stage_of(last["baseline"])}  # gated by its base's stage
    inputs = _inputs(run, policy)
    if ref is not None:
        ref_doc = ref.doc
        if ref_doc is None:  # a checkpoint, replayed by this audit
            from moeaudit.receipts.pair import load_reference

            ref_doc = load_reference(ref.path, canary, policy, device=device)
            replayer._computed("reference", ref_doc)
        margins["handoff"] = handoff(docs[last["step"]], ref_doc, protected, policy.margins)
        inputs["reference"] = reference_input(ref, ref_doc)
    from moeaudit.series import envelope_evidence

    env_report, env_why = envelope_evidence(
        run,
        docs,
        policy,
        stage,
        first.spec,
        start=run.steps[0],
        end=run.steps[-1],
        breaks=(),
        origin=str(run.path),
        whole_log=True,  # the whole bound log: rotated-away checkpoints do not shorten it
    )
    probe_off = [m for m in mismatches if run.probe is not None and m["source"] == run.probe.name]
    if probe_off and env_report is not None and env_report.get("source") == "probe":
        env_report, env_why = (
            None,
            (
                f"the canary probe logged canary sha256:{probe_off[0]['recorded'][:16]}…, not the audited "
                f"sha256:{probe_off[0]['given'][:16]}…: it is not this canary's gradient"
            ),
        )
    # No breaks: declared events do not restart the envelope's windows for the verdict — an event written by the
    # audited party can never improve one (docs/decisions.md, "Events cannot improve a verdict").
    agreements: Any = _agreements(run, docs)  # per checkpoint replayed below fp32 (docs/policy.md, "Reduced precision")
    evidence = Evidence(
        stage=stage,
        stage_source=stage_source,
        gates=gates,
        margins=margins,
        envelope=env_report,
        envelope_reason=env_why,
        skipped=[p.name for p, _ in run.skipped],
        nonfinite=nonfinite_findings(docs.values()),
        band=policy.gates.inconclusive_band,
        precision_agreement=agreements,
        canary_windows=next(iter(docs.values()))["canary"].get("distinct_windows", canary.num_windows),
    )
    decision = decide(evidence)
    environment = _environment(replayer.computed_by, replayer.parallel)
    predicate = build_predicate(
        decision,
        run=run_record(
            name=run_name(run.path),
            path=str(run_path),
            stage=stage,
            stage_source=stage_source,
            checkpoints=run.steps,
            skipped=[p.name for p, _ in run.skipped],
            events=events,
            abandoned=[a.to_json() for a in left_behind],
        ),
        inputs=inputs,
        # a canary built from text: its tokenizer and text; what the run recorded otherwise
        canary=canary_record(canary, origin=canary_origin, mismatches=mismatches),
        policy=policy_record(policy),
        environment=environment,
        protected_layers=protected,
        gates=gates,
        envelope=env_report,
        margins=margins,
        heatmaps=heatmaps(docs[last["step"]]),
    )
    if (computed_in := _precision(docs)) != "fp32":  # absent: fp32, the reference (the golden's bytes)
        predicate["precision"] = computed_in
        environment["precision"] = computed_in  # shown where the environment is
    if agreements:
        predicate["precision_agreement"] = agreements
    router = _router_section(first.spec, docs)
    # only for gates the atlas theorem does not cover (docs/decisions.md, "Which receipts keep their meaning")
    if router is not None:
        predicate["router"] = router
    if (monitored := monitors_section(docs[last["step"]])) is not None:  # docs/monitors.md
        predicate["monitors"] = monitored
    if ablate is not None:  # opt-in, at the certified (last) checkpoint; reported, not gated
        predicate["ablation"] = _ablation(run, docs, canary, policy, ablate, device, progress)
    # authenticated by the local cache key, not recomputed (docs/decisions.md, "Receipts cache")
    if replayer.from_cache:
        predicate["from_cache"] = replayer.from_cache
    for _, ckpt in run.checkpoints:  # what the subjects name is what is on disk, unchanged
        ckpt.verify_unchanged()
    subjects: list[Subject] = [
        {"name": ckpt.path.name, "digest": {"sha256": ckpt.digest}} for _, ckpt in run.checkpoints
    ]
    # the root digest does not bind file names: each subject's files are signed too (docs/security.md, "What the
    # signature binds")
    files: list[CheckpointFiles] = [
        {"name": c.path.name, "resources": _resources(c.resources)} for _, c in run.checkpoints
    ]
    predicate["checkpoint_files"] = files
    cost = measured(run.checkpoints[-1][1], replayer.compute)
    predicate["parameters"], predicate["compute"] = cost["parameters"], cost["compute"]
    audit = Audit(run, finite_document(statement(subjects, predicate)), warnings=warnings)
    for step, doc in docs.items():
        audit.receipts[f"checkpoint-{step}.json"] = doc
    for step, pair in pairs.items():
        audit.receipts[f"pair-{step}-vs-{pair['base_step']}.json"] = pair
    if env_report is not None:
        audit.receipts["envelope.json"] = env_report
    return audit


def _ablation(
    run: Run,
    docs: dict[int, Any],
    canary: Canary,
    policy: Policy,
    mode: Any,
    device: str | None,
    progress: Callable[[str, int, int], None] | None,
) -> AblationReceipt:
    """The ablation receipt of the last checkpoint (docs/decisions.md, "Ablation receipt")."""
    from moeaudit.judge.ablation import assemble, removals
    from moeaudit.receipts.ablation import ablation_receipt

    step, ckpt = run.checkpoints[-1]
    floor = policy.gates.floor_pi_share
    todo, flags = removals(docs[step], mode, floor)
    measured = ablation_receipt(ckpt, canary, policy.receipts, todo, device=device, progress=progress)
    return assemble(measured, flags, docs[step], mode, floor, step)


def _worst_refinement(
    replayer: _Replayer,
    run: Run,
    docs: dict[int, Any],
    pairs: dict[int, PairDocument],
    last: GateEntry,
    base_at: dict[int, str],
    protected: list[int],
    policy: Policy,
    stages: list[tuple[int, str]] | None = None,
) -> Margin:
    """The refinement margin of the last checkpoint against the active baseline and against every
    earlier baseline (the first checkpoint, each event's) of the same stage: the worst of them is
    gated, so a declared event can start a new drift baseline but never improve the margin
    (docs/decisions.md, "Events cannot improve a verdict"). A baseline before the stage in force at the active baseline
    was declared belongs to another stage: a pair spanning the change is compared against the stage's own
    baseline (``stages``: the run's declared stages; None when --stage fixes one for all)."""
    ckpts = dict(run.checkpoints)
    step = last["step"]
    since = stage_start(stages or [], last["baseline"])
    found: list[Margin] = []
    for b in sorted(s for s in base_at if s < step and (since is None or s >= since or s == last["baseline"])):
        pair = pairs[step] if b == last["baseline"] else replayer.pair((b, ckpts[b]), (step, ckpts[step]))
        drift = {entry["layer"]: entry["drift"] for entry in pair["layers"]}
        margin = refinement(docs[b], docs[step], drift, protected, policy.margins)
        found.append({**margin, "against_step": b})
    worst = min(found, key=lambda m: (m.get("exact") is not None, m.get("exact") or 0.0))
    if len(found) > 1:
        worst = {
            **worst,
            "also_against": [
                {"against_step": m["against_step"], "exact": m.get("exact")} for m in found if m is not worst
            ],
        }
    return worst


def _precision(docs: Mapping[int, Mapping[str, Any]]) -> str:
    """What the receipts were computed in (docs/policy.md, "Reduced precision"): fp32, the reference, unless they say
    otherwise."""
    found = sorted({d.get("environment", {}).get("precision", "fp32") for d in docs.values()})
    return found[0] if len(found) == 1 else "mixed"


def _agreements(run: Run, docs: Mapping[int, Receipts]) -> list[CheckpointAgreement]:
    """Each reduced-precision checkpoint's measured agreement with fp32, named."""
    names = {step: ckpt.path.name for step, ckpt in run.checkpoints}
    return [
        {"checkpoint": names[step], "step": step, **agreement}
        for step, doc in docs.items()
        if (agreement := doc.get("precision_agreement")) is not None
    ]


def _environment(computed_by: dict[str, str], parallel: dict[str, dict[str, Any]] | None = None) -> EnvironmentRecord:
    """As :func:`moeaudit.receipts.state.environment`, without importing torch: the version of
    the installed torch distribution is the same string as ``torch.__version__``. ``device`` is
    the one that computed every receipt, pair receipt and replayed reference the certificate
    rests on, as each recorded it (cached ones included); were they computed on several,
    it is "mixed" and ``devices`` names each part's (docs/decisions.md, "`environment.device`"). Where a part was
    computed by an expert-parallel replay (``parallel``: part → its world size, backend and rank devices),
    those are recorded too (docs/decisions.md, "Expert-parallel replay"), the largest world size's; ``world_sizes``
    names each part's world size when they differ (pair receipts are computed by rank 0 alone)."""
    import importlib.metadata
    import platform

    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        version = torch.__version__
    devices = sorted(set(computed_by.values()))
    env: EnvironmentRecord = {
        "torch": version,
        "python": platform.python_version(),
        "device": devices[0] if len(devices) == 1 else "mixed" if devices else "none",
        "dtype": "float32",
    }
    if len(devices) > 1:
        env["devices"] = dict(sorted(computed_by.items()))
    if parallel:
        _parallel(env, computed_by, parallel)
    return env


def _parallel(env: EnvironmentRecord, computed_by: dict[str, str], parallel: dict[str, dict[str, Any]]) -> None:
    widest = max(parallel.values(), key=lambda p: (p["world_size"], p["backend"], p["rank_devices"]))
    sizes = {part: parallel.get(part, {}).get("world_size", 1) for part in computed_by}
    env["world_size"] = widest["world_size"]
    env["backend"] = widest["backend"]
    env["rank_devices"] = widest["rank_devices"]
    if len(set(sizes.values())) > 1:
        env["world_sizes"] = dict(sorted(sizes.items()))


def _inputs(run: Run, policy: Policy) -> Inputs:
    """SHA-256 of every file besides the checkpoints that a signed number rests on, each of the
    very bytes its numbers were parsed from (one read per file, docs/security.md): never a
    second read of a path that may by now name another file."""
    out: Inputs = {}
    # each log's entry as its reader recorded it ({path, sha256, bytes}: moeaudit.run.Run.inputs)
    if "metrics" in run.inputs:
        out["metrics"] = cast(InputFile, dict(run.inputs["metrics"]))
    if "probe" in run.inputs:
        out["probe"] = cast(InputFile, dict(run.inputs["probe"]))
    if "events" in run.inputs:
        out["events"] = cast(InputFile, dict(run.inputs["events"]))
    if policy.source != BUILTIN and (parsed := policy.file_input()) is not None:
        out["policy_file"] = cast(InputFile, parsed)
    return out


def _resources(listed: list[dict[str, Any]]) -> list[FileResource]:
    """A checkpoint's files as :func:`moeaudit.checkpoint.digest.resources` lists them: the
    record model-signing's predicate names (name, size, algorithm, digest)."""
    return cast(list[FileResource], listed)


def _receipts_shape(ckpt: Any) -> Callable[[dict[str, Any]], bool]:
    """A cached receipts document must be one of this checkpoint's routed layers."""
    layers = list(ckpt.spec.routed_layers)
    return lambda d: (
        d["schema"] == "moeaudit.receipts/v1"
        and isinstance(d["checkpoint"], dict)
        and [e["layer"] for e in d["layers"]] == layers
    )


def _router_section(spec: Any, docs: Mapping[int, Mapping[str, Any]]) -> RouterSection | None:
    """What a biased / group-limited gate changes (per layer, from ``gate_note``) and the
    bias-balancing telemetry over the run: per layer and checkpoint the selection bias's
    spread, its drift since the previous checkpoint, next to π_min and dead experts."""
    from moeaudit.receipts.gate import gate_note

    note = gate_note(spec)
    if note is None:
        return None
    steps = sorted(docs)
    layers: list[RouterLayer] = []
    for i in spec.routed_layers:
        rows: list[RouterCheckpoint] = []
        prev = None
        for step in steps:
            entry = next(e for e in docs[step]["layers"] if e["layer"] == i)
            bias = (entry.get("gate") or {}).get("selection_bias")
            occ = entry["occupancy"]
            row: RouterCheckpoint = {
                "step": step,
                "pi_min": occ["pi_min"],
                "dead": occ["dead"],
                "bias_min": None,
                "bias_max": None,
                "bias_std": None,
                "bias_drift": None,
            }
            if bias is not None:
                row["bias_min"], row["bias_max"], row["bias_std"] = bias["min"], bias["max"], bias["std"]
                if prev is not None:
                    row["bias_drift"] = sum((a - b) ** 2 for a, b in zip(bias["values"], prev, strict=True)) ** 0.5
                prev = bias["values"]
            rows.append(row)
        layers.append({"layer": i, "checkpoints": rows})
    return cast(RouterSection, {**note, "layers": layers})  # open: the family's note, then the telemetry


Losses = dict[str, float] | None


def _training_loss(run: Run) -> Callable[[int], tuple[Losses, Losses]]:
    """The run's logged training losses around a gate: the mean of each logged key (``loss``,
    the loop's reported objective; ``lm_loss``, the language-model part without auxiliary
    balancing terms, where logged) over (previous checkpoint step, this step], by name, and over
    the window of the same length before the previous checkpoint, (2·previous − step, previous]:
    the training-loss sentence compares equal windows on either side of a checkpoint, never a
    run's warm-up average with its latest steps (a run whose early checkpoints were rotated away
    keeps its logs from step 1). None without logs there. From the metrics log as read once
    (:meth:`Run.read_logs_once`): the bytes whose digest the certificate signs."""
    series = run.parsed.get("metrics")
    if series is None:
        return lambda _step: (None, None)
    from bisect import bisect_right

    steps = series.steps
    starts = dict(zip(run.steps, [-1, *run.steps[:-1]]))

    def mean(a: int, b: int) -> Losses:
        lo, hi = bisect_right(steps, a), bisect_right(steps, b)
        out = {}
        for key, column in (("loss", series.loss), ("lm_loss", series.lm_loss)):
            picked = [v for v in column[lo:hi] if v is not None]
            if picked:
                out[key] = sum(picked) / len(picked)
        return out or None

    def over(step: int) -> tuple[Losses, Losses]:
        prev = starts[step]
        return mean(prev, step), (None if prev < 0 else mean(2 * prev - step, prev))

    return over


class _Replayer:
    """Receipts and pair receipts through the cache; replays only what is missing, keeping the
    anchor states of at most the active baseline and the current checkpoint. A baseline's
    anchor states are cached too, so adding a checkpoint to a run replays only that one."""

    def __init__(
        self,
        canary: Canary,
        policy: Policy,
        cache: ReceiptsCache,
        say: Say,
        total: int,
        device: str | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ):
        self.progress = progress
        self.canary, self.policy, self.cache, self.say, self.total = canary, policy, cache, say, total
        self.device = device
        from moeaudit.cache import replay_machine

        # receipts are bit-identical per machine (docs/decisions.md, "The GPU model is in the cache key")
        self.machine = replay_machine(device)
        self.computed_by: dict[str, str] = {}  # part → the device its own record names
        self.parallel: dict[str, dict[str, Any]] = {}  # part → its expert-parallel replay's ranks
        self.settings = policy.to_json()["receipts"]
        self.states: dict[int, dict[int, AnchorStates]] = {}  # step → routed layer → states
        self.done = 0
        self.from_cache: list[CacheUse] = []  # what this run did not recompute
        self.compute: list[dict[str, Any]] = []  # each replay this audit ran: its FLOPs and energy
        from moeaudit.receipts.flop_reuse import FlopReuse

        self.flops = FlopReuse(device)  # replays of one shape: metered once
        if cache.problem:
            say(f"warning: {cache.problem}")

    def nll_interval(self, wa: list[float], wb: list[float], resamples: int, seed: int) -> list[float]:
        """:func:`paired_interval`, kept in the cache under its inputs: a pure function of cached
        receipts, and the only numpy a fully cached certify would otherwise load (docs/decisions.md, "A fully cached
        certify loads neither torch nor numpy")."""
        key = self.cache.key("nll-interval", wa, wb, resamples, seed)
        hit = self.cache.get(key, check=lambda d: _two_floats(d.get("ci95")))
        if hit is not None:
            self.from_cache.append({"kind": "nll_interval"})
            return hit["ci95"]
        ci = paired_interval(wa, wb, resamples, seed)
        self.cache.put(key, {"ci95": ci})
        return ci

    def _key(self, kind: str, *ckpts: Any) -> str:
        # receipts are bit-identical per device model, driver and torch, not across them
        parts: list[Any] = [[c.digest for c in ckpts], self.canary.digest, self.settings]
        if current_precision() != "fp32":  # a reduced-precision receipt never answers an fp32 request
            parts.append({"precision": current_precision()})
        return self.cache.key(kind, *parts, self.machine)

    def _replay(self, step: int, ckpt: Any) -> Receipts:
        from moeaudit.receipts.state import run_state

        self.say(f"replaying {ckpt.path.name}")
        tick = None
        if self.progress is not None:
            outer, label = self.progress, f"[{self.done}/{self.total}] {ckpt.path.name}"

            def tick(stage: str, done: int, total: int) -> None:  # per layer, forward and backward
                outer(f"{label} {stage}", done, total)

        from moeaudit.receipts.compute import metered

        # the audit's own compute (docs/compliance.md): metered once per shape (receipts.flop_reuse)
        plan = self.flops.plan(ckpt, self.canary, self.settings)
        with metered(self.device, count=plan.meter) as meter:
            doc, obs = run_state(
                ckpt,
                self.canary,
                self.policy,
                keep_states=True,
                device=self.device,
                progress=tick,
                stash_budget=plan.budget,
            )
        cost = self.flops.record(plan, f"checkpoint-{step}.json", meter.record(), obs.kept_layers)
        self.compute.append({"receipt": f"checkpoint-{step}.json", **cost})
        self.cache.put(self._key("compute", ckpt), cost)  # what the cached receipts cost
        self._computed(f"checkpoint-{step}.json", doc)
        self.states[step] = obs.states
        self.cache.put(self._key("receipts", ckpt), doc)
        return doc

    def receipts(self, step: int, ckpt: Any) -> Receipts:
        self.done += 1
        cached = self.cache.get(self._key("receipts", ckpt), check=_receipts_shape(ckpt))
        if cached is not None:
            doc = cast(Receipts, cached)  # this checkpoint's receipts, by digest (MAC and shape checked)
            self.say(f"[{self.done}/{self.total}] {ckpt.path.name}: receipts from cache")
            # cached by digest: the name is of whichever identical checkpoint filled the cache
            doc["checkpoint"]["name"] = ckpt.path.name
            self.from_cache.append({"kind": "receipts", "checkpoints": [ckpt.path.name]})
            cost = self.cache.get(self._key("compute", ckpt), check=lambda d: isinstance(d.get("flops"), int))
            if cost is not None:  # the replay that made these receipts, in an earlier audit
                self.compute.append({"receipt": f"checkpoint-{step}.json", **cost})
            self._computed(f"checkpoint-{step}.json", doc)
            return doc
        self.say(f"[{self.done}/{self.total}] {ckpt.path.name}")
        return self._replay(step, ckpt)

    def _anchor_states(self, step: int, ckpt: Any) -> dict[int, AnchorStates]:
        if step not in self.states:
            cached = self.cache.get_tensors(self._key("states", ckpt))
            layers = ckpt.spec.routed_layers
            from moeaudit.receipts.observer import AnchorStates

            if cached is not None and all(f"{i}.{n}" in cached for i in layers for n in "zy"):
                self.states[step] = {i: AnchorStates(cached[f"{i}.z"], cached[f"{i}.y"]) for i in layers}
                self.from_cache.append({"kind": "anchor_states", "checkpoints": [ckpt.path.name]})
            else:
                self._replay(step, ckpt)
        return self.states[step]

    def new_base(self, step: int, ckpt: Any) -> None:
        """``step`` becomes the active baseline: keep its anchor states, and cache them."""
        self.forget_states(keep=step)
        if step in self.states:
            tensors = {f"{i}.{n}": t for i, s in self.states[step].items() for n, t in (("z", s.z_NH), ("y", s.y_NH))}
            self.cache.put_tensors(self._key("states", ckpt), tensors)

    def pair(self, base: tuple[int, Any], cand: tuple[int, Any]) -> PairDocument:
        key = self._key("pair", base[1], cand[1])
        cached = self.cache.get(key, check=lambda d: d["schema"] == "moeaudit.pair/v1")
        if cached is not None:  # cached by digests: the steps are this run's
            cached.update(base_step=base[0], step=cand[0])
            self.from_cache.append({"kind": "pair", "checkpoints": [base[1].path.name, cand[1].path.name]})
            self._computed(f"pair-{cand[0]}-vs-{base[0]}.json", cached)
            return cast(PairDocument, cached)  # these checkpoints' pair receipts, by digest (MAC checked)
        from moeaudit.receipts.drift import bootstrap_for, pair_layer
        from moeaudit.receipts.state import environment

        (b_step, b_ckpt), (c_step, c_ckpt) = base, cand
        b_states, c_states = self._anchor_states(*base), self._anchor_states(*cand)
        layers: list[PairLayer] = []
        for layer in b_ckpt.spec.routed_layers:  # on the replays' device, experts as stored until used
            boot = bootstrap_for(self.policy.receipts, self.canary.num_windows, layer)
            entry = pair_layer(
                b_ckpt.spec,
                b_ckpt.layer_weights(layer, lazy_experts=True),
                c_ckpt.layer_weights(layer, lazy_experts=True),
                b_states[layer],
                c_states[layer],
                boot,
                device=self.device,
            )
            layers.append({"layer": layer, **entry})
        pair: PairDocument = {
            "schema": "moeaudit.pair/v1",
            "base_step": b_step,
            "step": c_step,
            "environment": environment(self.device),
            "layers": layers,
        }
        doc = finite_document(pair)
        self._computed(f"pair-{c_step}-vs-{b_step}.json", doc)
        b_ckpt.verify_unchanged()  # the bytes read are the bytes hashed, before caching them
        c_ckpt.verify_unchanged()
        self.cache.put(key, doc)
        return doc

    def _computed(self, part: str, doc: Mapping[str, Any]) -> None:
        """Note the device ``doc`` says computed it ("unrecorded" where it says none), and the
        ranks of an expert-parallel replay where it names them."""
        env = doc.get("environment")
        self.computed_by[part] = str(env.get("device", "unrecorded")) if isinstance(env, dict) else "unrecorded"
        # docs/decisions.md, "Expert-parallel replay"
        if isinstance(env, dict) and isinstance(env.get("world_size"), int):
            self.parallel[part] = {k: env.get(k) for k in ("world_size", "backend", "rank_devices")}

    def forget_states(self, keep: int | None) -> None:
        self.states = {s: o for s, o in self.states.items() if s == keep}


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


__all__ = ["Audit", "audit_run", "InputError"]


def write_outputs(
    audit: Audit,
    key: Any,
    out_dir: Path,
    *,
    force: bool = False,
    issued_at: str | None = None,
    target: Any = None,
    compiled: ReceiptsCache | None = None,
) -> dict[str, Path]:
    """Sign and write receipts/, certificate.html, certificate.json and certificate.sigstore.json
    (the same signed statement as a Sigstore bundle) as one output set: staged
    beside ``out_dir`` and renamed into place whole (:class:`moeaudit.output.OutputSet`;
    ``target`` is one the caller opened before the replay, holding the output's lock;
    ``compiled``: a cache for the compiled certificate template)."""
    from moeaudit.output import OutputSet

    if target is None:
        with OutputSet(out_dir, force) as own:
            return write_outputs(audit, key, out_dir, issued_at=issued_at, target=own, compiled=compiled)
    _write_set(audit, key, target.staging, issued_at, compiled)
    target.commit()
    return {
        "certificate": out_dir / "certificate.json",
        "html": out_dir / "certificate.html",
        "bundle": out_dir / BUNDLE_NAME,
        "receipts": out_dir / "receipts",
    }


def _write_set(
    audit: Audit, key: Any, out_dir: Path, issued_at: str | None, compiled: ReceiptsCache | None = None
) -> None:
    import base64
    import json

    from moeaudit.attest.certificate import canonical_json, internal, sign_statement
    from moeaudit.attest.signing import keyid, to_bundle
    from moeaudit.jsonio import atomic_write, dumps
    from moeaudit.report.html import render_html

    cert_path, html_path = out_dir / "certificate.json", out_dir / "certificate.html"
    envelope = sign_statement(audit.statement, key, issued_at=issued_at)
    env_bytes = dumps(envelope).encode("utf-8")
    bundle_bytes = dumps(to_bundle(envelope, key.public_key())).encode("utf-8")
    from moeaudit.limits import MAX_CERTIFICATE_BYTES  # what verify reads (docs/security.md)

    size = max(len(env_bytes), len(bundle_bytes))  # the bundle: the envelope and ~0.1 KB
    if size > MAX_CERTIFICATE_BYTES:
        raise InputError(
            f"the certificate would be {size} bytes, over the {MAX_CERTIFICATE_BYTES >> 20} MiB that verify reads",
            path=cert_path,
            hint="certify fewer checkpoints or a shorter log at a time",
        )
    body = base64.b64decode(envelope["payload"])
    signed = json.loads(body)  # render exactly the signed bytes (docs/security.md, "What the signature binds")
    assert canonical_json(signed) == body
    html = render_html(
        cast(Statement, internal(signed)),  # the statement built above, read back from the signed bytes
        keyid=keyid(key.public_key()),
        envelope_sha256=sha256_hex(env_bytes),
        compiled=compiled,
    )
    (out_dir / "receipts").mkdir(parents=True, exist_ok=True)
    for name, doc in sorted(audit.receipts.items()):
        atomic_write(out_dir / "receipts" / name, dumps(doc))
    atomic_write(html_path, html)
    atomic_write(out_dir / BUNDLE_NAME, bundle_bytes)
    atomic_write(cert_path, env_bytes)


def _two_floats(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, float) and math.isfinite(v) for v in value)
