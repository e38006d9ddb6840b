"""Generation receipts (`004`: stability-induced entropy collapse).

Greedy continuation of G tokens from P prompts (the first 16 tokens of the first P canary
windows): proportion of generated tokens among the 10% most frequent canary tokens
("high-frequency proportion"), distinct-2, and rep-4 (fraction of 4-grams repeating an
earlier 4-gram of the same sequence). Opt-in: G extra streamed forwards.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moeaudit.canary import Canary
from moeaudit.checkpoint import Checkpoint
from moeaudit.replay.device import Device
from moeaudit.replay.engine import greedy_generate

PROMPT_LEN = 16


def high_frequency_ids(tokens: torch.Tensor, fraction: float = 0.1) -> set[int]:
    ids, counts = torch.unique(tokens.reshape(-1), return_counts=True)
    order = sorted(zip(counts.tolist(), ids.tolist()), key=lambda c: (-c[0], c[1]))
    keep = max(1, math.ceil(fraction * len(order)))
    return {i for _, i in order[:keep]}


def distinct_n(seqs: list[list[int]], n: int) -> float:
    grams = [tuple(s[i : i + n]) for s in seqs for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def rep_n(seq: list[int], n: int) -> float:
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(seq) - n + 1):
        gram = tuple(seq[i : i + n])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else float("nan")


def generation_receipts(
    ckpt: Checkpoint, canary: Canary, new_tokens: int, prompts: int = 8, device: Device = None
) -> dict[str, Any]:
    """The generation receipts; the greedy continuation runs on ``device``."""
    P = min(prompts, canary.num_windows)
    prompt_len = min(PROMPT_LEN, canary.window_len)
    generated = greedy_generate(ckpt, canary.tokens[:P, :prompt_len], new_tokens, device=device).tolist()
    frequent = high_frequency_ids(canary.tokens)
    flat = [t for s in generated for t in s]
    reps = [rep_n(s, 4) for s in generated]
    reps = [r for r in reps if not math.isnan(r)]
    return {
        "prompts": P,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "high_frequency_proportion": sum(t in frequent for t in flat) / len(flat) if flat else float("nan"),
        "distinct_2": distinct_n(generated, 2),
        "rep_4": sum(reps) / len(reps) if reps else float("nan"),
    }
