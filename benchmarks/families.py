"""Replay cost per family against transformers on the same checkpoint (docs/benchmarks.md §1j): one forward +
backward of the canary loss, moeaudit's streaming replay (``replay``: every weight read from
disk, one layer at a time, per-expert gradient norms) against transformers' model (loaded once,
``model(tokens)``, cross-entropy, ``loss.backward()``). Not part of the tests.

    python benchmarks/families.py                 # mixtral (the reference) + the newest families
    python benchmarks/families.py --rounds 5 --families gpt_oss,phimoe

Each model is a random mid-size model of its family (hidden 512, 4 layers, 8 experts, expert
width 1024, vocabulary 8192; each family's own mechanisms switched on as in its oracle test),
saved with ``save_pretrained``. Both contenders run in this process, alternating round by round,
so load hits them alike; transformers' time excludes loading (its model is built once), so the
ratio favours transformers by moeaudit's weight reading. Mixtral, whose replay is the one the
speed benchmark (``run.py --only speed``) measures against a fresh-process transformers script,
is the reference row: a family whose ratio is far above Mixtral's has a slow path of its own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from moeaudit.checkpoint import Checkpoint
from moeaudit.replay import replay

COMMON: dict[str, Any] = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=1024),
    "gpt_oss": dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=1024, head_dim=64, sliding_window=128
    ),
    "llama4_text": dict(
        num_local_experts=8,
        num_experts_per_tok=1,
        intermediate_size=1024,
        intermediate_size_mlp=2048,
        interleave_moe_layer_step=2,
        head_dim=64,
        attention_chunk_size=128,
    ),
    "phimoe": dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=1024, attention_bias=True, lm_head_bias=True
    ),
}


def build(family: str, path: Path) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # O(1) activations: matrices at 1/sqrt(fan-in), as the oracle models
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model.eval()


def transformers_step(model: transformers.PreTrainedModel, tokens: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    logits = model(tokens).logits.float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    args = ap.parse_args()
    tokens = torch.randint(
        0, COMMON["vocab_size"], (args.windows, args.length), generator=torch.Generator().manual_seed(1)
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, transformers {transformers.__version__}; "
        f"canary {args.windows}×{args.length}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = Path(tmp) / family
            model = build(family, path)
            ckpt = Checkpoint(path)
            ours_s, hf_s = [], []
            for r in range(args.rounds):
                order = [
                    ("moeaudit", lambda c=ckpt: replay(c, tokens).nll),
                    ("transformers", lambda m=model: transformers_step(m, tokens)),
                ]
                if r % 2:
                    order.reverse()
                for name, run in order:
                    t0 = time.perf_counter()
                    loss = run()
                    dt = time.perf_counter() - t0
                    (ours_s if name == "moeaudit" else hf_s).append(dt)
                    print(f"  {family:12s} round {r + 1} {name:12s} {dt:6.2f} s  loss {loss:.6f}", flush=True)
            ratios = [a / b for a, b in zip(ours_s, hf_s, strict=True)]
            rows.append((family, statistics.median(ours_s), statistics.median(hf_s), ratios))
    print("\n| family | moeaudit s (median) | transformers s (median) | ratio per round | median ratio |")
    print("|---|---|---|---|---|")
    for family, ours, hf, ratios in rows:
        print(
            f"| {family} | {ours:.2f} | {hf:.2f} | {' / '.join(f'{x:.2f}' for x in ratios)} | "
            f"**{statistics.median(ratios):.2f}** |"
        )


if __name__ == "__main__":
    sys.exit(main())
