"""The host plan of a replay on an accelerator (replay/hostplan.py): checkpoint files kept once,
in (pinned) private copies budgeted from the host's headroom, tensors read as views of them.

What must hold: the receipts are the default plan's, byte for byte; a read is a view of the very
bytes that were hashed (no second copy), and stays so when the file is rewritten after it was
hashed; a file swapped by rename is still named as changed; the CPU keeps its cap.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit import limits
from moeaudit.checkpoint import Checkpoint, sealed
from moeaudit.checkpoint.safetensors import SafetensorsFile
from moeaudit.errors import CheckpointError
from moeaudit.receipts.state import state_receipts
from moeaudit.replay import hostplan

pytest.importorskip("transformers")

import hfmodels  # noqa: E402


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hfmodels.save_any(tmp_path_factory.mktemp("mixtral") / "ckpt", "mixtral")


@pytest.fixture(scope="module")
def probe() -> canary_mod.Canary:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, hfmodels.VOCAB, (4, 16), generator=g, dtype=torch.int32)
    return canary_mod.Canary(tokens, torch.arange(4, dtype=torch.int32) % 2, ("code", "prose"))


@pytest.fixture()
def aliased(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The accelerator's plan on the CPU stand-in (no pinning here); the sizes it allocated."""
    made: list[int] = []

    def allocate(n: int) -> bytearray:
        made.append(n)
        return bytearray(n)

    monkeypatch.setattr(sealed, "PLAN", sealed.HostPlan(budget=1 << 30, allocate=allocate, alias=True))
    return made


def _bytes(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True)


def test_receipts_under_the_plan_are_the_default_receipts(
    ckpt_dir: Path, probe: canary_mod.Canary, monkeypatch: pytest.MonkeyPatch, aliased: list[int]
) -> None:
    with_plan = state_receipts(Checkpoint(ckpt_dir), probe, device="cpu:0")
    assert aliased, "the plan's allocator made the private copies"
    monkeypatch.setattr(sealed, "PLAN", sealed.HostPlan())
    assert _bytes(with_plan) == _bytes(state_receipts(Checkpoint(ckpt_dir), probe, device="cpu:0"))


def _one_tensor(ckpt_dir: Path) -> tuple[SafetensorsFile, str]:
    sf = SafetensorsFile(ckpt_dir / "model.safetensors", sealed=True)
    name = max(sf.tensors, key=lambda n: sf.tensors[n].end - sf.tensors[n].begin)
    return sf, name


def test_a_read_is_a_view_of_the_hashed_copy(ckpt_dir: Path, tmp_path: Path, aliased: list[int]) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes((ckpt_dir / "model.safetensors").read_bytes())
    sf, name = _one_tensor(tmp_path)
    first = sf.read(name)
    copy = sf.seal().data
    assert copy is not None
    base = torch.frombuffer(copy, dtype=torch.uint8).data_ptr()
    info = sf.tensors[name]
    assert first.data_ptr() == base + info.begin, "the tensor is not a view of the private copy"
    honest = first.clone()
    with open(path, "r+b") as f:  # rewritten in place after it was hashed: same inode, same size
        f.seek(info.begin)
        f.write(bytes(info.end - info.begin))
    os.utime(path, ns=(sf.identity.mtime_ns, sf.identity.mtime_ns))  # type: ignore[union-attr]
    try:
        again = sf.read(name)
    except CheckpointError as exc:  # a moved ctime names the file as changed: also honest
        assert "changed" in exc.what
    else:
        assert torch.equal(again, honest), "a read returned bytes that were not hashed"


def test_a_file_renamed_over_is_named_as_changed(ckpt_dir: Path, tmp_path: Path, aliased: list[int]) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes((ckpt_dir / "model.safetensors").read_bytes())
    sf, name = _one_tensor(tmp_path)
    sf.read(name)
    other = tmp_path / "other"
    other.write_bytes(path.read_bytes())
    other.replace(path)
    with pytest.raises(CheckpointError, match="changed"):
        sf.read(name)


def test_giving_up_a_copy_settles_queued_copies_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settled: list[bool] = []
    monkeypatch.setattr(
        sealed, "PLAN", sealed.HostPlan(budget=3 * sealed.BLOCK, alias=True, settle=lambda: settled.append(True))
    )
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(bytes(2 * sealed.BLOCK))
    first = sealed.seal(tmp_path / "a")
    assert first.data is not None and not settled
    sealed.seal(tmp_path / "b")  # a's copy is given up to make room
    assert first.data is None and settled == [True]


def test_the_cpu_keeps_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sealed, "PLAN", sealed.HostPlan())
    for device in (None, "cpu", "cpu:0"):
        assert hostplan.plan_host_copies(device) == sealed.HostPlan()


def test_an_accelerator_budgets_from_the_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sealed, "PLAN", sealed.HostPlan())
    monkeypatch.delenv(hostplan.ENV, raising=False)
    monkeypatch.setattr(hostplan, "host_headroom", lambda: 64e9)
    plan = hostplan.plan_host_copies("meta", pin=False)
    assert plan is sealed.PLAN and plan.alias and plan.budget == 32_000_000_000
    monkeypatch.setattr(hostplan, "host_headroom", lambda: 0.0)  # unreadable: never below the cap
    assert hostplan.plan_host_copies("meta", pin=False).budget == limits.PRIVATE_COPY_BYTES
    monkeypatch.setenv(hostplan.ENV, "64MiB")
    assert hostplan.plan_host_copies("meta", pin=False).budget == 64 << 20
    monkeypatch.setenv(hostplan.ENV, "0")
    assert hostplan.plan_host_copies("meta", pin=False).budget == limits.PRIVATE_COPY_BYTES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_reads_are_pinned_views(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sealed, "PLAN", sealed.HostPlan())
    hostplan.plan_host_copies("cuda")
    sf, name = _one_tensor(ckpt_dir)
    t = sf.read(name)
    assert t.is_pinned()
    assert t.pin_memory().data_ptr() == t.data_ptr()  # no staging copy before the DMA


def test_the_device_branch_names_the_same_nonfinite_weights(
    ckpt_dir: Path, tmp_path: Path, probe: canary_mod.Canary
) -> None:
    """Weights that cross in their on-disk dtype are checked on the device, read back once per
    forward: the same names, in the same order, as the host's check."""
    import shutil

    from safetensors.torch import load_file

    from moeaudit.checkpoint.safetensors import write_safetensors
    from moeaudit.replay.engine import replay

    shutil.copytree(ckpt_dir, tmp_path / "bad")
    tensors = load_file(tmp_path / "bad" / "model.safetensors")
    attn = next(k for k in sorted(tensors) if "layers.1." in k and "q_proj" in k)
    expert = next(k for k in sorted(tensors) if "layers.0." in k and "experts" in k)
    tensors[attn][0, 0] = float("nan")
    tensors[expert][-1, -1] = float("inf")
    write_safetensors(tmp_path / "bad" / "model.safetensors", tensors)
    ckpt = Checkpoint(tmp_path / "bad")
    on_host = replay(ckpt, probe.tokens, backward=False).nonfinite_weights
    on_device = replay(ckpt, probe.tokens, backward=False, device="cpu:0").nonfinite_weights
    assert len(on_host) == 2 and any("layer 1" in n for n in on_host) and any("layer 0" in n for n in on_host)
    assert on_device == on_host
