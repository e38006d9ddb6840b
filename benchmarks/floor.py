"""The floor: a bare forward + backward of moeaudit's own replay, no receipts (no observers).
Run as a fresh process: ``python floor.py CKPT CANARY``."""

from __future__ import annotations

import sys

import moeaudit.cli  # noqa: F401  (first: the process settings the CLI makes before torch loads)
from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.replay import replay


def main(ckpt: str, canary: str) -> None:
    result = replay(Checkpoint(ckpt), canary_mod.load(canary).tokens, observers=())
    print(result.nll, float(next(iter(result.grads.values())).experts_E.sum()))


if __name__ == "__main__":
    main(*sys.argv[1:])
