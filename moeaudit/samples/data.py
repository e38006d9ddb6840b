"""Deterministic synthetic multi-domain text for the sample runs.

Four domains with clearly different statistics, so that experts have something to
specialise on and a canary can show per-domain routing:

* ``arithmetic`` — digit-heavy equations: ``12+7=19; 6*7=42;``
* ``code`` — a toy programming language: keywords, braces, indentation, ``=`` and ``;``
* ``prose`` — templated lowercase English sentences
* ``records`` — uppercase key-value records: ``id=4821|name=KARA|age=37|city=OSLO``

Text is mapped to ids by a fixed character-level tokenizer (:data:`VOCAB`, 97 ids): id 0 is
``<pad>`` (never produced by the generators), id 1 is ``"\\n"``, ids 2..96 are the printable
ASCII characters ``" "`` (32) to ``"~"`` (126) in code-point order.

Randomness comes only from seeded ``numpy.random.Generator`` objects created here — never
from global RNG state — so the same seed gives the same tokens on every machine.

Shape suffixes: B windows in a batch, T tokens per window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

PAD = "<pad>"
VOCAB: tuple[str, ...] = (PAD, "\n", *(chr(c) for c in range(32, 127)))
VOCAB_SIZE = len(VOCAB)  # 97
_ID = {ch: i for i, ch in enumerate(VOCAB) if i > 0}

DOMAINS: tuple[str, ...] = ("arithmetic", "code", "prose", "records")


def encode(text: str) -> np.ndarray:
    """Character-level ids (int32); characters outside the vocabulary are an error."""
    try:
        return np.fromiter((_ID[ch] for ch in text), dtype=np.int32, count=len(text))
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the sample vocabulary") from None


def decode(ids: np.ndarray | torch.Tensor | list[int]) -> str:
    return "".join(VOCAB[int(i)] if int(i) > 0 else "\u2400" for i in ids)


# --- the four generators (one document each) -------------------------------------------------

Gen = np.random.Generator


def _pick(rng: Gen, words: tuple[str, ...]) -> str:
    return words[int(rng.integers(len(words)))]


def arithmetic_doc(rng: Gen) -> str:
    """A line of 3-7 correct equations on 0..99."""
    eqs = []
    for _ in range(int(rng.integers(3, 8))):
        a, b = (int(v) for v in rng.integers(0, 100, size=2))
        op = _pick(rng, ("+", "-", "*"))
        res = a + b if op == "+" else a - b if op == "-" else a * b
        eqs.append(f"{a}{op}{b}={res};")
    return " ".join(eqs) + "\n"


_FN = ("add", "mul", "step", "scan", "fold", "loop", "calc", "walk")
_VARS = ("x", "y", "z", "n", "acc", "i", "k")
_CMP = ("<", ">", "==", "!=")
_OPS = ("+", "-", "*")


def code_doc(rng: Gen) -> str:
    """A small function in a toy C-like language."""
    name = f"{_pick(rng, _FN)}{int(rng.integers(10))}"
    arg = _pick(rng, _VARS)
    lines = [f"fn {name}({arg}) {{"]
    names = [arg]
    for _ in range(int(rng.integers(2, 5))):
        kind = int(rng.integers(3))
        src = _pick(rng, tuple(names))
        lit = int(rng.integers(1, 10))
        if kind == 0:
            dst = _pick(rng, _VARS)
            lines.append(f"  let {dst} = {src} {_pick(rng, _OPS)} {lit};")
            names.append(dst)
        elif kind == 1:
            lines.append(f"  if {src} {_pick(rng, _CMP)} {lit} {{ return {src}; }}")
        else:
            lines.append(f"  while {src} > {lit} {{ {src} = {src} - 1; }}")
    lines.append(f"  return {_pick(rng, tuple(names))};")
    lines.append("}")
    return "\n".join(lines) + "\n"


_DET = ("the", "a", "one", "every")
_ADJ = ("old", "small", "quiet", "green", "tired", "bright", "cold", "young")
_NOUN = ("fisherman", "girl", "river", "city", "garden", "horse", "teacher", "ship", "forest")
_VERB = ("walked", "looked", "waited", "sang", "slept", "turned", "listened", "rested")
_ADV = ("slowly", "quietly", "again", "alone", "early", "happily")
_PREP = ("near", "under", "behind", "across", "beside", "toward")


def prose_doc(rng: Gen) -> str:
    """A paragraph of 2-4 templated sentences."""
    sentences = []
    for _ in range(int(rng.integers(2, 5))):
        subject = f"{_pick(rng, _DET)} {_pick(rng, _ADJ)} {_pick(rng, _NOUN)}"
        place = f"the {_pick(rng, _ADJ)} {_pick(rng, _NOUN)}"
        sentences.append(f"{subject} {_pick(rng, _VERB)} {_pick(rng, _ADV)} {_pick(rng, _PREP)} {place}.")
    return " ".join(sentences) + "\n"


_NAMES = ("KARA", "OMAR", "LENA", "IVAN", "SUKI", "MILO", "NORA", "TOBI", "ZANE", "ELSA")
_CITIES = ("OSLO", "LIMA", "ROME", "KIEV", "BERN", "DOHA", "RIGA", "BAKU")


def records_doc(rng: Gen) -> str:
    """One pipe-separated key-value record."""
    fields = [
        f"id={int(rng.integers(1000, 10000))}",
        f"name={_pick(rng, _NAMES)}",
        f"age={int(rng.integers(18, 90))}",
        f"city={_pick(rng, _CITIES)}",
        f"score={int(rng.integers(0, 100)) / 100:.2f}",
    ]
    return "|".join(fields) + "\n"


GENERATORS: dict[str, Callable[[Gen], str]] = {
    "arithmetic": arithmetic_doc,
    "code": code_doc,
    "prose": prose_doc,
    "records": records_doc,
}

# Train and canary streams come from disjoint seed streams (held-out draws, same grammar).
_SPLITS = {"train": 0, "canary": 1}


def domain_stream(domain: str, n_tokens: int, *, seed: int, split: str = "train") -> np.ndarray:
    """At least ``n_tokens`` ids of consecutive documents of one domain (int32)."""
    index = DOMAINS.index(domain)
    rng = np.random.default_rng([seed, _SPLITS[split], index])
    parts, total = [], 0
    while total < n_tokens:
        doc = encode(GENERATORS[domain](rng))
        parts.append(doc)
        total += len(doc)
    return np.concatenate(parts)


def canary_windows(per_domain: int, seq_len: int, *, seed: int) -> list[tuple[str, list[int]]]:
    """Held-out windows, ``per_domain`` per domain, as (domain, token ids) in domain order."""
    out = []
    for domain in DOMAINS:
        stream = domain_stream(domain, per_domain * seq_len, seed=seed, split="canary")
        for w in range(per_domain):
            out.append((domain, stream[w * seq_len : (w + 1) * seq_len].tolist()))
    return out


@dataclass(frozen=True)
class Mix:
    """Domain sampling weights (normalised on use)."""

    weights: Mapping[str, float]

    def probabilities(self) -> np.ndarray:
        w = np.array([float(self.weights.get(d, 0.0)) for d in DOMAINS], dtype=np.float64)
        if w.sum() <= 0:
            raise ValueError("a domain mix needs a positive weight")
        return w / w.sum()


UNIFORM = Mix({d: 1.0 for d in DOMAINS})


class Batches:
    """An endless, seeded sampler of ``[B, T]`` training windows from a domain mix.

    Each window picks a domain by the mix, then a random offset into that domain's
    pre-generated training stream.
    """

    def __init__(
        self,
        mix: Mix,
        *,
        batch: int,
        seq_len: int,
        seed: int,
        stream_tokens: int = 200_000,
        data_seed: int = 0,
    ):
        self.batch, self.seq_len = batch, seq_len
        self.p = mix.probabilities()
        self.streams = [domain_stream(d, stream_tokens, seed=data_seed) for d in DOMAINS]
        self.rng = np.random.default_rng([seed, 7])

    def next(self) -> torch.Tensor:
        """int64 tokens_BT."""
        domains_B = self.rng.choice(len(DOMAINS), size=self.batch, p=self.p)
        rows = []
        for d in domains_B:
            stream = self.streams[int(d)]
            start = int(self.rng.integers(0, len(stream) - self.seq_len))
            rows.append(stream[start : start + self.seq_len])
        return torch.from_numpy(np.stack(rows).astype(np.int64))
