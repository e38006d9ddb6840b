"""A serving rank of an expert-parallel replay (ranks ≥ 1, ``replay.dist``): it waits for rank
0's next request and takes its part in it — ``seal`` (hash the checkpoint's files across the
ranks), ``replay`` (``replay.sharded``), ``stop``. ``python -m moeaudit.replay.worker`` is what
``--nproc`` starts; ranks ≥ 1 of a ``torchrun ... -m moeaudit CMD`` launch come here too."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from moeaudit.replay.dist import VERBOSE_ENV, RankFailed, Session, env_world, join
from moeaudit.replay.sharded import serve_replay


def serve() -> int:
    """A serving rank: answer rank 0's requests until it says stop. 0 when it did, 4 when the
    group broke (rank 0 reports why: this rank prints nothing)."""
    rank, world = env_world()
    verbose = bool(os.environ.get(VERBOSE_ENV))
    try:
        s = join(rank, world)
        while True:
            req = s.bcast_json()
            if req["op"] == "stop":
                break
            try:
                _answer(s, req)
            except RankFailed:  # every rank raised it together; rank 0 reports it
                continue
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as exc:  # noqa: BLE001 - a serving rank never prints a second error line
        if verbose:
            import traceback

            traceback.print_exc()
        del exc
        return 4


def _answer(s: Session, req: dict[str, Any]) -> None:
    if req["op"] == "seal":
        s.seal_round(Path(req["dir"]))
        return
    if req["op"] == "replay":
        directory = Path(req["dir"])
        if directory not in s.sealed:
            raise RuntimeError(f"replay of {directory} before its files were hashed")
        serve_replay(s, s.opened[directory], req)
        return
    raise RuntimeError(f"unknown request {req['op']!r}")


def main() -> None:
    """Serve, then leave without running C++ static destructors (gloo's threads race them at
    interpreter exit, ``dist.used``)."""
    code = serve()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
