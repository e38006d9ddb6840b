"""The digest signed is the digest of the bytes replayed, with a hostile writer
(docs/security.md, "One read per input").

The owner of a checkpoint file rewrites a router weight through a shared mapping (``mmap``
``MAP_SHARED``) in a second process, toggling one byte between its honest and a forged value
for as long as the audits run. Writes into a page that is already dirty move no timestamp, so
nothing about the file's metadata changes: only reading each file once, into private memory,
and replaying what was hashed keeps the receipts those of the digest. Every audit here must
either fail closed (the checkpoint named as changed, nothing cached) or produce receipts whose
(digest, NLL) is (honest, honest) or (forged, forged) — checked on every run, so the test does
not depend on winning a race, only on the writer toggling throughout (which it checks).

``RACY_NS`` is set to 0, as for a checkpoint written long before the audit (the attack's
setting): the end-of-run re-hash of just-written files would otherwise often fail closed.
Both reading paths run: the private copy (a small checkpoint, the default budget) and the
streamed one (budget 0, as for a checkpoint larger than ``PRIVATE_COPY_BYTES``), where every
re-read block is proven against the digests of the hashed pass.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import make_bad_inputs as corpus
import pytest

from moeaudit import canary as canary_mod
from moeaudit import limits
from moeaudit.cache import ReceiptsCache
from moeaudit.certify import audit_run
from moeaudit.checkpoint import Checkpoint
from moeaudit.checkpoint import digest as digest_mod
from moeaudit.checkpoint.safetensors import SafetensorsFile
from moeaudit.errors import CheckpointError
from moeaudit.policy import load_policy
from moeaudit.receipts.state import state_receipts

WEIGHTS = "model.safetensors"
SECONDS = 1.5  # audits per reading path, at least MIN_RUNS of them
MIN_RUNS = 4

# The second process: map the file shared, make the page dirty, then toggle one byte.
WRITER = """
import mmap, os, random, sys, time
path, offset, honest, forged = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
m[offset] = forged
print("ready", flush=True)
while True:
    m[offset] = honest
    time.sleep(random.random() * 0.002)
    m[offset] = forged
    time.sleep(random.random() * 0.002)
"""


@dataclass(frozen=True)
class Truth:
    """The checkpoint directory under attack, and the receipts of each of its two states."""

    root: Path
    ckpt: Path  # root/run/checkpoint-1
    offset: int  # the router byte the writer toggles
    honest: int
    forged: int
    nll: dict[str, float]  # root digest → NLL of those bytes


def _forgeable_byte(path: Path) -> tuple[int, int, int]:
    """(offset, honest, forged) of the high byte of the largest router weight whose exponent
    bit 2 is clear: flipping it multiplies that weight by 16 and moves the routing."""
    info = SafetensorsFile(path).tensors[corpus.ROUTER]
    raw = path.read_bytes()[info.begin : info.end]
    best: tuple[float, int] = (0.0, -1)
    for i in range(0, len(raw), 4):
        (w,) = struct.unpack("<f", raw[i : i + 4])
        if not raw[i + 3] & 0x02 and abs(w) > best[0]:
            best = (abs(w), i)
    assert best[1] >= 0
    at = info.begin + best[1] + 3
    return at, raw[best[1] + 3], raw[best[1] + 3] ^ 0x02


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> Truth:
    root = tmp_path_factory.mktemp("digest_replay")
    ckpt = corpus.save_checkpoint(root / "run" / "checkpoint-1", corpus.tensors())
    corpus.write_canaries(root, root / "canaries")
    (root / "fast.toml").write_text("[receipts]\nbootstrap = 0\n")
    offset, honest, forged = _forgeable_byte(ckpt / WEIGHTS)
    forged_dir = Path(shutil.copytree(ckpt, root / "forged"))
    with open(forged_dir / WEIGHTS, "r+b") as f:
        f.seek(offset)
        f.write(bytes([forged]))
    probe, policy = canary_mod.load(root / "canary.safetensors"), load_policy(root / "fast.toml")
    nll = {}
    for d in (ckpt, forged_dir):
        doc = state_receipts(Checkpoint(d), probe, policy)
        nll[doc["checkpoint"]["digest"]["sha256"]] = doc["nll"]
    (_, na), (_, nb) = nll.items()  # two digests, two NLLs far apart
    assert abs(na - nb) > 1e-4 * abs(na), "the forged byte must change the receipts"
    return Truth(root, ckpt, offset, honest, forged, nll)


def _writer(truth: Truth) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WRITER,
            str(truth.ckpt / WEIGHTS),
            str(truth.offset),
            str(truth.honest),
            str(truth.forged),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _toggling(truth: Truth) -> bool:
    """Both values seen through this process's own reads within a second."""
    seen, fd, until = set(), os.open(truth.ckpt / WEIGHTS, os.O_RDONLY), time.monotonic() + 1.0
    try:
        while len(seen) < 2 and time.monotonic() < until:
            seen.add(os.pread(fd, 1, truth.offset)[0])
            time.sleep(0.0005)
    finally:
        os.close(fd)
    return seen == {truth.honest, truth.forged}


def _consistent(truth: Truth, digest: str, nll: float, where: str) -> None:
    assert digest in truth.nll, f"{where}: a digest of neither state ({digest})"
    assert math.isclose(nll, truth.nll[digest], rel_tol=1e-9, abs_tol=1e-12), (
        f"{where}: NLL {nll} signed under the digest of bytes whose NLL is {truth.nll[digest]}"
    )


def _cached_receipts(root: Path) -> list[dict[str, Any]]:
    docs = []
    for p in root.rglob("*.json"):
        doc = json.loads(p.read_text())["document"]
        if doc.get("schema") == "moeaudit.receipts/v1":
            docs.append(doc)
    return docs


def _fails_closed(exc: CheckpointError, truth: Truth) -> None:
    assert "changed while it was being audited" in exc.what, exc.what
    assert str(exc.path).startswith(str(truth.ckpt)), exc.path


@pytest.mark.parametrize("budget", [None, 0], ids=["private-copy", "streamed"])
def test_concurrent_shared_mapping_writer_never_forges_receipts(
    truth: Truth, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    monkeypatch.setattr(digest_mod, "RACY_NS", 0)
    if budget is not None:
        monkeypatch.setattr(limits, "PRIVATE_COPY_BYTES", budget)
    probe = canary_mod.load(truth.root / "canary.safetensors")
    policy = load_policy(truth.root / "fast.toml")
    writer = _writer(truth)
    outcomes: dict[str, int] = {"receipts": 0, "certificates": 0, "failed closed": 0}
    try:
        assert _toggling(truth), "the writer must toggle the byte while the audits run"
        start, runs = time.monotonic(), 0
        while runs < MIN_RUNS or time.monotonic() - start < SECONDS:
            runs += 1
            try:
                doc = state_receipts(Checkpoint(truth.ckpt), probe, policy)
                _consistent(truth, doc["checkpoint"]["digest"]["sha256"], doc["nll"], "receipts")
                outcomes["receipts"] += 1
            except CheckpointError as exc:
                _fails_closed(exc, truth)
                outcomes["failed closed"] += 1
            cache = ReceiptsCache(tmp_path / f"cache-{runs}")
            try:
                audit = audit_run(truth.root / "run", probe, policy, cache=cache)
            except CheckpointError as exc:
                _fails_closed(exc, truth)
                outcomes["failed closed"] += 1
                assert _cached_receipts(cache.root) == [], "a failed audit cached receipts"
                continue
            signed = audit.statement["subject"][0]["digest"]["sha256"]
            doc = audit.receipts["checkpoint-1.json"]
            assert doc["checkpoint"]["digest"]["sha256"] == signed
            _consistent(truth, signed, doc["nll"], "certificate")
            for cached in _cached_receipts(cache.root):  # never forged receipts under a digest
                _consistent(truth, cached["checkpoint"]["digest"]["sha256"], cached["nll"], "cache")
            outcomes["certificates"] += 1
        assert _toggling(truth), "the writer stopped toggling before the audits ended"
    finally:
        writer.kill()
        writer.wait()
    if budget is None:  # from a private copy only a timestamp moved by writeback fails closed
        assert outcomes["receipts"] + outcomes["certificates"] >= 1, outcomes


# ----- the reader itself: deterministic, no second process --------------------------------------


def _unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opens no longer compare the file's identity: what is left to catch a change is the bytes
    themselves, as with a write through a shared mapping into a dirty page."""
    from moeaudit.checkpoint import sealed as sealed_mod

    def pinned(path: Path, expect: Any, io: Any) -> Any:
        fd = os.open(path, os.O_RDONLY)
        try:
            io(fd)
            return expect or digest_mod.FileId.of(os.fstat(fd))
        finally:
            os.close(fd)

    monkeypatch.setattr(sealed_mod, "pinned", pinned)
    monkeypatch.setattr(digest_mod, "pinned", pinned)


def _blob(path: Path, size: int) -> bytes:
    data = bytes((i * 7 + i // 251) % 256 for i in range(size))
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("budget", [None, 0], ids=["private-copy", "streamed"])
def test_sealed_reads_return_the_hashed_bytes_at_any_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    from moeaudit.checkpoint.sealed import BLOCK, seal

    if budget is not None:
        monkeypatch.setattr(limits, "PRIVATE_COPY_BYTES", budget)
    data = _blob(tmp_path / "f", 4 * BLOCK + 1234)
    s = seal(tmp_path / "f")
    assert s.sha256 == digest_mod.file_sha256(tmp_path / "f")
    assert (s.data is None) == (budget == 0)
    for offset, length in [
        (0, 0),
        (0, 10),
        (5, BLOCK),
        (BLOCK, BLOCK),
        (BLOCK - 1, 2 * BLOCK + 2),
        (0, len(data)),
        (3 * BLOCK + 7, 5000),
        (len(data) - 3, 100),
    ]:
        buf = bytearray(length)
        got = s.read_into(offset, buf)
        assert bytes(buf[:got]) == data[offset : offset + length] and got == min(length, len(data) - offset)


def test_a_rewrite_after_sealing_is_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed: the changed block is refused, naming its range; private copy: the hashed bytes
    are what the reader gets, whatever the file holds now."""
    from moeaudit.checkpoint.sealed import BLOCK, seal

    _unpinned(monkeypatch)
    data = _blob(tmp_path / "f", 3 * BLOCK)
    kept = seal(tmp_path / "f")
    monkeypatch.setattr(limits, "PRIVATE_COPY_BYTES", 0)
    streamed = seal(tmp_path / "f")
    with open(tmp_path / "f", "r+b") as f:
        f.seek(BLOCK + 10)
        f.write(b"\xff")
    buf = bytearray(100)
    kept.read_into(BLOCK, buf)
    assert bytes(buf) == data[BLOCK : BLOCK + 100]
    streamed.read_into(0, buf)  # an untouched block still reads
    with pytest.raises(CheckpointError, match=f"bytes {BLOCK}..{2 * BLOCK} no longer hash to what was digested"):
        streamed.read_into(BLOCK + 50, buf)


def test_copies_beyond_the_budget_fall_back_to_proven_rereads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moeaudit.checkpoint.sealed import BLOCK, seal

    _unpinned(monkeypatch)
    monkeypatch.setattr(limits, "PRIVATE_COPY_BYTES", 3 * BLOCK)
    a, b = _blob(tmp_path / "a", 2 * BLOCK), _blob(tmp_path / "b", 2 * BLOCK)
    sa = seal(tmp_path / "a")
    sb = seal(tmp_path / "b")  # a's copy is given up to make room
    assert sa.data is None and sa.blocks is not None and sb.data is not None
    buf = bytearray(BLOCK)
    assert sa.read_into(BLOCK // 2, buf) == BLOCK and bytes(buf) == a[BLOCK // 2 : BLOCK // 2 + BLOCK]
    (tmp_path / "a").write_bytes(b[::-1])  # same size, other bytes
    with pytest.raises(CheckpointError, match="no longer hash to what was digested"):
        sa.read_into(0, buf)


def test_the_header_hashed_must_be_the_header_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _unpinned(monkeypatch)
    ckpt = corpus.save_checkpoint(tmp_path / "ckpt", corpus.tensors())
    sf = SafetensorsFile(ckpt / WEIGHTS, sealed=True)
    raw = (ckpt / WEIGHTS).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = raw[8 : 8 + n].replace(b'"F32"', b'"I32"', 1)  # same length: another model
    with open(ckpt / WEIGHTS, "r+b") as f:
        f.seek(8)
        f.write(head)
    with pytest.raises(CheckpointError, match="its header is not the one read before it was hashed"):
        sf.read(corpus.ROUTER)


def test_the_root_digest_is_of_the_bytes_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """config.json is hashed as parsed, the weights as sealed: a rewrite after opening changes
    neither what the replay uses nor the digest it is signed under."""
    _unpinned(monkeypatch)
    ckpt = corpus.save_checkpoint(tmp_path / "ckpt", corpus.tensors())
    honest = digest_mod.root_digest(ckpt)[0]
    c = Checkpoint(ckpt)
    router = c.read(corpus.ROUTER).clone()  # seals the weights
    cfg = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(cfg.replace('"rope_theta": 1000000.0', '"rope_theta": 10000.0'))
    (ckpt / WEIGHTS).write_bytes(corpus.pack(corpus.tensors(seed=1), {"format": "pt"}))
    assert c.digest == honest and c.read(corpus.ROUTER).equal(router)
    assert digest_mod.root_digest(ckpt)[0] != honest
