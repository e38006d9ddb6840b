"""The training callback's cost per step (docs/benchmarks.md §7), paired step by step in one process.

    python benchmarks/callback_overhead.py --sizes small mid --steps 50 --rounds 3

One real transformers ``Trainer`` run per size and round, with ``MoeauditCallback`` enabled on
every other optimizer step (A B A B …): an "on" step runs the callback's whole per-step work
(loss and routing hooks, the fused norm pass, the metrics line, the online envelope rules, the
tracker scalars); an "off" step runs none of it (its hooks are paused). Both arms share the
process, the threads, ``OMP_WAIT_POLICY``, the model's state and the machine's load at that
moment, which on a shared machine moves by 2-4× within a minute — so whole-run A/B timings
are not comparable there, adjacent steps are. A step is timed from one ``on_step_begin`` to
the next (forward, backward, clipping, callback, optimizer, the Trainer's logging every
``--logging-steps``, odd so that its cost falls on both arms alike).

Per size and round: the median step time of each arm and their ratio, the median of the
ratios of adjacent (off, on) pairs, and the median time spent inside the callback's
``on_pre_optimizer_step`` on an "on" step (the norm pass, the line, the online rules — short
enough to be timed directly even on a busy machine; the hooks' cost is not in it); at the end
min / median / max over rounds. ``--every``
is the metrics interval (a step that is not due costs nothing but the hooks).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from moeaudit.integrations.transformers import MoeauditCallback

SIZES = {  # mixtral layout, top-2
    "tiny": dict(
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=3,
        vocab_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    ),
    "small": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        vocab_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
    ),
    "mid": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        vocab_size=2048,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
    ),
    "large": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        vocab_size=8192,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
    ),
}
BATCH, SEQ = 8, 64


class Paired(transformers.TrainerCallback):  # type: ignore[misc]
    """Runs ``inner`` on even optimizer steps only and times every step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.stamps: list[tuple[int, float]] = []
        self.inside: list[float] = []  # seconds inside the callback's per-step work

    def _on(self, state: Any) -> bool:
        return (state.global_step + 1) % 2 == 0

    def _pause(self, paused: bool) -> None:
        recorder = self.inner.recorder
        recorder.meter.paused = paused
        if getattr(recorder, "routing", None) is not None:
            recorder.routing.paused = paused

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.inner.on_train_begin(args, state, control, **kw)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.stamps.append((state.global_step + 1, time.perf_counter()))
        self._pause(not self._on(state))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._on(state):
            start = time.perf_counter()
            self.inner.on_pre_optimizer_step(args, state, control, **kw)
            self.inside.append(time.perf_counter() - start)

    def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step % 2 == 0 and hasattr(self.inner, "on_log"):
            self.inner.on_log(args, state, control, **kw)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.stamps.append((state.global_step + 1, time.perf_counter()))
        self.inner.on_train_end(args, state, control, **kw)

    def times(self, warmup: int) -> tuple[list[float], list[float], list[float]]:
        """(off step times, on step times, adjacent on/off ratios) after ``warmup`` steps."""
        steps = [(s, b - a) for (s, a), (_, b) in zip(self.stamps, self.stamps[1:])][warmup:]
        off = [t for s, t in steps if s % 2]
        on = [t for s, t in steps if not s % 2]
        pairs = [b / a for (s, a), (_, b) in zip(steps, steps[1:]) if s % 2]
        return off, on, pairs


def _q10(xs: list[float]) -> float:
    """The 10% quantile: on a shared machine the load only ever adds time, so the quickest
    steps of each arm are the least disturbed."""
    return sorted(xs)[len(xs) // 10]


def model_of(size: str) -> transformers.PreTrainedModel:
    config = transformers.MixtralConfig(num_experts_per_tok=2, max_position_embeddings=SEQ, **SIZES[size])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def run(
    base: torch.nn.Module, data: list, steps: int, warmup: int, every: int, logging_steps: int, out: Path
) -> tuple[list[float], list[float], list[float], list[float]]:
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=warmup + 2 * steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=logging_steps,
        save_strategy="no",
        train_sampling_strategy="sequential",
    )
    paired = Paired(MoeauditCallback(every=every))
    trainer = transformers.Trainer(model=copy.deepcopy(base), args=args, train_dataset=data, callbacks=[paired])
    trainer.remove_callback(transformers.PrinterCallback)  # the logs, printed: not timed here
    trainer.callback_handler.callbacks.remove(paired)
    trainer.callback_handler.callbacks.insert(0, paired)  # what attach() does
    trainer.train()
    return (*paired.times(warmup), paired.inside[warmup // 2 :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "mid"], choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=50, help="steps of each arm per round")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--logging-steps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--arm",
        choices=["on", "off"],
        help="one arm only, as a whole process (for a paired whole-process A/B with a "
        "process timer): train --steps steps with the callback on every step or none",
    )
    a = ap.parse_args()
    if a.arm:
        single_arm(a)
        return
    transformers.logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load {os.getloadavg()}",
        flush=True,
    )
    results: dict[str, dict] = {}
    for size in a.sizes:
        base = model_of(size)
        tokens = torch.randint(
            0,
            SIZES[size]["vocab_size"],
            ((a.warmup + 2 * a.steps) * BATCH, SEQ),
            generator=torch.Generator().manual_seed(0),
        )
        data = [{"input_ids": row, "labels": row} for row in tokens]
        rounds = []
        for r in range(a.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                off, on, pairs, inside = run(base, data, a.steps, a.warmup, a.every, a.logging_steps, Path(tmp))
            row = {
                "off_ms": statistics.median(off) * 1e3,
                "on_ms": statistics.median(on) * 1e3,
                "pair_ratio": statistics.median(pairs),
                "load": os.getloadavg()[0],
                "inside_ms": statistics.median(inside) * 1e3,
                "q10_ratio": _q10(on) / _q10(off),
                "q10_off_ms": _q10(off) * 1e3,
            }
            row["inside_share"] = row["inside_ms"] / row["q10_off_ms"]
            row["ratio"] = row["on_ms"] / row["off_ms"]
            rounds.append(row)
            print(
                f"{size} round {r + 1}: off {row['off_ms']:.1f} ms, on {row['on_ms']:.1f} ms (medians "
                f"of {len(off)} / {len(on)} steps), ratio {row['ratio']:.3f}, median pair ratio "
                f"{row['pair_ratio']:.3f}, 10%-quantile ratio {row['q10_ratio']:.3f}, inside the callback "
                f"{row['inside_ms']:.2f} ms = {100 * row['inside_share']:.2f} % of the 10%-quantile off step "
                f"({row['q10_off_ms']:.1f} ms), load {row['load']:.2f}",
                flush=True,
            )
        params = sum(p.numel() for p in base.parameters())
        results[size] = {"parameters": params, "rounds": rounds}
        for key in ("ratio", "pair_ratio", "q10_ratio", "inside_ms", "inside_share"):
            xs = [row[key] for row in rounds]
            print(
                f"{size} ({params / 1e6:.2f} M parameters, {BATCH}x{SEQ} tokens a step) {key}: "
                f"min {min(xs):.3f} median {statistics.median(xs):.3f} max {max(xs):.3f}"
            )
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


def single_arm(a: argparse.Namespace) -> None:
    (size,) = a.sizes
    transformers.logging.set_verbosity_error()
    base = model_of(size)
    tokens = torch.randint(
        0, SIZES[size]["vocab_size"], ((a.warmup + a.steps) * BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=a.warmup + a.steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=a.logging_steps,
        save_strategy="no",
        train_sampling_strategy="sequential",
    )
    trainer = transformers.Trainer(model=base, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in tokens])
    trainer.remove_callback(transformers.PrinterCallback)
    if a.arm == "on":
        callback = MoeauditCallback(every=a.every)
        trainer.add_callback(callback)
        if hasattr(callback, "attach"):
            callback.attach(trainer)
    trainer.train()


if __name__ == "__main__":
    main()
