"""What a certificate signs about the model's size and the audit's own compute (torch-free).

``parameters`` counts the weights of the last audited checkpoint from its headers
(:mod:`moeaudit.checkpoint.params`); ``compute`` sums what the replay behind each receipt used,
as :func:`moeaudit.receipts.compute.metered` counted it, naming the receipt. A receipt taken
from the cache carries the cost of the replay that made it (cached beside it), so a cached
certify signs the same numbers; ``from_cache`` says which those are. Docs: docs/compliance.md,
"Measured quantities".
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

from moeaudit.checkpoint.params import parameter_counts
from moeaudit.records import ComputeRecord, ParameterCount, ReplayCompute

COUNTED_BY = (
    "torch.utils.flop_counter.FlopCounterMode around each replay: matrix products, convolutions "
    "and attention kernels of the forward, the backward and its recomputation, and the receipts' "
    "own products, from the shapes that ran (routed experts: the tokens routed to them); "
    "elementwise work and recurrent scans not counted"
)
ENERGY_BY = "NVML total-energy counter of the replay's GPU, read before and after each replay (whole device)"


class Measured(TypedDict):
    parameters: ParameterCount
    compute: ComputeRecord


def measured(ckpt: Any, replays: list[dict[str, Any]]) -> Measured:
    """The predicate's ``parameters`` and ``compute`` fields."""
    parameters = cast(ParameterCount, {"checkpoint": ckpt.path.name, **parameter_counts(ckpt)})
    energies = [r.get("energy_joules") for r in replays]
    compute: ComputeRecord = {
        "flops": sum(int(r["flops"]) for r in replays) if replays else None,
        "counted_by": COUNTED_BY,
        "energy_joules": sum(e for e in energies if e is not None) if replays and None not in energies else None,
        "energy_by": ENERGY_BY,
        "replays": cast(list[ReplayCompute], replays),
    }
    if compute["energy_joules"] is None:
        reasons = [str(r.get("energy_reason")) for r in replays if r.get("energy_joules") is None]
        none_ran = "not measured: no replay's cost is known (receipts cached before it was recorded)"
        compute["energy_reason"] = reasons[0] if reasons else none_ran
    return {"parameters": parameters, "compute": compute}


__all__ = ["COUNTED_BY", "ENERGY_BY", "Measured", "measured"]
