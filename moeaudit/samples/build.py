"""Build the shipped sample runs and their canary (``moeaudit samples build``).

Seven runs, trained for real by :mod:`moeaudit.samples.train` on :mod:`moeaudit.samples.data`
(see ``sample_checkpoints/README.md`` for the observed numbers):

* ``healthy`` — load-balanced pretraining (Switch aux loss, coefficient 0.05).
* ``collapse`` — same data and init, no balancing: a small anti-balance term (Switch
  coefficient -0.01) lets a few experts win; loss still falls.
* ``frozen-drift`` — continues from healthy's last checkpoint with experts, router and norms
  frozen; attention, embeddings and LM head trained on a shifted domain mix: the small
  analogue of `003` Distill-640 (checkpoints every two intervals, like its 500-step gates).
* ``resume`` — qwen2_moe layout with a shared expert; interrupted a third of an interval after
  its middle checkpoint, resumed from it with a fresh optimizer and half the learning rate
  (``events.jsonl``).
* ``sft-refine`` / ``sft-repurpose`` — from healthy's last checkpoint, code-only fine-tuning:
  low rate with the router frozen, vs. high rate with the router free.
* ``deepseek`` — deepseek_v3 layout (MLA, a dense first layer, a shared expert, sigmoid gate
  with a selection bias, 8 experts in 4 groups of which 2 compete), no auxiliary loss:
  balanced by DeepSeek-V3's bias update ``b_i ← b_i ± γ`` after every step (`000` Eq. 2).

Plus ``canary.jsonl`` (held-out windows from every domain) and ``canary.safetensors``.
Everything is deterministic: fixed seeds, deterministic algorithms, one intra-op thread
(thread count changes float reduction order), no timestamps. ``scale="tiny"`` builds the
same runs with a very small model and a few steps, for the test suite.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moeaudit import canary as canary_mod
from moeaudit.checkpoint.checkpoint import Checkpoint
from moeaudit.errors import UsageError
from moeaudit.replay.engine import replay
from moeaudit.replay.model import MoETap
from moeaudit.samples.data import Mix, canary_windows
from moeaudit.samples.train import (
    Arch,
    Progress,
    TrainConfig,
    TrainerState,
    append_event,
    init_model,
    load_model,
    train,
)

RUNS = ("healthy", "collapse", "frozen-drift", "resume", "sft-refine", "sft-repurpose", "deepseek")
POST_TRAINING = "post-training"


@dataclass(frozen=True)
class Scale:
    """Sizes and schedule of one build; run designs are shared between scales."""

    arch: Arch
    qwen_arch: Arch
    deepseek_arch: Arch
    batch: int
    seq_len: int
    canary_per_domain: int
    interval: int  # steps between checkpoints
    pretrain_checkpoints: int  # healthy, collapse, resume
    continue_checkpoints: int  # frozen-drift and sft runs, after their step-0 checkpoint
    log_every: int
    warmup: int


FULL = Scale(
    arch=Arch(),
    qwen_arch=Arch(family="qwen2_moe", shared_dim=48),
    deepseek_arch=Arch(family="deepseek_v3", shared_dim=32),
    batch=16,
    seq_len=64,
    canary_per_domain=8,
    interval=250,
    pretrain_checkpoints=6,
    continue_checkpoints=4,
    log_every=10,
    warmup=100,
)
TINY = Scale(
    arch=Arch(hidden=16, layers=2, heads=2, kv_heads=1, experts=4, expert_dim=8, max_positions=32),
    qwen_arch=Arch(
        family="qwen2_moe",
        hidden=16,
        layers=2,
        heads=2,
        kv_heads=1,
        experts=4,
        expert_dim=8,
        shared_dim=8,
        max_positions=32,
    ),
    deepseek_arch=Arch(
        family="deepseek_v3",
        hidden=16,
        layers=2,
        heads=2,
        experts=4,
        expert_dim=8,
        shared_dim=8,
        max_positions=32,
        q_lora=8,
        kv_lora=8,
        qk_nope=4,
        qk_rope=4,
        v_dim=4,
        dense_dim=16,
        n_group=2,
        topk_group=1,
    ),
    batch=4,
    seq_len=16,
    canary_per_domain=2,
    interval=3,
    pretrain_checkpoints=2,
    continue_checkpoints=2,
    log_every=2,
    warmup=2,
)
SCALES = {"full": FULL, "tiny": TINY}


@dataclass(frozen=True)
class Context:
    out: Path
    scale: Scale
    progress: Progress | None
    canary: canary_mod.Canary | None = None  # probed at every save (canary_probe.jsonl)

    def steps(self, n: int, first: int = 1) -> tuple[int, ...]:
        return tuple(self.scale.interval * i for i in range(first, n + 1))

    def config(self, **kw: Any) -> TrainConfig:
        s = self.scale
        base = TrainConfig(
            steps=0,
            lr=0.0,
            save_steps=(),
            batch=s.batch,
            seq_len=s.seq_len,
            log_every=s.log_every,
            warmup=s.warmup,
        )
        return replace(base, **kw)

    def healthy_final(self) -> Path:
        path = self.out / "healthy" / f"checkpoint-{self.scale.interval * self.scale.pretrain_checkpoints}"
        if not path.is_dir():
            raise UsageError("the healthy run must be built first", path=path)
        return path


# --- the runs ------------------------------------------------------------------------------------


def _pretrain(ctx: Context, name: str, arch: Arch, **kw: Any) -> None:
    steps = ctx.steps(ctx.scale.pretrain_checkpoints)
    cfg = ctx.config(steps=steps[-1], save_steps=steps, **kw)
    model = init_model(arch, seed=1)
    model.config["router_aux_loss_coef"] = max(cfg.aux_coef, 0.0)
    train(model, ctx.out / name, cfg, name=name, progress=ctx.progress, probe=ctx.canary)


def run_healthy(ctx: Context) -> None:
    _pretrain(ctx, "healthy", ctx.scale.arch, lr=3e-3, aux_coef=0.05, seed=1)


def run_collapse(ctx: Context) -> None:
    _pretrain(ctx, "collapse", ctx.scale.arch, lr=3e-3, aux_coef=-0.01, seed=1)


def run_resume(ctx: Context) -> None:
    """Interrupted 1/3 of an interval after checkpoint 3; resumed from checkpoint 3."""
    s, run = ctx.scale, ctx.out / "resume"
    steps = ctx.steps(s.pretrain_checkpoints)
    resume_at = steps[len(steps) // 2 - 1]
    first = ctx.config(
        steps=steps[-1],
        save_steps=steps,
        lr=3e-3,
        aux_coef=0.05,
        seed=2,
        stop_at=resume_at + s.interval // 3,
    )
    model = init_model(s.qwen_arch, seed=2)
    model.config["router_aux_loss_coef"] = 0.05
    train(model, run, first, name="resume", progress=ctx.progress, probe=ctx.canary)
    ckpt = run / f"checkpoint-{resume_at}"
    note = (
        f"process stopped at step {first.stop_at}; resumed from checkpoint-{resume_at} "
        "with a fresh AdamW state (optimizer state not restored) and peak lr 3e-3 -> 1.5e-3"
    )
    append_event(run, resume_at, "resume", note)
    second = replace(first, lr=1.5e-3, stop_at=None, seed=3)
    train(
        load_model(ckpt),
        run,
        second,
        start_step=resume_at,
        state=TrainerState.read(ckpt),
        name="resume",
        progress=ctx.progress,
        probe=ctx.canary,
    )


def _continue(ctx: Context, name: str, note: str, *, every: int = 1, **kw: Any) -> None:
    """A post-training run from healthy's last checkpoint, with a step-0 baseline.

    Checkpoints every ``every`` intervals, ``continue_checkpoints`` of them after step 0.
    """
    source = ctx.healthy_final()
    run = ctx.out / name
    steps = tuple(every * s for s in ctx.steps(ctx.scale.continue_checkpoints, first=0))
    cfg = ctx.config(steps=steps[-1], save_steps=steps, **kw)
    append_event(
        run,
        0,
        "regime_change",
        f"initialised from healthy/{source.name}; {note}",
        stage=POST_TRAINING,
    )
    model = load_model(source)
    model.config["router_aux_loss_coef"] = 0.0
    train(model, run, cfg, name=name, progress=ctx.progress, probe=ctx.canary)


# `003` Distill-640's "data-regime change": the post-shift mix is mostly arithmetic.
SHIFTED = Mix({"arithmetic": 0.7, "code": 0.1, "prose": 0.1, "records": 0.1})
FROZEN = frozenset({"experts", "router", "norms", "shared"})


def run_frozen_drift(ctx: Context) -> None:
    """Only attention, embeddings and LM head move; routing changes only through them.

    A concentration term (negative Switch coefficient) is added to the objective. With the
    router and experts frozen its gradient reaches only the backbone, so it acts exactly
    where `003` locates the Distill-640 damage: it changes which regions of the frozen
    router's input space the backbone visits. Without it, at this scale, the backbone alone
    did not narrow occupancy measurably (sample_checkpoints/README.md, tuning notes).
    """
    _continue(
        ctx,
        "frozen-drift",
        "experts, router and norms frozen; attention, embeddings and lm_head trained on a "
        "shifted mix (arithmetic 0.7, code/prose/records 0.1 each) with a routing "
        "concentration term (Switch coefficient -0.05) that only the backbone can follow",
        every=2,
        lr=3e-3,
        mix=SHIFTED,
        seed=5,
        aux_coef=-0.05,
        freeze=FROZEN,
    )


CODE_ONLY = Mix({"code": 1.0})


def run_sft_refine(ctx: Context) -> None:
    _continue(
        ctx,
        "sft-refine",
        "fine-tuning on code only, peak lr 5e-5, router frozen",
        lr=5e-5,
        mix=CODE_ONLY,
        seed=5,
        warmup=ctx.scale.warmup // 2,
        freeze=frozenset({"router"}),
    )


def run_sft_repurpose(ctx: Context) -> None:
    _continue(
        ctx,
        "sft-repurpose",
        "fine-tuning on code only, peak lr 3e-3, router free",
        lr=3e-3,
        mix=CODE_ONLY,
        seed=6,
        warmup=ctx.scale.warmup // 2,
    )


def run_deepseek(ctx: Context) -> None:
    """No auxiliary loss: the selection bias alone balances the load (γ = 1e-3 per step, the
    rate DeepSeek-V3 used for most of its pretraining)."""
    _pretrain(ctx, "deepseek", ctx.scale.deepseek_arch, lr=3e-3, bias_rate=1e-3, seed=1)


BUILDERS: dict[str, Callable[[Context], None]] = {
    "healthy": run_healthy,
    "collapse": run_collapse,
    "frozen-drift": run_frozen_drift,
    "resume": run_resume,
    "sft-refine": run_sft_refine,
    "sft-repurpose": run_sft_repurpose,
    "deepseek": run_deepseek,
}


# --- entry point ---------------------------------------------------------------------------------


@contextmanager
def deterministic() -> Iterator[None]:
    """One intra-op thread and deterministic kernels, restored afterwards."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)


def build_canary(out: Path, scale: Scale) -> canary_mod.Canary:
    """``canary.jsonl`` (held-out windows, every domain) and ``canary.safetensors``."""
    windows = canary_windows(scale.canary_per_domain, scale.seq_len, seed=0)
    lines = [json.dumps({"domain": d, "tokens": toks}, separators=(",", ":")) for d, toks in windows]
    (out / "canary.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    canary = canary_mod.build_from_jsonl(out / "canary.jsonl")
    canary_mod.save(canary, out / "canary.safetensors")
    return canary


def build_samples(
    out_dir: str | Path,
    scale: str = "full",
    progress: Progress | None = None,
    runs: Sequence[str] = RUNS,
) -> dict[str, list[Path]]:
    """Build the canary and ``runs`` under ``out_dir``; return each run's checkpoints.

    A run's directory is replaced; other files in ``out_dir`` (README.md, policy.toml) stay.
    ``progress(run, step, total)`` is called after every training step.
    """
    if scale not in SCALES:
        raise UsageError(f"unknown sample scale {scale!r}", hint="use 'full' or 'tiny'")
    unknown = [r for r in runs if r not in BUILDERS]
    if unknown:
        raise UsageError(f"unknown sample run(s) {unknown}", hint=f"runs: {', '.join(RUNS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with deterministic():
        ctx = Context(out, SCALES[scale], progress, build_canary(out, SCALES[scale]))
        for name in RUNS:  # dependency order: healthy before the runs continuing from it
            if name in runs:
                shutil.rmtree(out / name, ignore_errors=True)
                BUILDERS[name](ctx)
    return {name: checkpoints(out / name) for name in runs}


def checkpoints(run_dir: Path) -> list[Path]:
    """``checkpoint-<step>`` directories in step order."""
    found = [p for p in run_dir.glob("checkpoint-*") if p.is_dir() and p.name[11:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[11:]))


# --- verification by replay ----------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointStats:
    """What the sample README reports per checkpoint, measured by our replay on the canary."""

    step: int
    nll: float
    dead: tuple[int, ...]  # per routed layer
    pi_min: tuple[float, ...]
    entropy_norm: tuple[float, ...]  # load entropy of top-k counts / ln E
    c2: tuple[float, ...]  # `003` Eq. 20, exact, per routed layer
    nll_by_domain: dict[str, float]


def _c2(tap: MoETap) -> float:
    """Mean over tokens of the ρρ'-weighted mean κ over ordered co-active pairs (`003` Eq. 20)."""
    z_NH, u_NKH = tap.z_NH, tap.u_NKH
    H = z_NH.shape[1]
    v = u_NKH - z_NH[:, None, :] * (u_NKH * z_NH[:, None, :]).sum(-1, keepdim=True) / H
    v = v / (v.norm(dim=-1, keepdim=True) + 1e-8)
    kappa_NKK = v @ v.transpose(1, 2)
    rho_NK = tap.routing.probs_NE.gather(1, tap.routing.topk_NK)
    w_NKK = rho_NK[:, :, None] * rho_NK[:, None, :]
    K = rho_NK.shape[1]
    w_NKK = w_NKK * (1 - torch.eye(K))
    return float(((w_NKK * kappa_NKK).sum((1, 2)) / w_NKK.sum((1, 2))).mean())


def measure(ckpt_dir: Path, canary: canary_mod.Canary) -> CheckpointStats:
    ckpt = Checkpoint(ckpt_dir)
    c2: dict[int, float] = {}
    with deterministic(), torch.no_grad():
        result = replay(
            ckpt,
            canary.tokens,
            backward=False,
            observers=[lambda tap, lw: c2.__setitem__(tap.layer, _c2(tap))],
        )
    E = ckpt.spec.num_experts
    dead, pi_min, ent = [], [], []
    for layer in ckpt.spec.routed_layers:
        topk = result.routing[layer].topk_NK
        counts = torch.bincount(topk.reshape(-1), minlength=E).double()
        p = counts / counts.sum()
        nz = p[p > 0]
        dead.append(int((counts == 0).sum()))
        pi_min.append(float(counts.min() / topk.shape[0]))
        ent.append(float(-(nz * nz.log()).sum() / math.log(E)))
    by_domain = {d: float(result.nll_windows_W[canary.domain_ids == i].mean()) for i, d in enumerate(canary.domains)}
    step = int(ckpt_dir.name.rsplit("-", 1)[1])
    return CheckpointStats(
        step,
        result.nll,
        tuple(dead),
        tuple(pi_min),
        tuple(ent),
        tuple(c2[i] for i in ckpt.spec.routed_layers),
        by_domain,
    )
