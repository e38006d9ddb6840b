"""The routed experts' W1/W3 products kept from the forward for the backward, within a memory
budget (docs/decisions.md, "The experts' W1/W3 products kept for the backward (`replay.stash`)").

The backward of a SwiGLU expert needs its two input products a1 = W1 y and a3 = W3 y. The
layer-local replay (docs/glossary.md, "Replay") recomputes each layer from its stored input, so by default it forms
them twice: 2 of the 11 expert-sized matrix products per routed (token, slot), 12 % of the
replay's arithmetic on the speed benchmark (docs/benchmarks.md). Keeping them costs
N·k·I·2 floats per routed layer (117 MB a layer at 4096 tokens, top-2, I = 1792; 2.1 GB a
DeepSeek-V3 layer at 16k tokens), held from the layer's forward to its backward.

So they are kept for as many layers as fit a budget, in forward order, and formed again for the
others. The numbers do not depend on it: the kept products are the ones the forward formed from
the same gathered rows with the same weights, the products the backward would form again (tests
assert identical receipts with and without), so only time and memory change.

The budget: ``MOEAUDIT_ACTIVATION_BUDGET`` (bytes, or with a unit: ``2GB``, ``512MiB``; ``0``
keeps nothing, ``inf`` everything). By default on the host, as much as the stored layer inputs
take (so the kept products at most double the activations the replay holds anyway, and the
default does not follow the machine's free memory), and no more than a quarter of the memory the
process may still take when the replay starts (the smallest of the machine's available memory,
the cgroup's limit less its use and ``RLIMIT_DATA`` less the data segment; Linux, elsewhere 0
and nothing kept) less what the replay will hold anyway (its stored layer inputs, the LM head).
On an accelerator nothing is kept by default (recomputing is cheap there and its memory holds
the stored inputs, ``replay.offload``)."""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path

import torch

from moeaudit.replay.device import Device, prepare_device
from moeaudit.replay.offload import parse_budget
from moeaudit.spec.config import ModelSpec

ENV = "MOEAUDIT_ACTIVATION_BUDGET"
DEFAULT_SHARE = 0.25  # of the memory the process may still take, on the host

Kept = dict[int, tuple[torch.Tensor, torch.Tensor]]  # expert → (W1 y, W3 y) of its rows


def _meminfo_available() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return 0.0


def _cgroup_headroom() -> float:
    root = Path("/sys/fs/cgroup")
    limit = (root / "memory.max").read_text().strip() if (root / "memory.max").exists() else "max"
    if limit == "max":
        return math.inf
    return max(0.0, float(limit) - float((root / "memory.current").read_text()))


def _rlimit_headroom() -> float:
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    if soft == resource.RLIM_INFINITY:
        return math.inf
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return max(0.0, soft - float(line.split()[1]) * 1024)
    return 0.0


def host_headroom() -> float:
    """Bytes this process may still allocate on the host (0 where it cannot be read)."""
    try:
        return min(_meminfo_available(), _cgroup_headroom(), _rlimit_headroom())
    except (OSError, ValueError):
        return 0.0


def activation_budget(device: Device, reserved: float = 0.0, cap: float = math.inf) -> float:
    """Bytes of kept expert products the replay may hold (``math.inf``: no limit). By default
    ``cap`` (the stored layer inputs' bytes, :func:`default_budget`), and at most a quarter of
    the host headroom left once ``reserved`` bytes (what the replay will hold anyway: its stored
    layer inputs, the LM head) are set aside."""
    if os.environ.get(ENV):
        return parse_budget(os.environ[ENV], ENV)
    dev = prepare_device(device)
    if dev is not None and dev.type != "cpu":
        return 0.0
    return min(cap, DEFAULT_SHARE * max(0.0, host_headroom() - reserved))


def default_budget(device: Device, spec: ModelSpec, tokens: int, dtype: torch.dtype) -> float:
    """:func:`activation_budget` of a replay of ``tokens`` canary tokens: what the environment
    says, else the stored layer inputs' bytes within a quarter of the host headroom."""
    return activation_budget(device, reserved_bytes(spec, tokens, dtype), stored_input_bytes(spec, tokens, dtype))


def stored_input_bytes(spec: ModelSpec, tokens: int, dtype: torch.dtype) -> float:
    """Every layer's stored input of a replay of ``tokens`` canary tokens, in the compute dtype."""
    size = torch.finfo(dtype).bits // 8
    streams = 1 if spec.hc is None else spec.hc.streams  # HY-V4: a layer's input is its residual streams
    return float(spec.num_layers * tokens * streams * spec.hidden_size * size)


def reserved_bytes(spec: ModelSpec, tokens: int, dtype: torch.dtype) -> float:
    """What a replay of ``tokens`` canary tokens holds whatever the budget: every layer's stored
    input and the LM head, in the compute dtype."""
    size = torch.finfo(dtype).bits // 8
    return stored_input_bytes(spec, tokens, dtype) + float(spec.vocab_size * spec.hidden_size * size)


def keepable(spec: ModelSpec) -> bool:
    """Whether the family's routed experts are plain SwiGLU (the products the backward reuses)."""
    return spec.clamped_glu is None and not spec.moe.scaled_inputs and spec.mlp_act == "swiglu"


class ExpertStash:
    """Which routed layers keep their experts' products, decided layer by layer in the forward
    while the budget lasts; what each layer kept, until its backward takes it."""

    def __init__(self, spec: ModelSpec, tokens: int, budget: float, dtype: torch.dtype):
        self.per_layer = tokens * spec.top_k * spec.expert_dim * 2 * torch.finfo(dtype).bits // 8
        self.budget = budget if keepable(spec) else 0.0
        # Step 3.5: layers whose experts clamp their SwiGLU (``spec.expert_glu``) keep nothing
        self._clamped = {i for i, limit in enumerate(spec.expert_glu_limits) if limit}
        self.used = 0
        self._kept: dict[int, Kept] = {}

    def offer(self, layer: int) -> Kept | None:
        """A place for layer ``layer``'s products if the budget still has room, else None."""
        if layer in self._clamped:
            return None
        if self.used + self.per_layer > self.budget:
            return None
        self.used += self.per_layer
        self._kept[layer] = {}
        return self._kept[layer]

    def take(self, layer: int) -> Kept | None:
        """Layer ``layer``'s products (then no longer held here), or None if it kept none."""
        kept = self._kept.pop(layer, None)
        if kept is not None:
            self.used -= self.per_layer
        return kept

    @property
    def layers(self) -> list[int]:
        return sorted(self._kept)
