"""One rank of tests/test_sharded.py: ``python sharded_worker.py OUT CANARY CKPT...`` with RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set (what torchrun gives a rank). Rank 0 replays
every checkpoint across the ranks and writes OUT (JSON: per checkpoint the root digest, each
routed layer's top-k sets and per-expert gradient norms, the receipts document); the other ranks
serve (``moeaudit.replay.worker``); every rank writes OUT.bytes.RANK: [checkpoint bytes it read
from disk, bytes it received from other ranks]. :func:`audit` is also the single-process
reference."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeaudit.replay import dist, worker  # noqa: E402


def audit(ckpts: list[str], canary_path: str) -> dict[str, Any]:
    """What the test compares, for each checkpoint, by whatever session this process is in."""
    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.policy import Policy
    from moeaudit.receipts.observer import StateObserver
    from moeaudit.receipts.state import receipts_document
    from moeaudit.replay import replay
    from moeaudit.replay.model import MoETap

    probe = canary_mod.load(canary_path)
    policy = Policy()
    out: dict[str, Any] = {}
    for path in ckpts:
        ckpt = Checkpoint(path)
        digest = ckpt.digest
        observer = StateObserver(ckpt.spec, probe, policy.receipts)
        topk: dict[int, list[list[int]]] = {}

        def keep(tap: MoETap, _lw: Any, topk: dict[int, list[list[int]]] = topk) -> None:
            topk[tap.layer] = tap.routing.topk_NK.tolist()

        result = replay(ckpt, probe.tokens, observers=[observer, keep])
        out[Path(path).name] = {
            "digest": digest,
            "topk": {str(i): t for i, t in sorted(topk.items())},
            "routing": {str(i): r.topk_NK.tolist() for i, r in sorted(result.routing.items())},
            "expert_norms": {str(i): g.experts_E.tolist() for i, g in sorted(result.grads.items())},
            "receipts": receipts_document(ckpt, probe, result, observer, policy),
        }
        ckpt.verify_unchanged()
    return out


def count_reads() -> dict[str, int]:
    """Count the checkpoint bytes this process reads from disk (``checkpoint.sealed``'s two read
    paths: the hashing pass and every verified re-read)."""
    from moeaudit.checkpoint import sealed

    count = {"bytes": 0}
    pread, read = sealed._pread_exact, sealed._read_exact

    def counted_pread(path: Path, fd: int, view: memoryview, offset: int) -> None:
        count["bytes"] += len(view)
        pread(path, fd, view, offset)

    def counted_read(fd: int, view: memoryview) -> int:
        n = read(fd, view)
        count["bytes"] += n
        return n

    sealed._pread_exact, sealed._read_exact = counted_pread, counted_read  # type: ignore[assignment]
    return count


def _write(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def main(out: Path, canary_path: str, ckpts: list[str]) -> None:
    from moeaudit.replay import rank_bytes

    count = count_reads()
    if budget := os.environ.get("MOEAUDIT_TEST_PRIVATE_COPY_BYTES"):  # every rank: a smaller budget
        from moeaudit import limits

        limits.PRIVATE_COPY_BYTES = int(budget)
    rank = dist.env_world()[0]
    if rank > 0:  # serves until rank 0 stops
        code = worker.serve()
        _write(out.with_name(f"{out.name}.bytes.{rank}"), [count["bytes"], rank_bytes.RECEIVED["bytes"]])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    with dist.session():
        got = audit(ckpts, canary_path)
    _write(out.with_name(f"{out.name}.bytes.0"), [count["bytes"], rank_bytes.RECEIVED["bytes"]])
    _write(out, got)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no C++ static destructors racing gloo's threads (tests/dist_worker.py)
