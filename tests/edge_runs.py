"""Tiny training runs in the router configurations users have, healthy and deliberately damaged.

Each :class:`Edge` trains moeaudit's own functional decoder (:mod:`moeaudit.samples.train`,
AdamW on the sample text) for a few dozen steps, so a run takes seconds: top-1 routing, few
experts (E = 3, 4 with k = 2, and E = k), many experts with sparse counts (E = 32, 64), a
shared expert (Qwen2-MoE) and DeepSeek-V3's sigmoid router with its selection bias. A damaged
run is healthy up to ``damage_from`` and then:

* ``"collapse"``: trained on from there with a strongly negative Switch coefficient
  (anti-balance: the router concentrates on few experts, as the ``collapse`` sample does);
* ``"force"`` (DeepSeek-V3 only): the selection bias of experts 0..k-1 set to +100, so every
  token's top-k is those k experts — the router forced onto one set;
* ``"kill"``: expert 1 of every routed layer zeroed in the checkpoints from ``damage_from`` on
  (the router still sends it tokens; no gradient reaches it).

The runs record no canary probe, so any canary can be audited against them: :data:`CANARIES`
builds the run's ordinary canary and the degenerate ones (windows of 2 tokens, one domain,
one repeated token). Runs are cached like tests/fresh_runs.py: in ``$MOEAUDIT_FRESH_RUNS`` when
set (``edge-<name>-<key>/``, keyed by this file's, the trainer's and the decoder's source, the
recipe and the torch version), else in the session's temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

ENV = "MOEAUDIT_FRESH_RUNS"
DONE = "edge.json"  # written last into a run: its presence means the run is complete
SEQ = 16


@dataclass(frozen=True)
class Edge:
    family: str = "mixtral"  # mixtral | qwen2_moe | deepseek_v3
    experts: int = 4
    top_k: int = 2
    shared_dim: int = 0
    steps: int = 120  # the starvation rule judges windows of 100 steps: fewer is INCONCLUSIVE
    save_every: int = 40
    aux_coef: float = 0.05
    bias_rate: float = 0.0  # DeepSeek-V3's loss-free balancer
    n_group: int = 1
    topk_group: int = 1
    seed: int = 1
    damage: str = ""  # "" | "collapse" | "force" | "kill"
    damage_from: int = 80


RUNS: dict[str, Edge] = {
    "top1": Edge(top_k=1),
    "top1-collapse": Edge(top_k=1, damage="collapse"),
    "top1-kill": Edge(top_k=1, damage="kill"),
    "e3k2": Edge(experts=3),
    "e3k2-collapse": Edge(experts=3, damage="collapse"),
    "e4k2-kill": Edge(damage="kill"),
    "e2k2": Edge(experts=2),
    "e2k2-kill": Edge(experts=2, damage="kill"),
    "e32k4": Edge(experts=32, top_k=4, aux_coef=0.1),
    "e32k4-collapse": Edge(experts=32, top_k=4, aux_coef=0.1, damage="collapse"),
    "e64k8-kill": Edge(experts=64, top_k=8, aux_coef=0.1, damage="kill"),
    "qwen2-shared": Edge(family="qwen2_moe", shared_dim=8),
    "qwen2-top1-shared": Edge(family="qwen2_moe", shared_dim=8, top_k=1),  # Llama-4 style
    "qwen2-shared-collapse": Edge(family="qwen2_moe", shared_dim=8, damage="collapse"),
    "deepseek": Edge(family="deepseek_v3", experts=8, shared_dim=8, aux_coef=0.0, bias_rate=1e-3, n_group=2),
    "deepseek-force": Edge(
        family="deepseek_v3", experts=8, shared_dim=8, aux_coef=0.0, bias_rate=1e-3, n_group=2, damage="force"
    ),
    "deepseek-kill": Edge(
        family="deepseek_v3", experts=8, shared_dim=8, aux_coef=0.0, bias_rate=1e-3, n_group=2, damage="kill"
    ),
}


def _arch(r: Edge):  # -> Arch
    from moeaudit.samples.train import Arch

    common = dict(hidden=16, layers=2, heads=2, kv_heads=1, expert_dim=8, max_positions=32)
    if r.family == "deepseek_v3":
        return Arch(
            family="deepseek_v3",
            experts=r.experts,
            top_k=r.top_k,
            shared_dim=r.shared_dim,
            q_lora=8,
            kv_lora=8,
            qk_nope=4,
            qk_rope=4,
            v_dim=4,
            dense_layers=0,
            dense_dim=16,
            n_group=r.n_group,
            topk_group=r.topk_group,
            **{k: v for k, v in common.items() if k != "kv_heads"},
        )
    return Arch(family=r.family, experts=r.experts, top_k=r.top_k, shared_dim=r.shared_dim, **common)


def train(r: Edge, run: Path) -> Path:
    from moeaudit.samples.build import deterministic
    from moeaudit.samples.train import TrainConfig, TrainerState, init_model, load_model
    from moeaudit.samples.train import train as train_loop

    saves = tuple(range(r.save_every, r.steps + 1, r.save_every))
    cfg = TrainConfig(
        steps=r.steps, lr=3e-3, save_steps=saves, batch=4, seq_len=SEQ, warmup=2, log_every=1,
        aux_coef=r.aux_coef, bias_rate=r.bias_rate, seed=r.seed,
    )  # fmt: skip
    run.mkdir(parents=True)
    with deterministic():
        model = init_model(_arch(r), seed=r.seed)
        model.config["router_aux_loss_coef"] = max(r.aux_coef, 0.0)
        if r.damage != "collapse":
            train_loop(model, run, cfg)
        else:  # healthy to damage_from, then anti-balance
            train_loop(model, run, replace(cfg, stop_at=r.damage_from))
            ckpt = run / f"checkpoint-{r.damage_from}"
            train_loop(
                load_model(ckpt), run, replace(cfg, aux_coef=-2.0), start_step=r.damage_from,
                state=TrainerState.read(ckpt),
            )  # fmt: skip
    if r.damage in ("force", "kill"):
        for step in saves:
            if step >= r.damage_from:
                _damage(run / f"checkpoint-{step}", r)
    (run / DONE).write_text(json.dumps(asdict(r), indent=1) + "\n")
    return run


def _damage(ckpt: Path, r: Edge) -> None:
    """Rewrite one saved checkpoint's weights: the selection bias forced, or expert 1 zeroed."""
    from moeaudit.checkpoint.checkpoint import Checkpoint
    from moeaudit.checkpoint.safetensors import write_safetensors

    spec = Checkpoint(ckpt).spec
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    for layer in range(spec.num_layers):
        if not spec.is_routed(layer):
            continue
        if r.damage == "force":
            key = spec.layout.layer["router_bias"][0].format(layer=layer)
            bias = torch.full_like(tensors[key], -100.0)
            bias[: r.top_k] = 100.0
            tensors[key] = bias
        else:
            for templates in spec.layout.expert.values():
                key = templates[0].format(layer=layer, expert=1)
                tensors[key] = torch.zeros_like(tensors[key])
    write_safetensors(ckpt / "model.safetensors", tensors, {"format": "pt"})


# --- canaries --------------------------------------------------------------------------------


def canary(kind: str):  # -> Canary
    """``ordinary``: 3 windows of 16 tokens per sample domain (12 windows); ``short``: the same
    windows cut to 2 tokens; ``one-domain``: 12 windows of the code domain; ``one-token``: 12
    windows of the token ``e``, repeated."""
    from moeaudit.canary import Canary
    from moeaudit.samples.data import DOMAINS, canary_windows, encode

    if kind in ("ordinary", "short"):
        pairs = canary_windows(3, SEQ, seed=0)
        tokens = np.array([t for _, t in pairs], dtype=np.int32)
        ids = np.array([DOMAINS.index(d) for d, _ in pairs], dtype=np.int32)
        if kind == "short":
            tokens = tokens[:, :2].copy()
        return Canary(tokens, ids, DOMAINS, source=f"edge-{kind}")
    if kind == "one-domain":
        pairs = canary_windows(12, SEQ, seed=0)
        tokens = np.array([t for d, t in pairs if d == "code"], dtype=np.int32)
        return Canary(tokens, np.zeros(len(tokens), dtype=np.int32), ("code",), source="edge-one-domain")
    if kind == "one-token":
        tokens = np.full((12, SEQ), int(encode("e")[0]), dtype=np.int32)
        return Canary(tokens, np.zeros(12, dtype=np.int32), ("prose",), source="edge-one-token")
    raise ValueError(kind)


CANARIES = ("ordinary", "short", "one-domain", "one-token")


# --- cache -----------------------------------------------------------------------------------


def key(name: str) -> str:
    """This file's source, the trainer's and the decoder's it trains, the recipe and torch's version."""
    import moeaudit.replay.model
    import moeaudit.samples.train

    h = hashlib.sha256(Path(__file__).read_bytes())
    for module in (moeaudit.samples.train, moeaudit.replay.model):
        h.update(Path(str(module.__file__)).read_bytes())
    h.update(repr((name, RUNS[name], torch.__version__)).encode())
    return h.hexdigest()[:16]


def cached(name: str, root: Path) -> Path:
    """``root/edge-<name>-<key>``, trained once; built in a private staging directory and
    renamed into place (the first rename wins), as tests/fresh_runs.py does."""
    final = Path(root) / f"edge-{name}-{key(name)}"
    if (final / DONE).is_file():
        return final
    stage = Path(root) / f".stage-{final.name}-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    train(RUNS[name], stage)
    try:
        os.rename(stage, final)
    except OSError:
        if not (final / DONE).is_file():
            raise
    shutil.rmtree(stage, ignore_errors=True)
    return final
