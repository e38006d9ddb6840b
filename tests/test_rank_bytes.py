"""What each rank of an expert-parallel replay reads (``replay.rank_bytes``), in one
process: the plan (who needs which blocks, who hashes each file) and a rank's sealed file (kept
blocks served from memory, the others read once, checked against their digests, then kept).
The ranks together are tested in tests/test_sharded.py (the checkpoint read once in all)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hfmodels import save_tiny  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.checkpoint import sealed as sealed_mod  # noqa: E402
from moeaudit.checkpoint.digest import pinned  # noqa: E402
from moeaudit.checkpoint.safetensors import SafetensorsFile  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.replay import rank_bytes  # noqa: E402
from moeaudit.replay.shards import experts_of  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = tmp_path_factory.mktemp("rank_bytes") / "mixtral"
    save_tiny(path, "mixtral", max_shard_size="40KB")
    return Checkpoint(path)


def _files(c: Checkpoint) -> dict[str, SafetensorsFile]:
    return {n: f for n, f in sorted(c.files.items()) if isinstance(f, SafetensorsFile)}


def _blocks_of(c: Checkpoint, key: str) -> tuple[str, set[int]]:
    info = c.info(key)
    return c.key_file[key], set(range(info.begin // sealed_mod.BLOCK, (info.end - 1) // sealed_mod.BLOCK + 1))


def test_each_rank_needs_its_experts_and_the_replicated_tensors(ckpt: Checkpoint) -> None:
    files = _files(ckpt)
    plan = rank_bytes.plan(ckpt, 2, files)
    E = ckpt.spec.num_experts
    mine = experts_of(E, 2)
    keys = ckpt.expert_keys(0)
    assert isinstance(keys, list)
    for r in range(2):
        for e in mine[r]:
            name, blocks = _blocks_of(ckpt, keys[e]["w1"])
            assert blocks <= set(plan.need[r][name])
        for key in ckpt.layer_keys(0).values():  # attention, norms, router: every rank
            name, blocks = _blocks_of(ckpt, key)
            assert blocks <= set(plan.need[r][name])
        assert all(b[:1] == [0] for b in plan.need[r].values())  # every header
    # the files hashed: each by one rank, both ranks hash some; a file of rank 1's experts only
    # (the tiny checkpoint's 40 KB shards hold one weight of every expert) goes to the least loaded
    assert set(plan.owner) == set(files) and set(plan.owner.values()) == {0, 1}
    loads = [sum(plan.sizes[f] for f, r in plan.owner.items() if r == k) for k in range(2)]
    assert max(loads) < 0.65 * sum(loads), loads
    # and the rank that needs most of a file hashes it
    lopsided = rank_bytes.Plan({"a": 4 * sealed_mod.BLOCK}, [{"a": [0]}, {"a": [0, 1, 2, 3]}])
    assert rank_bytes.owners(lopsided) == {"a": 1}


def test_rank_sealed_serves_kept_blocks_and_checks_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w.bin"  # four blocks and a bit: a file's bytes, whatever their format
    data = random.Random(0).randbytes(4 * sealed_mod.BLOCK + 100)
    path.write_bytes(data)
    fid = pinned(path, None, lambda _fd: None)
    sha, digests, kept = rank_bytes.hash_keeping(path, fid, {0})
    assert sha == hashlib.sha256(data).digest()
    assert digests == sealed_mod._block_digests(memoryview(data)) and set(kept) == {0}
    s = rank_bytes.RankSealed(path, fid, sha, digests)
    s.keep(kept)
    reads: list[int] = []
    pread = sealed_mod._pread_exact

    def counted(path: Path, fd: int, view: memoryview, offset: int) -> None:
        reads.append(len(view))
        pread(path, fd, view, offset)

    monkeypatch.setattr(sealed_mod, "_pread_exact", counted)
    buf = bytearray(100)
    assert s.read_into(10, buf) == 100 and buf == data[10:110] and reads == []  # a kept block
    at = sealed_mod.BLOCK + 5  # straddles blocks 1 and 2: read once, then kept
    big = bytearray(sealed_mod.BLOCK)
    assert s.read_into(at, big) == len(big) and big == data[at : at + len(big)]
    assert sum(reads) == 2 * sealed_mod.BLOCK
    reads.clear()
    assert s.read_into(at, big) == len(big) and big == data[at : at + len(big)] and reads == []
    # a block the digests do not vouch for is never served
    forged = rank_bytes.RankSealed(path, fid, sha, digests[:32] + bytes(32) + digests[64:])
    with pytest.raises(CheckpointError, match="no longer hash to what was digested"):
        forged.read_into(sealed_mod.BLOCK, bytearray(10))
    with pytest.raises(CheckpointError, match="no longer hash"):
        forged.check(1, data[sealed_mod.BLOCK : 2 * sealed_mod.BLOCK])  # nor one another rank sent
