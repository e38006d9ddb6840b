"""The strict safetensors reader: every way a header can be wrong has its own message."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moeaudit.checkpoint.safetensors import SafetensorsFile, write_safetensors
from moeaudit.errors import CheckpointError


def _raw(path: Path, header: dict, data: bytes, n: int | None = None) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if n is None else n) + blob + data)
    return path


def test_reads_what_safetensors_writes(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.arange(6, dtype=torch.int32),
        "c": torch.randn(2, 2).to(torch.bfloat16),
        "d": torch.randn(5).half(),
    }
    save_file(tensors, tmp_path / "x.safetensors", metadata={"k": "v"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.metadata == {"k": "v"}
    for name, t in tensors.items():
        assert f.tensors[name].shape == tuple(t.shape)
        assert torch.equal(f.read(name), t)


def test_atomic_writer_round_trip(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "y.safetensors", {"w": torch.ones(2, 3)}, {"m": "1"})
    assert torch.equal(SafetensorsFile(tmp_path / "y.safetensors").read("w"), torch.ones(2, 3))
    assert [p.name for p in tmp_path.iterdir()] == ["y.safetensors"]


@pytest.mark.parametrize(
    "header, data, n, message",
    [
        ({}, b"", 5000, "runs past the end"),
        ({}, b"", 200 * 1024 * 1024, "exceeds"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, "past the"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unsupported dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "not a list of sizes"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "needs dtype, shape and data_offsets"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            None,
            "overlap",
        ),
        ({"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
    ],
)
def test_header_checklist(tmp_path: Path, header: dict, data: bytes, n: int | None, message: str) -> None:
    path = _raw(tmp_path / "bad.safetensors", header, data, n)
    with pytest.raises(CheckpointError, match=message) as info:
        SafetensorsFile(path)
    assert str(path) in info.value.diagnostics()
    assert "\n" not in info.value.diagnostics()


def test_not_json_and_too_short(tmp_path: Path) -> None:
    p = tmp_path / "a.safetensors"
    p.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsFile(p)
    p.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsFile(p)
    p.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        SafetensorsFile(p)


@pytest.mark.parametrize("cut", [0.25, 0.5, 0.99])
def test_truncated_file(tmp_path: Path, cut: float) -> None:
    p = tmp_path / "t.safetensors"
    save_file({"a": torch.randn(64, 64)}, p)
    raw = p.read_bytes()
    p.write_bytes(raw[: int(len(raw) * cut)])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(p)
