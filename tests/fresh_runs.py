"""Fresh MoE training runs that nobody tuned moeaudit for.

Each :class:`Recipe` trains a tiny transformers MoE for real — the HF ``Trainer`` with
moeaudit's own :class:`~moeaudit.integrations.transformers.MoeauditCallback`, or a plain torch
loop with :class:`~moeaudit.integrations.core.RunRecorder` — on synthetic multi-domain token
streams, and writes the Hugging Face Trainer run layout moeaudit reads (README.md, "Logging from your training loop")::

    RUN/checkpoint-<step>/   config.json, model.safetensors (+ trainer_state.json from the Trainer)
    RUN/metrics.jsonl        per-step per-expert gradient norms (moeaudit's hook)
    RUN/canary_probe.jsonl   the hook's canary probe at every save
    RUN/canary.safetensors   held-out windows of every domain, labelled by domain

Data: :data:`DOMAINS` sparse first-order Markov chains over one shared vocabulary, each on its
own overlapping band of tokens with its own successor table, so the loss genuinely falls and
domains route differently; a token shared by two bands has different successors in each, so
attention has something to learn too. The canary holds windows drawn from the same chains by a
stream no run trains on.

    python3 tests/fresh_runs.py OUTDIR [NAME ...]   # build runs, print per-run wall times

In tests, the session fixture ``fresh_runs`` (tests/conftest.py) maps every recipe name to its
run, trained the first time it is looked up: in ``$MOEAUDIT_FRESH_RUNS`` when set (a persistent
cache, ``<name>-<key>/`` keyed by this file's source, the recipe and the torch/transformers
versions; stale keys can be deleted), else in the session's temporary directory. moeaudit
looks for ``policy.toml`` up to two levels above a run, so keep that directory away from one
when the built-in defaults are under test. Training is deterministic: fixed seeds, one
intra-op thread; the weights and logs repeat byte for byte on the same machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import transformers

    from moeaudit.canary import Canary

VOCAB = 128
DOMAINS = ("alpha", "beta", "gamma", "delta")
BAND = 48  # tokens per domain band; bands start VOCAB/len(DOMAINS) apart, so neighbours overlap
SUCCESSORS = 3  # non-zero entries per row of a domain's transition table
NOISE = 0.05  # chance of a uniform jump within the band (keeps every chain ergodic)
SEQ = 48  # tokens per training and canary window
CANARY_PER_DOMAIN = 6
WORLD_SEED = 20260  # the chains and the canary: the same for every run
ENV = "MOEAUDIT_FRESH_RUNS"  # a directory: the persistent cache of built runs
RECIPE_FILE = "recipe.json"  # written last into a run: its presence means the run is complete


@dataclass(frozen=True)
class Recipe:
    """How one run is trained; every field enters the cache key."""

    # "healthy" | "collapse" | "overfit" | "stress" (healthy training, awkward layout) |
    # "confident" (a router boosted into exact-zero combine weights) | "top1" | "every_active" (E = k) |
    # "killed" | "shift"
    kind: str
    family: str = "mixtral"  # a transformers model_type moeaudit replays
    loop: str = "trainer"  # "trainer" (HF Trainer + MoeauditCallback) | "torch" (own loop + RunRecorder)
    seed: int = 0
    hidden: int = 32
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    steps: int = 300
    save_every: int = 100
    save_at: tuple[int, ...] = ()  # an explicit (uneven) save schedule; torch loop only
    log_every: int = 1
    batch: int = 8
    lr: float = 3e-3
    warmup: int = 20
    aux_coef: float = 0.02  # router_aux_loss_coef (negative: anti-balance)
    memorise_from: int = 0  # > 0: after this step, train on a fixed set of ``memorise_windows``
    memorise_windows: int = 0
    memorise_lr: float = 0.0
    frozen: tuple[int, int] = (0, 0)  # steps in (lo, hi] compute and log gradients, skip the update
    # torch loop only: the router's learning rate times ``router_boost[2]`` for the updates of
    # steps in (lo, hi] (a confident router: logits so far apart that a combine weight is 0)
    router_boost: tuple[int, int, float] = (0, 0, 1.0)
    # torch loop only: (step, layer, expert) — from that step on the expert's weights are zeroed
    # after every update (killed and frozen); (0, 0, 0) kills nothing
    kill: tuple[int, int, int] = (0, 0, 0)
    shift_from: int = 0  # > 0: after this step, train on the first domain only (a domain shift)
    note: str = ""


RECIPES: dict[str, Recipe] = {
    "healthy-a": Recipe("healthy", seed=0, steps=600, note="Trainer, 2 layers x 4 experts, saves every 100"),
    "healthy-b": Recipe(
        "healthy",
        seed=1,
        hidden=64,
        layers=4,
        experts=8,
        steps=450,
        save_every=150,
        aux_coef=0.05,
        note="Trainer, hidden 64, 4 layers x 8 experts, saves every 150",
    ),
    "healthy-loop": Recipe(
        "healthy",
        loop="torch",
        seed=2,
        experts=8,
        steps=400,
        save_every=50,
        aux_coef=0.03,
        note="plain torch loop, 8 experts, saves every 50",
    ),
    "healthy-olmoe": Recipe(
        "healthy", family="olmoe", seed=3, aux_coef=0.03, note="OLMoE (q/k norm, top-k not renormalised), Trainer"
    ),
    "healthy-qwen2": Recipe(
        "healthy",
        family="qwen2_moe",
        seed=9,
        steps=400,
        aux_coef=0.02,
        note="Qwen2-MoE (shared expert behind a sigmoid gate, qkv bias), Trainer",
    ),
    "collapse-a": Recipe(
        "collapse",
        seed=4,
        steps=600,
        aux_coef=-0.04,
        note="anti-balance -0.04, Trainer: pi_min narrows save by save, < k/E/10 from 300",
    ),
    "collapse-loop": Recipe(
        "collapse",
        loop="torch",
        seed=5,
        experts=8,
        steps=400,
        save_every=50,
        aux_coef=-0.02,
        note="anti-balance -0.02, plain loop, 8 experts: < k/E/10 from 100, a dead expert at 350",
    ),
    "collapse-b": Recipe(
        "collapse",
        seed=8,
        hidden=64,
        layers=4,
        experts=8,
        steps=450,
        save_every=150,
        aux_coef=-0.05,
        note="anti-balance -0.05, Trainer, 4 layers x 8 experts: dead from 150 on",
    ),
    "overfit": Recipe(
        "overfit",
        loop="torch",
        seed=6,
        hidden=64,
        steps=300,
        save_every=50,
        memorise_from=150,
        memorise_windows=4,
        memorise_lr=2e-2,
        note="150 healthy steps, then 4 windows memorised at rate 2e-2",
    ),
    "stress-uneven": Recipe(
        "stress",
        loop="torch",
        seed=7,
        steps=310,
        log_every=3,
        save_at=(40, 100, 130, 250, 310),
        note="uneven saves, metrics every 3rd step: no save step has a metrics line",
    ),
    "stress-sparse-log": Recipe(
        "stress",
        seed=10,
        steps=330,
        save_every=120,
        log_every=50,
        note="Trainer, saves every 120 and at the end (330), metrics every 50th step",
    ),
    "stress-frozen": Recipe(
        "stress",
        loop="torch",
        seed=11,
        steps=300,
        save_every=50,
        frozen=(200, 250),
        note="updates skipped in (200, 250]: checkpoint-200 and -250 hold the same bytes",
    ),
    "confident-router": Recipe(
        "confident",
        loop="torch",
        seed=12,
        experts=8,
        steps=150,
        save_every=50,
        router_boost=(60, 90, 1000.0),
        note="router rate x1000 for steps 61-90: a second combine weight of exactly 0 on some "
        "canary tokens, no collapse, NLL recovers",
    ),
    "top1": Recipe(
        "top1", loop="torch", seed=13, top_k=1, steps=150, save_every=50, note="top-1 routing, 4 experts, plain loop"
    ),
    "every-active": Recipe(
        "every_active",
        loop="torch",
        seed=16,
        experts=2,
        top_k=2,
        steps=150,
        save_every=50,
        note="E = k: two experts, top-2, every expert active on every token, plain loop",
    ),
    "killed-expert": Recipe(
        "killed",
        loop="torch",
        seed=14,
        steps=320,
        save_every=40,
        kill=(240, 0, 1),
        note="healthy, then expert 1 of layer 0 zeroed and frozen from step 240 on",
    ),
    "domain-shift": Recipe(
        "shift",
        loop="torch",
        seed=15,
        steps=240,
        save_every=40,
        shift_from=120,
        note="120 steps on every domain, then the first domain only",
    ),
}


# --- data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """Each domain's band of tokens and the cumulative rows of its transition table
    (``cdfs[d]`` is ``[VOCAB, VOCAB]``; only the band's rows are ever read)."""

    bands: tuple[np.ndarray, ...]
    cdfs: tuple[np.ndarray, ...]

    def windows(self, domain: int, n: int, rng: np.random.Generator, length: int = SEQ) -> np.ndarray:
        """``[n, length]`` token windows of one domain's chain."""
        band, cdf = self.bands[domain], self.cdfs[domain]
        out = np.empty((n, length), dtype=np.int64)
        out[:, 0] = rng.choice(band, size=n)
        for t in range(1, length):
            nxt = (cdf[out[:, t - 1]] <= rng.random(n)[:, None]).sum(axis=1)
            jump = rng.random(n) < NOISE
            out[:, t] = np.where(jump, rng.choice(band, size=n), nxt)
        return out


def world() -> World:
    rng = np.random.default_rng(WORLD_SEED)
    stride = VOCAB // len(DOMAINS)
    bands, cdfs = [], []
    for d in range(len(DOMAINS)):
        band = (d * stride + np.arange(BAND)) % VOCAB
        table = np.zeros((VOCAB, VOCAB))
        for tok in band:
            successors = rng.choice(band, size=SUCCESSORS, replace=False)  # drawn before the weights
            table[tok, successors] = rng.dirichlet(np.ones(SUCCESSORS))
        cdf = np.cumsum(table, axis=1)
        cdf[band] /= cdf[band, -1:]  # ends at exactly 1.0: a draw in [0, 1) never runs off the row
        bands.append(band)
        cdfs.append(cdf)
    return World(tuple(bands), tuple(cdfs))


def canary(w: World) -> Canary:
    from moeaudit.canary import Canary

    rng = np.random.default_rng(WORLD_SEED + 1)  # no run draws from this stream
    tokens = np.concatenate([w.windows(d, CANARY_PER_DOMAIN, rng) for d in range(len(DOMAINS))])
    ids = np.repeat(np.arange(len(DOMAINS)), CANARY_PER_DOMAIN)
    return Canary(tokens.astype("int32"), ids.astype("int32"), DOMAINS, source="fresh_runs")


def batches(w: World, r: Recipe) -> np.ndarray:
    """``[steps, batch, SEQ]`` training tokens: a fresh stream with the domains mixed in every
    batch; after ``memorise_from``, the same ``memorise_windows`` windows over and over."""
    rng = np.random.default_rng(1000 + r.seed)
    n = r.steps * r.batch
    doms = rng.integers(0, len(DOMAINS), size=n)
    rows_NT = np.empty((n, SEQ), dtype=np.int64)
    for d in range(len(DOMAINS)):
        sel = np.flatnonzero(doms == d)
        rows_NT[sel] = w.windows(d, len(sel), rng)
    out_SBT = rows_NT.reshape(r.steps, r.batch, SEQ)
    if r.shift_from:
        out_SBT[r.shift_from :] = w.windows(0, (r.steps - r.shift_from) * r.batch, rng).reshape(-1, r.batch, SEQ)
    if r.memorise_from:
        fixed = np.concatenate([w.windows(d % len(DOMAINS), 1, rng) for d in range(r.memorise_windows)])
        out_SBT[r.memorise_from :] = fixed[np.arange(r.batch) % r.memorise_windows]
    return out_SBT


# --- models ----------------------------------------------------------------------------------


def model_for(r: Recipe) -> transformers.PreTrainedModel:
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=r.hidden,
        num_hidden_layers=r.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=r.top_k,
        max_position_embeddings=SEQ,
        intermediate_size=2 * r.hidden,
        output_router_logits=True,
        router_aux_loss_coef=r.aux_coef,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    per_family = {
        "mixtral": dict(num_local_experts=r.experts),
        "olmoe": dict(num_experts=r.experts),
        "qwen2_moe": dict(
            num_experts=r.experts, moe_intermediate_size=2 * r.hidden, shared_expert_intermediate_size=2 * r.hidden
        ),
    }
    config = transformers.AutoConfig.for_model(r.family, **common, **per_family[r.family])
    config._attn_implementation = "eager"
    torch.manual_seed(r.seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_schedule(r: Recipe) -> list[int]:
    if r.save_at:
        return list(r.save_at)
    steps = list(range(r.save_every, r.steps + 1, r.save_every))
    return steps if steps and steps[-1] == r.steps else [*steps, r.steps]  # the Trainer saves at the end


# --- training --------------------------------------------------------------------------------


def _lr_factor(r: Recipe) -> Callable[[int], float]:
    """LambdaLR's factor of ``r.lr`` for the update of step ``i + 1``: linear warmup, then
    constant (the Trainer's ``constant_with_warmup``); ``memorise_lr`` once memorising."""

    def factor(i: int) -> float:
        if r.memorise_from and i >= r.memorise_from:
            return r.memorise_lr / r.lr
        return min(1.0, (i + 1) / r.warmup) if r.warmup else 1.0

    return factor


def train_trainer(r: Recipe, run: Path, data: np.ndarray, probe: Canary) -> None:
    """The Trainer, as a user would set it up, with moeaudit's callback."""
    import transformers

    from moeaudit.integrations.transformers import MoeauditCallback

    assert not (r.save_at or r.memorise_from or any(r.frozen) or r.kill[0] or r.router_boost[1]), "torch loop only"
    rows = torch.from_numpy(data.reshape(-1, SEQ))
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=r.steps,
        save_steps=r.save_every,
        per_device_train_batch_size=r.batch,
        learning_rate=r.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=r.warmup,
        weight_decay=0.0,
        max_grad_norm=1.0,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=10,
        save_only_model=True,
        seed=r.seed,
        data_seed=r.seed,
    )
    trainer = transformers.Trainer(
        model=model_for(r), args=args, train_dataset=dataset, callbacks=[MoeauditCallback(probe, every=r.log_every)]
    )
    trainer.remove_callback(transformers.PrinterCallback)  # its lines stay in trainer_state.json
    trainer.train()


def train_loop(r: Recipe, run: Path, data: np.ndarray, probe: Canary) -> None:
    """The README's own loop: log before clipping, ``save_pretrained`` and probe at each save.
    The logged ``loss`` is the objective trained on; ``ce_loss`` and ``aux_loss`` its parts."""
    from moeaudit.integrations.core import RunRecorder

    model = model_for(r).train()
    boost_lo, boost_hi, boost = r.router_boost
    if boost_hi:  # the routers in a group of their own, whose rate the boost scales
        named = dict(model.named_parameters())
        routers = [p for n, p in named.items() if n.endswith("mlp.gate.weight")]
        others = [p for p in named.values() if all(p is not q for q in routers)]
        opt = torch.optim.AdamW([{"params": others}, {"params": routers}], lr=r.lr, weight_decay=0.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=r.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(r))
    recorder = RunRecorder(run, model, canary=probe, every=r.log_every, probe=True, resume_step=None)
    saves, (lo, hi) = set(save_schedule(r)), r.frozen
    try:
        for step in range(1, r.steps + 1):
            batch = torch.from_numpy(data[step - 1])
            out = model(input_ids=batch, labels=batch)
            out.loss.backward()
            loss, aux = float(out.loss.detach()), float(out.aux_loss.detach())
            recorder.log_step(step, loss, ce_loss=loss - r.aux_coef * aux, aux_loss=aux)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not lo < step <= hi:
                boosted = boost_lo < step <= boost_hi
                if boosted:
                    opt.param_groups[1]["lr"] *= boost
                opt.step()
                if boosted:
                    opt.param_groups[1]["lr"] /= boost
            if r.kill[0] and step >= r.kill[0]:
                _kill(model, r.kill[1], r.kill[2])
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step in saves:
                model.save_pretrained(run / f"checkpoint-{step}")
                recorder.probe(step)
    finally:
        recorder.close()


@torch.no_grad()
def _kill(model: transformers.PreTrainedModel, layer: int, expert: int) -> None:
    """Zero every weight of one routed expert (fused or per-expert storage)."""
    experts = model.model.layers[layer].mlp.experts
    for p in experts.parameters():
        if p.dim() == 3:  # fused [E, ...]
            p[expert].zero_()
    for name, p in experts.named_parameters():
        if p.dim() < 3 and name.split(".")[0] == str(expert):
            p.zero_()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread: the float reduction order, hence the bytes, repeat; and tiny
    models run fastest so on a small shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No transformers progress bars or info lines."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def train(r: Recipe, run: Path) -> Path:
    """Train ``r`` into the new directory ``run``; ``recipe.json`` is written last."""
    run.mkdir(parents=True)
    w = world()
    with one_thread(), _quiet():
        (train_trainer if r.loop == "trainer" else train_loop)(r, run, batches(w, r), canary(w))
    (run / RECIPE_FILE).write_text(json.dumps(asdict(r), indent=1) + "\n")
    return run


def build(recipe_name: str, out_dir: Path) -> Path:
    """Train ``RECIPES[recipe_name]`` into ``out_dir/recipe_name`` (replaced if present)."""
    run = Path(out_dir) / recipe_name
    shutil.rmtree(run, ignore_errors=True)
    return train(RECIPES[recipe_name], run)


# --- cache -----------------------------------------------------------------------------------


def recipe_key(name: str) -> str:
    """This file's source, the recipe and the library versions that train it."""
    import transformers

    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(repr((name, RECIPES[name], torch.__version__, transformers.__version__)).encode())
    return h.hexdigest()[:16]


def cached(name: str, root: Path) -> Path:
    """The run ``name`` at ``root/<name>-<key>``, trained once and then reused. It is built in
    a staging directory private to this process and renamed into place, so a concurrent
    session never reads half a run (the first rename wins; the loser's copy is dropped)."""
    final = Path(root) / f"{name}-{recipe_key(name)}"
    if (final / RECIPE_FILE).is_file():
        return final
    stage = Path(root) / f".stage-{final.name}-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    built = build(name, stage)
    try:
        os.rename(built, final)
    except OSError:
        if not (final / RECIPE_FILE).is_file():
            raise
    shutil.rmtree(stage, ignore_errors=True)
    return final


class FreshRuns(Mapping[str, Path]):
    """``{name: run directory}`` for every recipe; a run is trained (or found in the cache)
    the first time its path is looked up. Runs are shared: treat them as read-only."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._built: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self._built:
            if name not in RECIPES:
                raise KeyError(name)
            self._built[name] = cached(name, self.root)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(RECIPES)

    def __len__(self) -> int:
        return len(RECIPES)

    def of_kind(self, kind: str) -> dict[str, Path]:
        return {name: self[name] for name, r in RECIPES.items() if r.kind == kind}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    out, names = Path(argv[0]), argv[1:] or list(RECIPES)
    out.mkdir(parents=True, exist_ok=True)
    total = time.perf_counter()
    for name in names:
        start = time.perf_counter()
        build(name, out)
        r = RECIPES[name]
        print(
            f"{name:15s} {r.kind:8s} {r.family:8s} {r.loop:7s} {r.steps:4d} steps  "
            f"saves {save_schedule(r)}  {time.perf_counter() - start:6.1f} s",
            flush=True,
        )
    print(f"total {time.perf_counter() - total:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
