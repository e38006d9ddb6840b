"""A small, real, deterministic CPU training loop over the functional decoder.

The model is the replay's own decoder (:mod:`moeaudit.replay.model`) with its weights as leaf
tensors: embeddings, final norm and LM head, plus one :class:`LayerWeights` per decoder
layer. Training is AdamW on next-token cross-entropy, optionally plus the Switch
load-balancing loss ``E·Σ_e f_e·P_e`` per routed layer (a negative coefficient pushes routing
toward few experts, for the ``collapse`` sample). Components can be frozen: a frozen tensor is
not updated, but its gradient is still computed, so the hook logs the signal it receives.

Runs are written like a Hugging Face Trainer output directory (README.md, "Logging from your training loop")::

    RUN/checkpoint-<step>/{config.json, model.safetensors, trainer_state.json}
    RUN/metrics.jsonl      (moeaudit.integrations.hooks.ExpertGradLogger)
    RUN/canary_probe.jsonl (the same hook's canary probe at every save, when given a canary)
    RUN/events.jsonl       (resume / regime_change, where relevant)

Each checkpoint is written into ``checkpoint-<step>.tmp/`` and renamed into place. Nothing
written holds a timestamp; with fixed seeds and deterministic algorithms the bytes repeat.

Shape suffixes: B windows, T tokens, N = B·T, E experts, K top-k.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeaudit.canary import Canary
from moeaudit.checkpoint.checkpoint import Checkpoint, LayerWeights, expected_layer_names, expected_shapes
from moeaudit.checkpoint.safetensors import write_safetensors
from moeaudit.families import spec_from_config
from moeaudit.integrations.hooks import ExpertGradLogger
from moeaudit.replay.model import MoETap, decoder_layer, embed, rope_tables, token_nll
from moeaudit.samples.data import UNIFORM, VOCAB_SIZE, Batches, Mix
from moeaudit.spec.config import ModelSpec

Progress = Callable[[str, int, int], None]
COMPONENTS = ("embed", "lm_head", "norms", "attention", "router", "experts", "shared")
_ATTN = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_a", "q_b", "kv_a", "kv_b")
_NORMS = ("input_norm", "post_norm", "q_norm", "k_norm", "q_a_norm", "kv_a_norm")
_SHARED = ("shared_w1", "shared_w3", "shared_w2", "shared_gate")


# --- architecture and config.json ----------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """A tiny MoE decoder in the ``mixtral``, ``qwen2_moe`` or ``deepseek_v3`` layout."""

    family: str = "mixtral"
    vocab_size: int = VOCAB_SIZE
    hidden: int = 48
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    experts: int = 8
    top_k: int = 2
    expert_dim: int = 32
    shared_dim: int = 0  # qwen2_moe: shared expert (with sigmoid gate); deepseek: ungated
    max_positions: int = 128
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # deepseek_v3 only: MLA sizes, the dense first layers, expert groups, combine scaling
    q_lora: int = 24
    kv_lora: int = 16
    qk_nope: int = 8
    qk_rope: int = 4
    v_dim: int = 12
    dense_layers: int = 1
    dense_dim: int = 96
    n_group: int = 4
    topk_group: int = 2
    scaling: float = 2.5


def hf_config(arch: Arch, aux_coef: float = 0.0) -> dict[str, Any]:
    """A ``config.json`` that transformers' ``AutoModelForCausalLM.from_pretrained`` loads."""
    common: dict[str, Any] = {
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "float32",
        "eos_token_id": None,
        "head_dim": arch.hidden // arch.heads,
        "hidden_act": "silu",
        "hidden_size": arch.hidden,
        "initializer_range": arch.init_std,
        "max_position_embeddings": arch.max_positions,
        "model_type": arch.family,
        "num_attention_heads": arch.heads,
        "num_experts_per_tok": arch.top_k,
        "num_hidden_layers": arch.layers,
        "num_key_value_heads": arch.kv_heads,
        "output_router_logits": False,
        "pad_token_id": 0,
        "rope_parameters": {"rope_theta": arch.rope_theta, "rope_type": "default"},
        "rope_theta": arch.rope_theta,  # transformers v4 reads it here
        "router_aux_loss_coef": aux_coef,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",  # transformers v4 name of "dtype"
        "use_cache": True,
        "vocab_size": arch.vocab_size,
    }
    if arch.family == "mixtral":
        return {
            **common,
            "architectures": ["MixtralForCausalLM"],
            "intermediate_size": arch.expert_dim,
            "num_local_experts": arch.experts,
            "rms_norm_eps": 1e-5,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    if arch.family == "qwen2_moe":
        return {
            **common,
            "architectures": ["Qwen2MoeForCausalLM"],
            "decoder_sparse_step": 1,
            "intermediate_size": arch.shared_dim or arch.expert_dim,
            "layer_types": ["full_attention"] * arch.layers,
            "max_window_layers": arch.layers,
            "mlp_only_layers": [],
            "moe_intermediate_size": arch.expert_dim,
            "norm_topk_prob": False,
            "num_experts": arch.experts,
            "qkv_bias": True,
            "rms_norm_eps": 1e-6,
            "shared_expert_intermediate_size": arch.shared_dim,
            "sliding_window": None,
            "use_sliding_window": False,
        }
    if arch.family == "deepseek_v3":
        mla = {k: v for k, v in common.items() if k != "head_dim"}
        return {
            **mla,
            "architectures": ["DeepseekV3ForCausalLM"],
            "first_k_dense_replace": arch.dense_layers,
            "intermediate_size": arch.dense_dim,
            "kv_lora_rank": arch.kv_lora,
            "moe_intermediate_size": arch.expert_dim,
            "n_group": arch.n_group,
            "n_routed_experts": arch.experts,
            "n_shared_experts": max(1, arch.shared_dim // arch.expert_dim),
            "norm_topk_prob": True,
            "num_key_value_heads": arch.heads,
            "num_nextn_predict_layers": 0,
            "q_lora_rank": arch.q_lora,
            "qk_nope_head_dim": arch.qk_nope,
            "qk_rope_head_dim": arch.qk_rope,
            "rms_norm_eps": 1e-6,
            "rope_interleave": True,
            "routed_scaling_factor": arch.scaling,
            "topk_group": arch.topk_group,
            "topk_method": "noaux_tc",
            "v_head_dim": arch.v_dim,
        }
    raise ValueError(f"sample runs support mixtral, qwen2_moe and deepseek_v3, not {arch.family!r}")


# --- the model as leaf tensors -------------------------------------------------------------------


@dataclass
class Model:
    spec: ModelSpec
    config: dict[str, Any]
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]

    def tensors(self) -> list[torch.Tensor]:
        return [self.embed, self.final_norm, self.lm_head] + [t for lw in self.layers for t in lw.tensors()]

    def selection_biases(self) -> dict[int, torch.Tensor]:
        """DeepSeek-V3's per-expert selection bias by layer: a control input, not trained."""
        return {lw.layer: lw.params["router_bias"] for lw in self.layers if "router_bias" in lw.params}

    def component(self, name: str) -> list[torch.Tensor]:
        """The tensors of one freezable component (see :data:`COMPONENTS`)."""
        if name in ("embed", "lm_head"):
            return [getattr(self, name)]
        if name == "norms":
            return [self.final_norm] + _named(self.layers, _NORMS)
        if name == "attention":
            return _named(self.layers, _ATTN)
        if name == "router":
            return _named(self.layers, ("router",))
        if name == "shared":
            return _named(self.layers, _SHARED)
        if name == "experts":
            return [t for lw in self.layers for e in lw.experts for t in e.values()]
        raise ValueError(f"unknown component {name!r}; known: {', '.join(COMPONENTS)}")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """On-disk keys (each layout entry's first template) → tensors."""
        layout = self.spec.layout
        out = {layout.globals[n][0]: getattr(self, n) for n in ("embed", "final_norm", "lm_head")}
        for lw in self.layers:
            for name, t in lw.params.items():
                out[layout.layer[name][0].format(layer=lw.layer)] = t
            for e, weights in enumerate(lw.experts):
                for name, t in weights.items():
                    out[layout.expert[name][0].format(layer=lw.layer, expert=e)] = t
        return out


def _named(layers: list[LayerWeights], names: tuple[str, ...]) -> list[torch.Tensor]:
    return [lw.params[n] for lw in layers for n in names if n in lw.params]


# The order in which a layer's tensors are drawn from the seeded generator (and listed): fixed,
# so a sample run's weights do not depend on how a family's layout orders its names.
_DRAW_ORDER = (
    "input_norm",
    "post_norm",
    "q_a",
    "q_a_norm",
    "q_b",
    "kv_a",
    "kv_a_norm",
    "kv_b",
    "q",
    "k",
    "v",
    "o",
    "mlp_w1",
    "mlp_w3",
    "mlp_w2",
    "router",
    "router_bias",
    "q_bias",
    "k_bias",
    "v_bias",
    "shared_w1",
    "shared_w3",
    "shared_w2",
    "shared_gate",
)


def _layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """The layer's tensors as the checkpoint reader expects them for ``spec``, in draw order."""
    shapes = expected_shapes(spec)
    names = expected_layer_names(spec, layer)
    rank = {n: i for i, n in enumerate(_DRAW_ORDER)}
    return {n: shapes[n] for n in sorted(names, key=lambda n: (rank.get(n, len(rank)), n))}


def init_model(arch: Arch, seed: int) -> Model:
    """transformers-style init: matrices N(0, init_std²), norm gains 1, biases 0."""
    gen = torch.Generator().manual_seed(seed)

    def draw(shape: tuple[int, ...], name: str) -> torch.Tensor:
        if name.endswith("norm"):
            return torch.ones(shape)
        if name.endswith("bias"):
            return torch.zeros(shape)
        return torch.randn(shape, generator=gen) * arch.init_std

    H, V, I = arch.hidden, arch.vocab_size, arch.expert_dim  # noqa: E741 (paper notation)
    config = hf_config(arch)
    embed, lm_head = draw((V, H), "embed"), draw((V, H), "lm_head")
    spec = spec_from_config(config)
    layers = []
    for i in range(arch.layers):
        routed = spec.is_routed(i)
        params = {n: draw(s, n) for n, s in _layer_shapes(spec, i).items()}
        experts = [
            {"w1": draw((I, H), "w1"), "w3": draw((I, H), "w3"), "w2": draw((H, I), "w2")}
            for _ in range(arch.experts if routed else 0)
        ]
        layers.append(LayerWeights(i, routed, params, experts))
    model = Model(spec, config, embed, torch.ones(H), lm_head, layers)
    return _leaf(model)


def load_model(path: str | Path) -> Model:
    """A checkpoint directory (ours or any supported family) as trainable leaf tensors."""
    ckpt = Checkpoint(path)
    layers = [ckpt.layer_weights(i) for i in range(ckpt.spec.num_layers)]
    model = Model(
        ckpt.spec,
        dict(ckpt.config),
        ckpt.read_global("embed"),
        ckpt.read_global("final_norm"),
        ckpt.read_global("lm_head"),
        layers,
    )
    return _leaf(model)


def _leaf(model: Model) -> Model:
    for t in model.tensors():
        t.requires_grad_(True)
    for t in model.selection_biases().values():  # set by the balancer, not by gradients
        t.requires_grad_(False)
    return model


# --- objective -----------------------------------------------------------------------------------


def switch_aux(tap: MoETap, num_experts: int) -> torch.Tensor:
    """Switch Transformer load-balancing loss E·Σ_e f_e·P_e (1 when perfectly balanced).

    f_e = share of the N·K top-k assignments that go to e (no gradient), P_e = mean_t ρ(e|t).
    """
    topk_NK = tap.routing.topk_NK
    f_E = torch.bincount(topk_NK.reshape(-1), minlength=num_experts).float() / topk_NK.numel()
    P_E = tap.routing.probs_NE.mean(0)
    return num_experts * (f_E * P_E).sum()


def forward_loss(
    model: Model,
    tokens_BT: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    loads: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token CE, mean Switch aux loss over routed layers); ``loads`` receives each
    routed layer's top-k assignment counts per expert."""
    spec = model.spec
    x = embed(spec, model.embed, tokens_BT)
    aux = []
    for lw in model.layers:
        x, tap = decoder_layer(spec, lw, x, rope)
        if tap is not None:
            aux.append(switch_aux(tap, spec.num_experts))
            if loads is not None:
                loads[lw.layer] = torch.bincount(tap.routing.topk_NK.reshape(-1), minlength=spec.num_experts)
    nll_BT1, _ = token_nll(spec, model.final_norm, model.lm_head, x, tokens_BT)
    return nll_BT1.mean(), torch.stack(aux).mean()


# --- the loop ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    steps: int  # the global step training ends at
    lr: float
    save_steps: tuple[int, ...]
    mix: Mix = UNIFORM
    batch: int = 16
    seq_len: int = 64
    warmup: int = 50
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of lr at ``steps``
    weight_decay: float = 0.01  # matrices only
    clip: float = 1.0
    aux_coef: float = 0.0
    aux_ramp: bool = False  # scale aux_coef linearly from 0 at the start to 1 at ``steps``
    bias_rate: float = 0.0  # γ of the aux-loss-free balancer b_i ← b_i ± γ (`000` Eq. 2)
    freeze: frozenset[str] = frozenset()
    log_every: int = 10  # metrics.jsonl and trainer_state log_history
    seed: int = 0
    stop_at: int | None = None  # simulate an interruption right after this step

    def lr_at(self, step: int, start: int) -> float:
        warm = min(1.0, (step - start) / self.warmup) if self.warmup else 1.0
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, step / self.steps)))
        return self.lr * warm * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cos)

    def aux_at(self, step: int, start: int) -> float:
        if not self.aux_ramp:
            return self.aux_coef
        return self.aux_coef * (step - start) / max(1, self.steps - start)


@dataclass
class TrainerState:
    """The fields of Hugging Face's ``trainer_state.json`` that a reader looks for."""

    global_step: int = 0
    max_steps: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self, cfg: TrainConfig) -> dict[str, Any]:
        return {
            "best_global_step": None,
            "best_metric": None,
            "best_model_checkpoint": None,
            "epoch": 0.0,
            "eval_steps": None,
            "global_step": self.global_step,
            "is_hyper_param_search": False,
            "is_local_process_zero": True,
            "is_world_process_zero": True,
            "log_history": [h for h in self.log_history if h["step"] <= self.global_step],
            "logging_steps": cfg.log_every,
            "max_steps": self.max_steps,
            "num_input_tokens_seen": self.global_step * cfg.batch * cfg.seq_len,
            "num_train_epochs": 1,
            "save_steps": _save_interval(cfg.save_steps),
            "stateful_callbacks": {},
            "total_flos": 0.0,
            "train_batch_size": cfg.batch,
            "trial_name": None,
            "trial_params": None,
        }

    @classmethod
    def read(cls, checkpoint: Path) -> TrainerState:
        data = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        return cls(int(data["global_step"]), int(data["max_steps"]), list(data["log_history"]))


def _save_interval(steps: tuple[int, ...]) -> int:
    gaps = sorted({b - a for a, b in zip(steps, steps[1:], strict=False)})
    return gaps[0] if gaps else (steps[0] if steps else 0)


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"


def save_checkpoint(model: Model, run_dir: Path, state: TrainerState, cfg: TrainConfig) -> Path:
    """Write ``checkpoint-<step>/`` atomically (``.tmp`` directory, then rename)."""
    final = run_dir / f"checkpoint-{state.global_step}"
    tmp = run_dir / f"checkpoint-{state.global_step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(_dump(model.config), encoding="utf-8")
    write_safetensors(tmp / "model.safetensors", model.state_dict(), {"format": "pt"})
    (tmp / "trainer_state.json").write_text(_dump(state.to_json(cfg)), encoding="utf-8")
    for name in ("config.json", "trainer_state.json"):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def append_event(run_dir: Path, step: int, event: str, note: str, **extra: Any) -> None:
    """One line of ``events.jsonl`` (README.md, "Logging from your training loop")."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "event": event, "note": note, **extra}) + "\n")


@torch.no_grad()
def balance_biases(model: Model, loads: dict[int, torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (`000` Eq. 2): after each step, raise the
    selection bias of every expert loaded below the mean by γ and lower it above the mean."""
    for layer, bias in model.selection_biases().items():
        load = loads[layer].to(bias.dtype)
        bias.add_(rate * torch.sign(load.mean() - load))


def _optimizer(model: Model, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    frozen = {id(t) for name in cfg.freeze for t in model.component(name)}
    frozen |= {id(t) for t in model.selection_biases().values()}
    live = [t for t in model.tensors() if id(t) not in frozen]
    decay = [t for t in live if t.dim() >= 2]
    no_decay = [t for t in live if t.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    return opt, live


def train(
    model: Model,
    run_dir: str | Path,
    cfg: TrainConfig,
    *,
    start_step: int = 0,
    state: TrainerState | None = None,
    name: str = "",
    progress: Progress | None = None,
    probe: Canary | None = None,
) -> TrainerState:
    """Train from ``start_step`` to ``cfg.steps`` (or ``cfg.stop_at``), writing the run dir.

    A fresh optimizer is created (so a resume resets AdamW state, as when ``optimizer.pt`` is
    lost); ``metrics.jsonl`` lines after ``start_step`` from an interrupted attempt are dropped.
    ``probe``: after every checkpoint save, log the gradient norms of this canary's loss
    (``canary_probe.jsonl``). A resumed run does not probe its starting checkpoint again:
    the interrupted process did. The probe reads the weights and writes nothing else, so the
    checkpoints are the same bytes with or without it.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resumed = state is not None
    state = state or TrainerState(start_step, cfg.steps)
    state.max_steps = cfg.steps
    state.log_history = [h for h in state.log_history if h["step"] <= start_step]
    opt, live = _optimizer(model, cfg)
    batches = Batches(cfg.mix, batch=cfg.batch, seq_len=cfg.seq_len, seed=cfg.seed * 100_003 + start_step)
    rope = rope_tables(model.spec, cfg.seq_len)
    logger = ExpertGradLogger(run_dir / "metrics.jsonl", model.layers, every=cfg.log_every, resume_step=start_step)
    last = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    with logger:
        if start_step in cfg.save_steps:
            save_checkpoint(model, run_dir, state, cfg)
            if probe is not None and not resumed:
                probe_canary(model, probe, logger, start_step)
        for step in range(start_step + 1, last + 1):
            _step(model, opt, live, batches.next(), rope, cfg, step, start_step, logger, state)
            if step in cfg.save_steps:
                save_checkpoint(model, run_dir, state, cfg)
                if probe is not None:
                    probe_canary(model, probe, logger, step)
            if progress is not None:
                progress(name, step, cfg.steps)
    return state


def probe_canary(model: Model, canary: Canary, logger: ExpertGradLogger, step: int) -> None:
    """The hook's canary probe: per-expert gradient norms of the canary's mean next-token NLL
    (no auxiliary loss) under the weights just saved."""
    tokens_WT = canary.tokens.long()
    nll, _ = forward_loss(model, tokens_WT, rope_tables(model.spec, tokens_WT.shape[1]))
    logger.probe(step, nll, canary=canary.digest)


def _step(
    model: Model,
    opt: torch.optim.Optimizer,
    live: list[torch.Tensor],
    tokens_BT: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cfg: TrainConfig,
    step: int,
    start: int,
    logger: ExpertGradLogger,
    state: TrainerState,
) -> None:
    lr = cfg.lr_at(step, start)
    for group in opt.param_groups:
        group["lr"] = lr
    for t in model.tensors():
        t.grad = None
    loads: dict[int, torch.Tensor] = {}
    ce, aux = forward_loss(model, tokens_BT, rope, loads)
    coef = cfg.aux_at(step, start)
    loss = ce + coef * aux if coef else ce
    loss.backward()
    logger.log(step, loss, lm_loss=float(ce.detach()), aux_loss=float(aux.detach()), lr=lr)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(live, cfg.clip, foreach=False))
    opt.step()
    if cfg.bias_rate:
        balance_biases(model, loads, cfg.bias_rate)
    state.global_step = step
    if step % cfg.log_every == 0:
        state.log_history.append(
            {
                "epoch": 0.0,
                "grad_norm": grad_norm,
                "learning_rate": lr,
                "loss": float(loss.detach()),
                "step": step,
            }
        )
