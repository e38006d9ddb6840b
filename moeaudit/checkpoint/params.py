"""Parameter counts of a checkpoint, from its headers alone (no tensor is read).

``total`` is every value stored as a weight: the elements of each tensor the checkpoint's
safetensors headers (or DCP metadata) list, an MXFP4 tensor as its values (two per packed byte),
FP8 block scales and MXFP4 scales not counted (they scale values, they are not values).

``active`` is the parameters one token uses, in expectation over the routing the checkpoint's
config declares: every parameter outside the routed experts (embeddings, attention, norms,
routers, dense MLPs, shared experts, the LM head) plus ``top_k / num_experts`` of the routed
experts' parameters (their matrices and biases), layer by layer. A family with zero-computation
experts (LongCat-Flash) counts them in ``num_experts``: a token sent to one uses no weights.
The count is static — it reads the config's ``top_k``, not how the audited canary was routed —
so it is the number a model card gives (Mixtral 8x7B: 47B total, 13B active). Docs:
docs/compliance.md, "Measured quantities".
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeaudit.checkpoint.checkpoint import Checkpoint

# per-layer canonical names of routed-expert tensors stored outside the expert templates
# (gpt-oss's fused expert biases, spec/layouts.py)
ROUTED_LAYER_NAMES = frozenset({"gate_up_bias", "down_bias"})
SHARED_PREFIX = "shared_"  # shared_w1/w3/w2 and shared_gate (spec/layouts.py)


def parameter_counts(ckpt: Checkpoint) -> dict[str, Any]:
    """``total``, ``active``, ``routed_experts`` and ``shared_experts`` (element counts) of one
    checkpoint, and the routing they were computed with."""
    packed_parts = {k for pair in ckpt.packed.values() for k in pair}
    scales = set(ckpt.scales.values())

    def numel(key: str) -> int:
        if key in ckpt.packed:  # an MXFP4 weight: two values per packed byte
            return 2 * math.prod(ckpt.info(ckpt.packed[key][0]).shape)
        return math.prod(ckpt.info(key).shape) if key in ckpt.key_file else 0

    stored = [k for k in ckpt.key_file if k not in packed_parts and k not in scales]
    total = sum(numel(k) for k in stored) + sum(numel(k) for k in ckpt.packed)
    s = ckpt.spec
    routed = shared = 0
    for layer in s.routed_layers:
        found = ckpt.expert_keys(layer)
        keys = set(found.values()) if isinstance(found, dict) else {k for e in found for k in e.values()}
        named = ckpt.layer_keys(layer)
        keys |= {k for n, k in named.items() if n in ROUTED_LAYER_NAMES}
        routed += sum(numel(k) for k in keys)
        shared += sum(numel(k) for n, k in named.items() if n.startswith(SHARED_PREFIX))
    share = Fraction(s.top_k, s.num_experts) if s.num_experts else Fraction(0)
    active = total - routed + routed * share
    return {
        "total": total,
        "active": round(active),
        "routed_experts": routed,
        "shared_experts": shared,
        "top_k": s.top_k,
        "num_experts": s.num_experts,
    }


__all__ = ["parameter_counts"]
