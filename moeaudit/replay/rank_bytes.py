"""A rank's share of a checkpoint's bytes in an expert-parallel replay (docs/decisions.md,
"Digest across ranks").

The SHA-256 of a file cannot be split, so one rank reads every byte of each file once. What
the ranks share is everything after that:

* **Who hashes a file**: the rank that needs most of its bytes (its own experts' tensors), so
  that the fewest bytes have to move; files no rank needs more than another (only replicated
  tensors, or every rank's experts alike) go to the least loaded rank, the largest first.
* **What a rank needs** (:func:`plan`): the header of every file, the replicated tensors the
  replay reads (``layer_keys`` of every layer, embeddings, final norm, LM head and their
  biases) and its own experts' tensors — by key where each expert has its own, by the byte
  range of its rows where they are fused [E, …] in a layout the replay slices, whole otherwise
  — with their FP8 block scales. Counted in ``BLOCK``-byte blocks (the unit of the digests).
* **Reading once**: the hashing rank keeps, from the very bytes it hashes, the blocks it needs
  and sends every other rank the blocks that rank needs (point-to-point, in one global order,
  so no two ranks wait on each other); the receiver checks each block against the block
  digest the hasher computed before it keeps it. A rank whose needs exceed the private-copy
  budget (``limits.PRIVATE_COPY_BYTES``) is sent nothing and reads its blocks when the replay
  asks, through the verified path (each block re-hashed and compared).
* **Keeping**: :class:`RankSealed` serves a read from the blocks kept and reads the others
  from disk, verified, and keeps them too — the stored bytes (bf16 stays bf16), so the
  backward reads nothing a forward read, within the budget (least recently used files give up
  their blocks first; then the backward re-reads, verified, what was given up).

So the bytes read from disk over a replay are the checkpoint once, plus, for each rank, the
replicated tensors of files it did not hash when it is over budget. Torch-free except where
blocks cross between ranks (:func:`exchange`).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moeaudit import limits
from moeaudit.checkpoint import sealed as sealed_mod
from moeaudit.checkpoint.digest import FileId, changed, pinned
from moeaudit.checkpoint.sealed import BLOCK, STREAM_CHUNK, Sealed
from moeaudit.replay.shards import experts_of

if TYPE_CHECKING:
    from moeaudit.checkpoint.checkpoint import Checkpoint
    from moeaudit.checkpoint.safetensors import SafetensorsFile

SLICED_FORMATS = ("stacked", "interleaved", "interleaved_rows", "transposed")  # sharded._own_stored
RECEIVED = {"bytes": 0}  # bytes of blocks this process received from other ranks (benchmarks)


# ----- what each rank needs ----------------------------------------------------------------


@dataclass
class Plan:
    """Per file: its size, the blocks each rank needs, and the rank that hashes it."""

    sizes: dict[str, int]
    need: list[dict[str, list[int]]]  # by rank: file → sorted block indices
    owner: dict[str, int] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.need)

    def need_bytes(self, rank: int) -> int:
        return sum(_blocks_bytes(b, self.sizes[f]) for f, b in self.need[rank].items())

    def keeps(self, rank: int) -> bool:
        """Whether ``rank`` is sent (and keeps) its blocks at hashing time: they fit its budget."""
        return self.need_bytes(rank) <= limits.PRIVATE_COPY_BYTES

    def mine(self, rank: int) -> list[str]:
        """The files ``rank`` hashes, in the order it hashes them (largest first)."""
        return sorted((f for f, r in self.owner.items() if r == rank), key=lambda f: (-self.sizes[f], f))


def plan(ckpt: Checkpoint, world: int, files: dict[str, SafetensorsFile]) -> Plan:
    """Every rank computes the same plan from the headers alone."""
    spec = ckpt.spec
    ranges: list[dict[str, list[tuple[int, int]]]] = [{n: [] for n in files} for _ in range(world)]
    everyone: dict[str, list[tuple[int, int]]] = {  # the header: every rank checks it
        n: [(0, min((t.begin for t in f.tensors.values()), default=f.identity.size if f.identity else 0))]
        for n, f in files.items()
    }

    def add(table: dict[str, list[tuple[int, int]]], key: str, lo: int | None = None, hi: int | None = None) -> None:
        name = ckpt.key_file.get(key)
        if name not in files:
            return
        info = files[name].tensors[key]
        if lo is None or hi is None:
            table[name].append((info.begin, info.end))
        else:
            row = (info.end - info.begin) // max(1, info.shape[0])
            table[name].append((info.begin + lo * row, info.begin + hi * row))

    def with_scales(key: str) -> list[str]:
        return [k for k in (key, ckpt.scales.get(key), *ckpt.packed.get(key, ())) if k]

    for name in ("embed", "final_norm", "lm_head", "final_norm_bias", "lm_head_bias"):
        if name in ckpt.layout.globals and (key := ckpt.global_key(name)) is not None:
            for k in with_scales(key):
                add(everyone, k)
    share = experts_of(spec.num_experts, world)
    for layer in range(spec.num_layers):
        for key in ckpt.layer_keys(layer).values():
            for k in with_scales(key):
                add(everyone, k)
        if not spec.is_routed(layer):
            continue
        keys = ckpt.expert_keys(layer)
        if isinstance(keys, list):
            for r, mine in enumerate(share):
                for e in mine:
                    for key in keys[e].values():
                        for k in with_scales(key):
                            add(ranges[r], k)
            continue
        names = list(keys.values())
        sliced = ckpt.fused_format in SLICED_FORMATS and not any(
            k in ckpt.packed or k in ckpt.scales or k not in ckpt.key_file for k in names
        )
        for key in names:
            for r, mine in enumerate(share):
                for k in with_scales(key):
                    add(ranges[r], k, *((mine.start, mine.stop) if sliced else (None, None)))
    sizes = {n: f.identity.size if f.identity else 0 for n, f in files.items()}
    need = [{n: _blocks(ranges[r][n] + everyone[n], sizes[n]) for n in files} for r in range(world)]
    out = Plan(sizes, need)
    out.owner = owners(out)
    return out


def owners(p: Plan) -> dict[str, int]:
    """Which rank hashes each file: of the ranks that need about as much of it as the one that
    needs most (within 1/8, beyond what every rank needs), the least loaded (then the one that
    needs more, then the lowest rank); the largest files first. Deterministic: every rank computes the same table."""
    load = [0] * p.world
    out = {}
    for name in sorted(p.sizes, key=lambda n: (-p.sizes[n], n)):
        common = set.intersection(*(set(p.need[r][name]) for r in range(p.world)))
        own = [_blocks_bytes([b for b in p.need[r][name] if b not in common], p.sizes[name]) for r in range(p.world)]
        near = [k for k in range(p.world) if own[k] * 8 >= max(own) * 7]  # within 1/8 of the most
        r = min(near, key=lambda k: (load[k], -own[k], k))
        out[name] = r
        load[r] += p.sizes[name]
    return out


def _blocks(ranges: list[tuple[int, int]], size: int) -> list[int]:
    got: set[int] = set()
    for lo, hi in ranges:
        hi = min(hi, size)
        if hi > lo:
            got.update(range(lo // BLOCK, (hi - 1) // BLOCK + 1))
    return sorted(got)


def _blocks_bytes(blocks: list[int], size: int) -> int:
    return sum(min(BLOCK, size - b * BLOCK) for b in blocks)


# ----- hashing, keeping what is needed ----------------------------------------------------


def hash_keeping(path: Path, fid: FileId, keep: set[int]) -> tuple[bytes, bytes, dict[int, bytes]]:
    """Read ``path`` once (pinned to ``fid``): its SHA-256, the SHA-256 of every block, and the
    blocks in ``keep``, from the bytes hashed."""
    file_h, digests, kept = hashlib.sha256(), bytearray(), {}

    def io(fd: int) -> None:
        nonlocal digests
        chunk, total = bytearray(STREAM_CHUNK), 0
        while n := sealed_mod._read_exact(fd, view := memoryview(chunk)):
            file_h.update(view[:n])
            for at in range(0, n, BLOCK):
                block = view[at : min(at + BLOCK, n)]
                digests += hashlib.sha256(block).digest()
                if (i := (total + at) // BLOCK) in keep:
                    kept[i] = bytes(block)
            total += n
        if total != fid.size:
            raise changed(path, f"its size went from {fid.size} to {total} bytes while it was hashed")

    pinned(path, fid, io)
    return file_h.digest(), bytes(digests), kept


class RankSealed(Sealed):
    """A file as hashed by some rank: its SHA-256, block digests and the blocks this rank keeps.
    A read is served from the kept blocks; the others are read from disk, each compared with its
    digest, and kept within the budget."""

    def __init__(self, path: Path, fid: FileId, sha256: bytes, blocks: bytes):
        super().__init__(path, fid, sha256, blocks, None)
        self.kept: dict[int, bytes] = {}

    @property
    def kept_bytes(self) -> int:
        return sum(len(b) for b in self.kept.values())

    def check(self, i: int, block: bytes | memoryview) -> None:
        self._check(i, memoryview(block))

    def keep(self, blocks: dict[int, bytes]) -> None:
        """Keep ``blocks`` (already verified) if the budget has room for them."""
        with _LOCK:
            if blocks and KEPT.room(self, sum(len(b) for b in blocks.values())):
                self.kept.update(blocks)

    def release(self) -> None:
        self.kept = {}

    def read_into(self, offset: int, buf: bytearray | memoryview) -> int:
        view = memoryview(buf)[: max(0, min(len(buf), self.size - offset))]
        end = offset + len(view)
        first, last = offset // BLOCK, (end - 1) // BLOCK
        with _LOCK:
            kept = dict(self.kept) if view else {}
            KEPT.used(self)
        read: dict[int, bytes] = {}

        def io(fd: int) -> None:
            i = first
            while view and i <= last:
                if i in kept:
                    i += 1
                    continue
                j = i
                while j <= last and j not in kept:
                    j += 1
                lo, hi = i * BLOCK, min(j * BLOCK, self.size)
                tmp = bytearray(hi - lo)
                sealed_mod._pread_exact(self.path, fd, memoryview(tmp), lo)
                for k in range(i, j):
                    block = bytes(tmp[(k - i) * BLOCK : (k - i + 1) * BLOCK])
                    self.check(k, block)
                    read[k] = block
                i = j

        pinned(self.path, self.fid, io)  # a swapped file is an error even when nothing is read
        for i in range(first, last + 1) if view else ():
            block = kept.get(i) or read[i]
            lo = i * BLOCK
            a, b = max(offset, lo), min(end, lo + len(block))
            view[a - offset : b - offset] = block[a - lo : b - lo]
        self.keep(read)
        return len(view)


class _Kept:
    """The blocks every :class:`RankSealed` of this process keeps, within one budget; least
    recently used files give theirs up first."""

    def __init__(self) -> None:
        self.files: OrderedDict[int, weakref.ref[RankSealed]] = OrderedDict()

    def _live(self) -> list[RankSealed]:
        for key, ref in list(self.files.items()):
            if ref() is None:
                del self.files[key]
        return [s for ref in self.files.values() if (s := ref()) is not None]

    def used(self, s: RankSealed) -> None:
        if id(s) in self.files:
            self.files.move_to_end(id(s))

    def room(self, s: RankSealed, n: int) -> bool:
        budget = limits.PRIVATE_COPY_BYTES
        live = self._live()
        total = sum(x.kept_bytes for x in live)
        for other in live:
            if total + n <= budget:
                break
            if other is not s:
                total -= other.kept_bytes
                other.release()
        if total + n > budget:
            return False
        self.files[id(s)] = weakref.ref(s)
        self.files.move_to_end(id(s))
        return True


KEPT = _Kept()
_LOCK = threading.RLock()  # the prefetch thread reads while the main thread may read too


# ----- the round: hash, send, receive, verify ---------------------------------------------


def seal_files(
    rank: int,
    p: Plan,
    files: dict[str, SafetensorsFile],
    agree: Callable[[BaseException | None], None],
    gather_json: Callable[[object], list[object]],
) -> dict[str, RankSealed]:
    """Every rank: hash its files, exchange the blocks each rank needs, share the digests;
    every file's :class:`RankSealed` on every rank (``agree`` ends all ranks on one failure)."""
    world = p.world
    mine = [p.mine(r) for r in range(world)]
    keeps = [p.keeps(r) for r in range(world)]
    hashed: dict[str, tuple[bytes, bytes, dict[int, bytes]]] = {}
    got: dict[str, dict[int, bytes]] = {}
    for j in range(max(len(m) for m in mine)):
        error: BaseException | None = None
        if j < len(mine[rank]):
            name = mine[rank][j]
            f = files[name]
            assert f.identity is not None
            want = {b for r in range(world) if keeps[r] for b in p.need[r][name]}
            try:
                hashed[name] = hash_keeping(f.path, f.identity, want)
            except Exception as exc:  # noqa: BLE001 - every rank's failure, as one line
                error = exc
        agree(error)
        for src in range(world):  # one global order of (round, sender, receiver): no deadlock
            if j >= len(mine[src]):
                continue
            name = mine[src][j]
            for dst in range(world):
                if dst == src or not keeps[dst] or not p.need[dst][name] or rank not in (src, dst):
                    continue
                blocks = p.need[dst][name]
                if rank == src:
                    _send(b"".join(hashed[name][2][b] for b in blocks), dst)
                else:
                    data = _recv(_blocks_bytes(blocks, p.sizes[name]), src)
                    got[name] = _split(data, blocks, p.sizes[name])
            if rank == src:  # what others needed is sent: keep only this rank's own
                own = set(p.need[rank][name]) if keeps[rank] else set()
                kept = hashed[name][2]
                hashed[name] = (hashed[name][0], hashed[name][1], {b: kept[b] for b in own if b in kept})
    table: dict[str, list[str]] = {}
    reply = {n: [s.hex(), d.hex()] for n, (s, d, _) in hashed.items()}
    for part in gather_json(reply):
        assert isinstance(part, dict)
        table.update(part)
    out: dict[str, RankSealed] = {}
    error = None
    try:
        for name, f in files.items():
            assert f.identity is not None
            sha, digests = (
                (hashed[name][0], hashed[name][1])
                if name in hashed
                else (bytes.fromhex(table[name][0]), bytes.fromhex(table[name][1]))
            )
            s = RankSealed(f.path, f.identity, sha, digests)
            held = hashed[name][2] if name in hashed else got.get(name, {})
            for i, block in held.items():
                s.check(i, block)  # a block sent by another rank hashes to the digest it computed
            s.keep(held)
            out[name] = s
    except Exception as exc:  # noqa: BLE001
        error = exc
    agree(error)
    return out


def _split(data: bytes, blocks: list[int], size: int) -> dict[int, bytes]:
    out, at = {}, 0
    for b in blocks:
        n = min(BLOCK, size - b * BLOCK)
        out[b] = data[at : at + n]
        at += n
    return out


def _send(data: bytes, dst: int) -> None:
    import torch
    import torch.distributed as dist

    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def _recv(n: int, src: int) -> bytes:
    import torch
    import torch.distributed as dist

    buf = torch.empty(n, dtype=torch.uint8)
    dist.recv(buf, src)
    RECEIVED["bytes"] += n
    return bytes(buf.numpy().tobytes())


__all__ = ["KEPT", "RECEIVED", "Plan", "RankSealed", "hash_keeping", "owners", "plan", "seal_files"]
