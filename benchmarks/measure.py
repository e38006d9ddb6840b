"""In-process timing of one receipts replay, for the scaling table: prints one JSON line.
``python measure.py CKPT CANARY`` (a fresh process per point, like a user's run)."""

from __future__ import annotations

import json
import sys
import time

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.receipts.state import state_receipts


def main(ckpt: str, canary: str) -> None:
    probe, checkpoint = canary_mod.load(canary), Checkpoint(ckpt)
    _ = checkpoint.digest  # hashing the files is part of a run but not of the replay
    start = time.perf_counter()
    state_receipts(checkpoint, probe)
    print(json.dumps({"replay_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main(*sys.argv[1:])
