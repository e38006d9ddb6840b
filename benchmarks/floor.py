"""The floor: a bare forward + backward of moeaudit's own replay, no receipts (no observers).
Run as a fresh process: ``python floor.py CKPT CANARY [--overlap]``.

``--overlap`` adds the one computation the receipts need beyond a training step's forward and
backward: the outputs of the K' − k next candidate experts and one random expert per token and
MoE layer (`003` Eq. 21–22, Table 2), evaluated in the same sweep over the experts as
the receipts evaluate them, with no statistics computed from them. receipts ÷ (floor
--overlap) is then what the receipts' statistics, copies and bookkeeping cost."""

from __future__ import annotations

import sys

import moeaudit.cli  # noqa: F401  (first: the process settings the CLI makes before torch loads)
from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.receipts.overlap import extra_experts
from moeaudit.replay import replay
from moeaudit.replay.model import MoETap, Routing


class OverlapExperts:
    """An observer that asks for the overlap receipts' extra experts and keeps nothing."""

    def extra_experts(self, layer: int, routing: Routing) -> dict:
        return extra_experts(routing, layer)

    def __call__(self, tap: MoETap, lw: object) -> None:
        pass


def main(ckpt: str, canary: str, *flags: str) -> None:
    observers = (OverlapExperts(),) if "--overlap" in flags else ()
    result = replay(Checkpoint(ckpt), canary_mod.load(canary).tokens, observers=observers)
    print(result.nll, float(next(iter(result.grads.values())).experts_E.sum()))
    print(f"kept W1/W3 products of layers {result.kept_layers}")


if __name__ == "__main__":
    main(*sys.argv[1:])
