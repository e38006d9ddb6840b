"""Checkpoint root digests equal what OpenSSF model-signing computes for the same directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeaudit.checkpoint.digest import root_digest
from moeaudit.errors import CheckpointError


def _model_signing_root(path: Path) -> str:
    pytest.importorskip("OpenSSL")
    hashing = pytest.importorskip("model_signing.hashing")
    from model_signing._signing import signing

    payload = signing.Payload(hashing.hash(path))
    return payload.statement.pb.subject[0].digest["sha256"]


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (root / "sub" / "notes.txt").write_text("nested")
    (root / ".gitattributes").write_text("*.safetensors filter=lfs")
    (root / "b_empty").write_bytes(b"")
    return root


def test_root_digest_matches_model_signing(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ckpt")
    ours, files = root_digest(root)
    assert ".gitattributes" not in files and "sub/notes.txt" in files
    assert ours == _model_signing_root(root)


def test_digest_changes_with_any_byte(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ckpt")
    before = root_digest(root)[0]
    (root / "sub" / "notes.txt").write_text("nested!")
    assert root_digest(root)[0] != before


def test_symlink_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ckpt")
    (root / "link").symlink_to(root / "config.json")
    with pytest.raises(CheckpointError, match="symbolic links"):
        root_digest(root)
