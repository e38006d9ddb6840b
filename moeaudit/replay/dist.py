"""The ranks of an expert-parallel replay (docs/decisions.md, "Expert-parallel replay"): process group, requests,
failures, digest.

Rank 0 runs the command (``receipts``, ``compare``, ``certify``, ``gate``) as one process would:
it reads the inputs, keeps the cache and writes every file. The other ranks only serve
(``replay.worker``): each waits for rank 0's next request and takes its part in it —

* ``seal``: hash a checkpoint's weight files across the ranks, each file by one rank (the one
  that needs most of it, balanced by load), read once with its SHA-256 and block digests
  computed from the bytes read. The hashing rank sends every other rank the 64 KiB blocks that
  rank replays (its experts, the replicated tensors), which the receiver checks against the
  block digests and keeps (``replay.rank_bytes``), so the checkpoint is read from disk once in
  all. Every rank gets every file's digest and block digests: the root digest is assembled from
  the digests the ranks computed (the same model-signing digest one process computes), and a
  block a rank did not keep is read through the verified path (re-hashed and compared), so the
  bytes a rank replays are bytes that were digested;
* ``replay``: one forward + backward, sharded (``replay.sharded``);
* ``stop``: leave.

Launch: ``moeaudit receipts CKPT --nproc 4`` starts ranks 1–3 as child processes (the
environment ``torchrun`` would give them; gloo on 127.0.0.1), or ``torchrun --nproc-per-node 4
-m moeaudit receipts CKPT`` starts four copies of the command, of which ranks ≥ 1 serve.

Failures: every step of a replay that reads (a layer's weights, the head) ends with the ranks
agreeing on success (one all-reduce of a flag); a rank whose step failed sends its one-line
error and every rank raises it, so rank 0 prints one line and writes nothing (its outputs are
written by temp file and rename). A rank that dies leaves the others' collectives failing
(gloo: the connection closes) or timing out (``MOEAUDIT_DIST_TIMEOUT``, seconds); rank 0 then
names the rank that exited, stops the ranks it started, and exits with one line.

Requests and replies are JSON and raw tensors, never pickles (``torch.distributed``'s object
collectives unpickle what a peer sends). Importing this module does not import torch.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit.errors import InputError, MoeauditError

if TYPE_CHECKING:
    import torch

    from moeaudit.checkpoint.checkpoint import Checkpoint
    from moeaudit.checkpoint.digest import FileId
    from moeaudit.checkpoint.sealed import Sealed

TIMEOUT_ENV = "MOEAUDIT_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600
VERBOSE_ENV = "MOEAUDIT_DIST_VERBOSE"  # ranks started by --nproc keep their stderr


class RankFailed(MoeauditError):
    """A rank of the expert-parallel replay failed; every rank raises it with the same line."""


@dataclass
class Session:
    rank: int
    world: int
    backend: str
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    in_sync: bool = True  # False while a request runs: a failure then leaves peers mid-collective
    used: bool = False
    sealed: dict[Path, dict[Path, Sealed]] = field(default_factory=dict)  # dir → file → sealed
    opened: dict[Path, Checkpoint] = field(default_factory=dict)  # a serving rank's checkpoints
    devices: list[str] = field(default_factory=list)  # each rank's compute device, by rank

    # ----- control plane: JSON and bytes over CPU tensors (gloo) ---------------------------

    def bcast_json(self, obj: Any = None) -> Any:
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        return json.loads(self.bcast_bytes(data).decode())

    def bcast_bytes(self, data: bytes) -> bytes:
        import torch
        import torch.distributed as dist

        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, 0)
        buf = _bytes_tensor(data) if self.rank == 0 else torch.empty(int(n), dtype=torch.uint8)
        if int(n):
            dist.broadcast(buf, 0)
        return bytes(buf.numpy().tobytes())

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, by rank, on every rank."""
        import torch
        import torch.distributed as dist

        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        top = max(int(s) for s in sizes)
        if top == 0:
            return [b""] * self.world
        buf = torch.zeros(top, dtype=torch.uint8)
        buf[: len(data)] = _bytes_tensor(data)
        bufs = [torch.empty(top, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(bufs, buf)
        return [bytes(b[: int(s)].numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]

    def agree(self, error: BaseException | None) -> None:
        """Every rank says whether its step succeeded; if one failed, every rank raises the
        failure of the lowest such rank (one line, the same on all)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag):
            return
        line = "" if error is None else _one_line(error)
        lines = [b.decode() for b in self.gather_bytes(line.encode())]
        first = next(r for r, text in enumerate(lines) if text)
        self.in_sync = True  # every rank leaves the request here, together
        raise RankFailed(f"rank {first} of {self.world}: {lines[first]}")

    # ----- requests ------------------------------------------------------------------------

    def request(self, op: str, **args: Any) -> None:
        """Rank 0: tell the serving ranks what to do next."""
        assert self.rank == 0
        self.used = True
        self.in_sync = False
        self.bcast_json({"op": op, **args})

    def done(self) -> None:
        self.in_sync = True

    # ----- hashing -------------------------------------------------------------------------

    def seal_round(self, directory: Path) -> dict[Path, Sealed]:
        """Hash ``directory``'s safetensors files across the ranks (every rank calls this);
        {path: Sealed} of every file, on every rank (``replay.rank_bytes``: each file hashed by
        the rank that needs most of it, the blocks each rank needs sent to it from the bytes
        hashed and kept there)."""
        from moeaudit.checkpoint.checkpoint import Checkpoint
        from moeaudit.checkpoint.safetensors import SafetensorsFile
        from moeaudit.replay import rank_bytes

        error: BaseException | None = None
        files: dict[str, SafetensorsFile] = {}
        plan: rank_bytes.Plan | None = None
        try:
            ckpt = self.opened.get(directory) or Checkpoint(directory)  # headers only
            if self.rank:
                self.opened[directory] = ckpt
            files = {n: f for n, f in sorted(ckpt.files.items()) if isinstance(f, SafetensorsFile)}
            plan = rank_bytes.plan(ckpt, self.world, files)
        except Exception as exc:  # noqa: BLE001 - any failure is every rank's, as one line
            error = exc
        self.agree(error)
        assert plan is not None
        got = rank_bytes.seal_files(self.rank, plan, files, self.agree, self.gather_json)
        out: dict[Path, Sealed] = {absolute(files[n].path): s for n, s in got.items()}
        self.sealed[directory] = out
        return out

    def gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank, on every rank."""
        return [json.loads(p.decode()) for p in self.gather_bytes(json.dumps(obj).encode())]

    def ensure_sealed(self, directory: Path) -> dict[Path, Sealed]:
        """Rank 0: the files of ``directory`` hashed across the ranks (once per directory)."""
        if directory not in self.sealed:
            self.request("seal", dir=str(directory))  # absolute: the ranks share the file system
            self.seal_round(directory)
            self.done()
        return self.sealed[directory]

    def hook(self, path: Path, _expect: FileId | None) -> Sealed | None:
        """``sealed.SEAL_HOOK``: a checkpoint file's Sealed from the ranks' round."""
        path = absolute(path)
        directory = path.parent
        if self.rank == 0 and directory not in self.sealed:
            if not self.in_sync:  # inside a request: the round must have run before it
                return None
            self.ensure_sealed(directory)
        return self.sealed.get(directory, {}).get(path)


def absolute(path: Path) -> Path:
    """``path`` made absolute without resolving links (the ranks' key for a file or directory)."""
    return Path(os.path.abspath(path))


def _bytes_tensor(data: bytes) -> torch.Tensor:
    import torch

    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def out_of_memory(exc: BaseException) -> str | None:
    """A one-line account of an allocation that failed (Python's MemoryError, torch's CPU
    allocator), or None for any other error."""
    text = str(exc)
    if not (
        isinstance(exc, MemoryError)
        or (isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "Cannot allocate memory" in text))
    ):
        return None
    size = re.search(r"tried to allocate (\d+) bytes", text)
    what = f" ({int(size[1]) / 2**20:.0f} MiB more)" if size else ""
    return f"out of memory{what}: the process reached its memory limit or the machine's"


def _one_line(exc: BaseException) -> str:
    from moeaudit.errors import short_line

    if (oom := out_of_memory(exc)) is not None:
        return oom
    if isinstance(exc, RankFailed):
        return exc.what
    if isinstance(exc, MoeauditError):
        return short_line(exc.diagnostics())
    return short_line(f"{type(exc).__name__}: {exc}")


# ----- the session of this process -----------------------------------------------------------

_SESSION: Session | None = None


def active() -> Session | None:
    """The expert-parallel session this process is rank 0 of, when there is one."""
    return _SESSION if _SESSION is not None and _SESSION.rank == 0 else None


def env_world() -> tuple[int, int]:
    """(rank, world size) that torchrun (or --nproc) gave this process; (0, 1) when none."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as exc:
        raise InputError("RANK and WORLD_SIZE must be integers (torchrun sets them)") from exc


def _timeout() -> Any:
    import datetime

    try:
        seconds = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError as exc:
        raise InputError(f"${TIMEOUT_ENV} must be a number of seconds") from exc
    return datetime.timedelta(seconds=seconds)


def _backend() -> str:
    """gloo for the CPU; with CUDA, NCCL for CUDA tensors and gloo for the control plane."""
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _init(rank: int, world: int) -> Session:
    import torch.distributed as dist

    if not dist.is_available():
        raise InputError(
            "torch.distributed is not available in this torch build",
            hint="install a torch with distributed support, or drop --nproc",
        )
    backend = _backend()
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=_timeout())
    s = Session(rank, world, backend)
    from moeaudit.checkpoint import sealed

    sealed.SEAL_HOOK = s.hook
    return s


def join(rank: int, world: int) -> Session:
    """A serving rank's session (``replay.worker``): the process group joined, as this process's."""
    global _SESSION
    _SESSION = _init(rank, world)
    return _SESSION


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(nproc: int) -> list[subprocess.Popen[bytes]]:
    """Ranks 1 … nproc − 1 as child processes, with the environment torchrun gives its ranks."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "OMP_NUM_THREADS": threads,
    }
    os.environ.update({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}, RANK="0", LOCAL_RANK="0")
    quiet = not os.environ.get(VERBOSE_ENV)
    return [
        subprocess.Popen(
            [sys.executable, "-m", "moeaudit.replay.worker"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL if quiet else None,
        )
        for r in range(1, nproc)
    ]


@contextmanager
def session(nproc: int | None = None) -> Iterator[Session | None]:
    """Rank 0's session for the duration of a command: ``nproc`` > 1 starts the other ranks;
    otherwise a world size > 1 in the environment (torchrun) joins theirs; else no session."""
    global _SESSION
    if _SESSION is not None:
        yield _SESSION
        return
    rank, world = env_world()
    spawned = nproc is not None and nproc > 1
    if spawned:
        assert nproc is not None
        if world > 1:
            raise InputError(
                "--nproc inside a torchrun launch: torchrun already started the ranks",
                hint="drop --nproc, or run without torchrun",
            )
        rank, world = 0, nproc
        children = _spawn(nproc)
    elif world <= 1:
        yield None
        return
    else:
        children = []
    if rank != 0:
        raise InputError(f"rank {rank} runs the serving loop, not a command (internal)")
    import torch

    if spawned:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        _SESSION = _init(0, world)
    except BaseException:
        _stop_children(children, kill=True)
        raise
    _SESSION.children = children
    ok = False
    try:
        yield _SESSION
        ok = True
    except Exception as exc:
        if is_comm_error(exc):  # a collective failed: a rank is gone
            raise _lost(_SESSION, exc) from exc
        raise
    finally:
        _close(_SESSION, clean=ok or _SESSION.in_sync)
        _SESSION = None


def is_comm_error(exc: BaseException) -> bool:
    """A failed collective (a peer closed its connection, or the timeout passed)."""
    import torch.distributed as dist

    return isinstance(exc, getattr(dist, "DistError", ())) or (
        isinstance(exc, RuntimeError) and any(w in str(exc) for w in ("Gloo", "gloo", "Connection closed", "NCCL"))
    )


def lost(exc: BaseException) -> MoeauditError:
    """The one-line error for a collective that failed on rank 0 (a peer exited or timed out)."""
    s = _SESSION
    assert s is not None
    return _lost(s, exc)


def _lost(s: Session, exc: BaseException) -> MoeauditError:
    s.in_sync = False
    time.sleep(0.2)  # a child that died has usually been reaped by now
    gone = [(r, p.poll()) for r, p in enumerate(s.children, start=1) if p.poll() is not None]
    who = "; ".join(f"rank {r} exited with code {code}" for r, code in gone) or "a rank stopped answering"
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    detail = re.sub(r"^\[[^\]]*\] ", "", first).split(". ")[0][:160]  # gloo: "[file.cc:537] Read error …"
    return RankFailed(
        f"expert-parallel replay of {s.world} ranks failed: {who} ({detail})",
        hint="nothing was written; rerun (with MOEAUDIT_DIST_VERBOSE=1 to see every rank's stderr)",
    )


def _close(s: Session, clean: bool) -> None:
    import torch.distributed as dist

    from moeaudit.checkpoint import sealed

    sealed.SEAL_HOOK = None
    if clean:
        try:
            s.bcast_json({"op": "stop"})
            dist.barrier()
        except RuntimeError:
            clean = False
    _stop_children(s.children, kill=not clean)
    if clean:
        dist.destroy_process_group()
    global _USED
    _USED = True


def _stop_children(children: list[subprocess.Popen[bytes]], kill: bool) -> None:
    for p in children:
        if kill and p.poll() is None:
            p.kill()
    for p in children:
        try:
            p.wait(timeout=None if kill else 60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


_USED = False


def used() -> bool:
    """Whether this process ran a session (it then leaves by ``os._exit``: gloo's threads race
    C++ static destructors at interpreter exit, SIGABRT about one run in three)."""
    return _USED
