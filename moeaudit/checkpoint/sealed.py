"""Checkpoint files read once into private memory: the bytes hashed are the bytes replayed.

docs/security.md, "One read per input". The owner of a checkpoint file can rewrite its pages through a shared ``mmap``
at any moment, and writes into pages already dirty change neither mtime nor ctime, so no metadata
check (``digest.pinned``) can prove that a second read returns what the first one hashed. A
checkpoint was hashed, then read tensor by tensor: one digest was signed once with the honest
router and once with a forged one. Here nothing is ever read twice without proof:

* :func:`seal` reads a file once, front to back, through one pinned descriptor, with ``read(2)``
  into buffers of this process (the kernel copies out of the page cache; nothing is mapped, so
  no other process can reach them), and computes from those very bytes the file's SHA-256 (its
  part of the OpenSSF root digest) and the SHA-256 of every ``BLOCK``-byte block.
* Within a process-wide budget (``limits.PRIVATE_COPY_BYTES``) the bytes themselves are kept:
  every tensor is parsed from that private copy, and the file is read exactly once.
* A file over the budget (docs/glossary.md, "Replay": a replay holds one decoder layer at a time, so checkpoints
  larger than RAM can be audited) keeps only its block digests. A later read of ``[a, b)``
  re-reads the blocks covering it and compares each with the digest the hashed pass recorded:
  the bytes a replay uses are provably bytes that were digested, whether the forward reads a
  layer or the backward (which walks the layers in reverse) reads it again. A block that no
  longer matches is an error naming the file and the byte range, never a receipt.
* Copies are given up least recently used first when a newer file needs the room (a run holds
  all its checkpoints open); a copy given up first gets its block digests, computed from the
  private copy itself, and its later reads take the verified path.

Every read still checks the file's identity (``pinned``), so a file renamed over or rewritten
with new timestamps is named as changed even when its bytes come from the private copy.

A replay on an accelerator sets a :class:`HostPlan` (``replay.hostplan.plan_host_copies``): the
budget sized from the memory the process may take (the host is otherwise idle there), the copies
allocated in pinned memory, and tensor reads served as views of them — the copy the file was
hashed into is the DMA's source, so a weight crosses the host once, when it is hashed.
Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moeaudit import limits
from moeaudit.checkpoint.digest import FileId, changed, pinned

BLOCK = 1 << 16  # a small tensor's read costs at most two blocks (128 KiB) of re-reading
STREAM_CHUNK = 128 * BLOCK  # 8 MiB read at a time when a file is not kept
DIGEST = 32
EDGE_BLOCKS = 8  # verified partial blocks kept per file: neighbouring tensors share their edge


Buffer = bytearray | memoryview  # a private copy: a bytearray, or pinned memory as a byte view


@dataclass
class HostPlan:
    """How private copies are held. ``budget`` None: ``limits.PRIVATE_COPY_BYTES``; ``allocate``
    makes a writable buffer of n bytes; ``alias``: tensor reads are views of the copy (read-only
    by contract: the replay only converts or copies weights, never writes into them)."""

    budget: int | None = None
    allocate: Callable[[int], Buffer] = bytearray
    alias: bool = False
    settle: Callable[[], None] = lambda: None  # before a copy is given up: copies from it are done


PLAN = HostPlan()


class Sealed:
    """One file as it was hashed: identity, SHA-256, block digests or the bytes themselves."""

    def __init__(self, path: Path, fid: FileId, sha256: bytes, blocks: bytes | None, data: Buffer | None):
        assert blocks is not None or data is not None
        self.path, self.fid, self.sha256 = path, fid, sha256
        self.blocks, self.data = blocks, data
        self._edges: OrderedDict[int, bytes] = OrderedDict()  # block index → verified bytes

    @property
    def size(self) -> int:
        return self.fid.size

    def release(self) -> None:
        """Give up the private copy, keeping what proves a later re-read: its block digests."""
        if self.data is not None:
            if self.blocks is None:
                self.blocks = _block_digests(memoryview(self.data))
            PLAN.settle()  # an aliased view may still be the source of a queued device copy
            self.data = None

    def read_into(self, offset: int, buf: bytearray | memoryview) -> int:
        """Fill ``buf`` with the sealed bytes from ``offset``; the count (short at end of file).
        Raises :class:`CheckpointError` if the file is no longer the one sealed."""
        view = memoryview(buf)[: max(0, min(len(buf), self.size - offset))]
        if self.data is not None:
            COPIES.used(self)
            pinned(self.path, self.fid, lambda _fd: None)  # a swapped file is an error all the same
            view[:] = memoryview(self.data)[offset : offset + len(view)]
        else:
            pinned(self.path, self.fid, lambda fd: self._verified(fd, offset, view))
        return len(view)

    def view(self, offset: int, size: int) -> memoryview | None:
        """``size`` sealed bytes from ``offset`` without a copy, where the plan lets reads alias
        the private copy and the copy is held; None otherwise (then :meth:`read_into`)."""
        if not PLAN.alias or self.data is None or offset + size > self.size:
            return None
        COPIES.used(self)
        pinned(self.path, self.fid, lambda _fd: None)  # a swapped file is an error all the same
        return memoryview(self.data)[offset : offset + size]

    def _verified(self, fd: int, offset: int, view: memoryview) -> None:
        """Whole blocks are read straight into ``view``; a partial one at either edge through a
        block-sized buffer. Each block is compared with its digest before anything uses it."""
        end, pos = offset + len(view), offset
        stop = end if end == self.size else end - end % BLOCK  # end of the whole blocks
        while pos < end:
            i = pos // BLOCK
            if pos % BLOCK == 0 and stop > pos:
                _pread_exact(self.path, fd, view[pos - offset : stop - offset], pos)
                for j in range(i, -(-stop // BLOCK)):
                    lo = j * BLOCK
                    self._check(j, view[lo - offset : min(lo + BLOCK, stop) - offset])
                pos = stop
                continue
            lo, hi = i * BLOCK, min(i * BLOCK + BLOCK, self.size)
            block = memoryview(self._edge(fd, i, lo, hi))
            upto = min(hi, end)
            view[pos - offset : upto - offset] = block[pos - lo : upto - lo]
            pos = upto

    def _edge(self, fd: int, i: int, lo: int, hi: int) -> bytes:
        """Block ``i``, verified; the last few are kept (private, already proven), because the
        block at a tensor's end is usually the block at the next tensor's start."""
        if i in self._edges:
            self._edges.move_to_end(i)
            return self._edges[i]
        buf = bytearray(hi - lo)
        _pread_exact(self.path, fd, memoryview(buf), lo)
        self._check(i, memoryview(buf))
        self._edges[i] = bytes(buf)
        if len(self._edges) > EDGE_BLOCKS:
            self._edges.popitem(last=False)
        return self._edges[i]

    def _check(self, i: int, block: memoryview) -> None:
        assert self.blocks is not None
        if hashlib.sha256(block).digest() != self.blocks[i * DIGEST : (i + 1) * DIGEST]:
            lo = i * BLOCK
            raise changed(self.path, f"bytes {lo}..{lo + len(block)} no longer hash to what was digested")


def _pread_exact(path: Path, fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise changed(path, f"it ended at byte {offset + got}, inside what was digested")
        got += n


def _read_exact(fd: int, view: memoryview) -> int:
    """Fill ``view`` from the descriptor's position (short only at end of file)."""
    got = 0
    while got < len(view) and (n := os.readv(fd, [view[got:]])):
        got += n
    return got


def block_digests(sealed: Sealed) -> bytes:
    """The SHA-256 of every ``BLOCK`` of a sealed file (from its private copy when it kept one),
    what another process needs to read the file through the verified path."""
    if sealed.blocks is not None:
        return sealed.blocks
    assert sealed.data is not None
    return _block_digests(memoryview(sealed.data))


def _block_digests(view: memoryview) -> bytes:
    return b"".join(hashlib.sha256(view[i : i + BLOCK]).digest() for i in range(0, len(view), BLOCK))


# Set by an expert-parallel replay (``moeaudit.replay.dist``): a checkpoint's files are hashed
# across its ranks, each file by one; this gives the Sealed a file got there (its digest and
# block digests: a rank reads its own tensors of a file another rank hashed through the
# verified path), or None to seal the file here.
SEAL_HOOK: Callable[[Path, FileId | None], Sealed | None] | None = None


def seal(path: Path, expect: FileId | None = None) -> Sealed:
    """Read ``path`` once (pinned to ``expect``), hash it, and keep it or its block digests."""
    if SEAL_HOOK is not None and (done := SEAL_HOOK(path, expect)) is not None:
        return done
    return seal_here(path, expect)


def seal_here(path: Path, expect: FileId | None = None) -> Sealed:
    """:func:`seal` in this process, whatever ``SEAL_HOOK`` says."""
    fid = expect or pinned(path, None, lambda _fd: None)  # the identity every read is pinned to
    made: list[Sealed] = []

    def io(fd: int) -> None:
        if COPIES.room(fid.size):
            data = PLAN.allocate(fid.size)
            if _read_exact(fd, memoryview(data)) != fid.size:
                raise changed(path, "it ended early while it was hashed")
            made.append(Sealed(path, fid, hashlib.sha256(data).digest(), None, data))
            return
        file_h, blocks, chunk, total = hashlib.sha256(), bytearray(), bytearray(STREAM_CHUNK), 0
        while n := _read_exact(fd, view := memoryview(chunk)):
            file_h.update(view[:n])
            blocks += _block_digests(view[:n])
            total += n
        if total != fid.size:
            raise changed(path, f"its size went from {fid.size} to {total} bytes while it was hashed")
        made.append(Sealed(path, fid, file_h.digest(), bytes(blocks), None))

    pinned(path, fid, io)
    COPIES.hold(made[0])
    return made[0]


class _Copies:
    """The private copies held, least recently used first; their total stays in the budget."""

    def __init__(self) -> None:
        self.held: OrderedDict[int, weakref.ref[Sealed]] = OrderedDict()

    def _live(self) -> list[Sealed]:
        for key, ref in list(self.held.items()):
            s = ref()
            if s is None or s.data is None:
                del self.held[key]
        return [s for ref in self.held.values() if (s := ref()) is not None]

    def room(self, size: int) -> bool:
        """Make room for ``size`` bytes (giving up the oldest copies); False if it cannot fit."""
        budget = limits.PRIVATE_COPY_BYTES if PLAN.budget is None else PLAN.budget
        if size > budget:
            return False
        live = self._live()
        total = sum(s.size for s in live)
        for s in live:
            if total + size <= budget:
                break
            s.release()
            total -= s.size
        return True

    def hold(self, sealed: Sealed) -> None:
        if sealed.data is not None:
            self.held[id(sealed)] = weakref.ref(sealed)

    def used(self, sealed: Sealed) -> None:
        if id(sealed) in self.held:
            self.held.move_to_end(id(sealed))


COPIES = _Copies()
