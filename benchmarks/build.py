"""Benchmark inputs, built from a seed: mixtral-layout checkpoints and canaries.

The checkpoint writer streams: it writes the safetensors header first (offsets are known from
the shapes), then generates each tensor's values in row chunks and appends their bytes, so a
4 GB checkpoint is built with a few tens of MB of memory. Values are seeded Gaussian draws
scaled like a trained model's (matrices ~ 1/sqrt(fan_in), gains near 1), so routing is
decisive and activations stay O(1); they are not a trained model's, and no receipt number
from them means anything beyond timing.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moeaudit import canary as canary_mod

CHUNK_ELEMENTS = 1 << 22  # rows are generated in chunks of at most this many values
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


@dataclass(frozen=True)
class Arch:
    """A mixtral-layout model size."""

    vocab: int = 32000
    hidden: int = 512
    layers: int = 4
    experts: int = 16
    top_k: int = 2
    inter: int = 1792  # expert intermediate size (Mixtral's 14336/4096 = 3.5 × hidden)
    heads: int = 8
    kv_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self, dtype: torch.dtype) -> dict:
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.inter,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "max_position_embeddings": 4096,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "router_aux_loss_coef": 0.02,
            "output_router_logits": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "dtype": str(dtype).removeprefix("torch."),
        }

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], str]]:
        """(name, shape, kind) in file order; kind is "matrix", "gain" or "embed"."""
        H, I, D = self.hidden, self.inter, self.head_dim  # noqa: E741 (the paper's names)
        yield "model.embed_tokens.weight", (self.vocab, H), "embed"
        for i in range(self.layers):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", (H,), "gain"
            yield f"{p}.post_attention_layernorm.weight", (H,), "gain"
            yield f"{p}.self_attn.q_proj.weight", (self.heads * D, H), "matrix"
            yield f"{p}.self_attn.k_proj.weight", (self.kv_heads * D, H), "matrix"
            yield f"{p}.self_attn.v_proj.weight", (self.kv_heads * D, H), "matrix"
            yield f"{p}.self_attn.o_proj.weight", (H, self.heads * D), "matrix"
            yield f"{p}.block_sparse_moe.gate.weight", (self.experts, H), "matrix"
            for e in range(self.experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                yield f"{q}.w1.weight", (I, H), "matrix"
                yield f"{q}.w3.weight", (I, H), "matrix"
                yield f"{q}.w2.weight", (H, I), "matrix"
        yield "model.norm.weight", (H,), "gain"
        yield "lm_head.weight", (self.vocab, H), "matrix"

    def parameters(self) -> int:
        return sum(math.prod(s) for _, s, _ in self.tensors())


def _values(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> Iterator[torch.Tensor]:
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, rows, step):
        x = torch.randn(min(step, rows - r), cols, generator=gen)
        if kind == "matrix":
            x /= math.sqrt(cols)
        elif kind == "gain":
            x = 1.0 + 0.1 * x
        yield x


def write_checkpoint(out: Path, arch: Arch, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> int:
    """Write ``out/config.json`` + ``out/model.safetensors`` tensor by tensor; return bytes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(arch.config(dtype), indent=2))
    size = torch.tensor([], dtype=dtype).element_size()
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    specs = list(arch.tensors())
    for name, shape, _ in specs:
        n = math.prod(shape) * size
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte aligned data section, as safetensors writes it
    tmp = out / ".model.safetensors.partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for index, (_name, shape, kind) in enumerate(specs):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
            for chunk in _values(shape, kind, gen):
                f.write(chunk.to(dtype).view(torch.int16 if size == 2 else torch.int32).numpy().tobytes())
    tmp.rename(out / "model.safetensors")
    return 8 + len(raw) + offset


def write_canary(
    path: Path,
    vocab: int,
    windows: int,
    length: int,
    *,
    seed: int = 1,
    domains: tuple[str, ...] = ("code", "math", "prose", "dialog"),
) -> canary_mod.Canary:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (windows, length), generator=gen, dtype=torch.int64).int()
    ids = (torch.arange(windows) % len(domains)).int()
    probe = canary_mod.Canary(tokens, ids, domains)
    canary_mod.save(probe, path)
    return probe


def describe(arch: Arch) -> dict:
    return {**asdict(arch), "parameters": arch.parameters()}
