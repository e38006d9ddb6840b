"""Checkpoint root digests equal what OpenSSF model-signing computes for the same directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeaudit.checkpoint.digest import root_digest, snapshot
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


def _model_signing_manifest(path: Path, *, allow_symlinks: bool = False) -> tuple[str, list[str]]:
    """model-signing's subject digest and resource names, with its default hashing config
    (which ignores only .git/, .gitattributes, .github/ and .gitignore at the model root)."""
    pytest.importorskip("OpenSSL")
    hashing = pytest.importorskip("model_signing.hashing")
    from model_signing._signing import signing

    manifest = hashing.Config().set_allow_symlinks(allow_symlinks).hash(path)
    subject = signing.Payload(manifest).statement.pb.subject[0].digest["sha256"]
    return subject, [d.identifier for d in manifest.resource_descriptors()]


def test_files_are_ordered_as_model_signing_orders_them(tmp_path: Path) -> None:
    """By path component, not by string: ``a/b`` before ``a-b/c`` although ``-`` < ``/``."""
    root = tmp_path / "ckpt"
    for rel, text in (("a/b", "1"), ("a-b/c", "2"), ("a.json", "3"), ("a/a-b", "4")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subject, names = _model_signing_manifest(root)
    assert names == ["a/a-b", "a/b", "a-b/c", "a.json"]
    assert [r["name"] for r in snapshot(root).resources] == names
    assert root_digest(root)[0] == subject


def test_what_the_digest_covers_is_model_signings_default(tmp_path: Path) -> None:
    """README.md and ``hf download --local-dir``'s ``.cache/huggingface/`` are covered, as
    model-signing covers them; git's metadata at the root is not, and nowhere else is ignored.
    The same weights downloaded twice differ in the download metadata's timestamp only: the
    root digests differ, the weights' own entries in the signed file list do not."""
    roots, weights = [], []
    for when in ("1764000000.1", "1764999999.9"):
        root = _tree(tmp_path / f"download-{when}")
        (root / "README.md").write_text("# model card\n")
        meta = root / ".cache" / "huggingface" / "download"
        meta.mkdir(parents=True)
        (meta / "model.safetensors.metadata").write_text(f"0123abcd\nsha-of-blob\n{when}\n")
        (root / ".git").mkdir()
        (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (root / "sub" / ".gitignore").write_text("*.tmp\n")  # ignored only at the root
        subject, names = _model_signing_manifest(root)
        listed = snapshot(root).resources
        assert [r["name"] for r in listed] == names
        assert names == [
            ".cache/huggingface/download/model.safetensors.metadata",
            "README.md",
            "b_empty",
            "config.json",
            "model.safetensors",
            "sub/.gitignore",
            "sub/notes.txt",
        ]
        assert root_digest(root)[0] == subject
        roots.append(subject)
        weights.append([r for r in listed if r["name"] == "model.safetensors"])
    assert roots[0] != roots[1] and weights[0] == weights[1]


def _hf_cache(cache: Path, repo: str = "models--org--tiny", rev: str = "0123abcd") -> Path:
    """A ``huggingface_hub`` cache repository: files in ``blobs/`` named by their hash, the
    snapshot's names relative links into them (``../../blobs/<hash>``, one level deeper for a
    file in a subfolder). Returns the snapshot directory."""
    import hashlib

    src = _tree(cache / "src")
    repo_dir = cache / repo
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    snap = repo_dir / "snapshots" / rev
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src)
        blob = hashlib.sha256(path.read_bytes()).hexdigest()
        (repo_dir / "blobs" / blob).write_bytes(path.read_bytes())
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).symlink_to(Path(*[".."] * (len(rel.parts) + 1), "blobs", blob))
    return snap


def test_hugging_face_cache_snapshot_is_hashed_through_its_links(tmp_path: Path) -> None:
    snap = _hf_cache(tmp_path / "hub")
    src = tmp_path / "hub" / "src"
    ours, files = root_digest(snap)
    assert sorted(files) == ["b_empty", "config.json", "model.safetensors", "sub/notes.txt"]  # the snapshot's names
    assert ours == root_digest(src)[0]  # what the links point to is what is hashed
    subject, names = _model_signing_manifest(snap, allow_symlinks=True)
    assert ours == subject and names == [r["name"] for r in snapshot(snap).resources]


@pytest.mark.parametrize(
    "target",
    [
        "../../../src/config.json",  # outside the repository
        "../../../models--org--other/blobs/x",  # another repository's blobs
        "../../blobs",  # the blobs folder itself (a directory)
        "real.json",  # a link to a regular file of the snapshot, not to a blob
        "../../blobs/missing",  # dangling
    ],
)
def test_any_other_link_in_a_cache_snapshot_is_refused(tmp_path: Path, target: str) -> None:
    snap = _hf_cache(tmp_path / "hub")
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "x").write_text("{}")
    (snap / "real.json").write_text("{}")
    (snap / "extra.json").symlink_to(target)
    with pytest.raises(CheckpointError, match="symbolic links are not followed"):
        root_digest(snap)


def test_a_cache_whose_blobs_folder_is_a_link_is_refused(tmp_path: Path) -> None:
    snap = _hf_cache(tmp_path / "hub")
    blobs = tmp_path / "hub" / "models--org--tiny" / "blobs"
    blobs.rename(tmp_path / "elsewhere")
    blobs.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic links are not followed"):
        root_digest(snap)


def test_a_linked_directory_in_a_cache_snapshot_is_refused(tmp_path: Path) -> None:
    snap = _hf_cache(tmp_path / "hub")
    (snap / "linked").symlink_to(snap / "sub", target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic links are not followed"):
        root_digest(snap)


def test_claims_jsonl_at_the_root_is_left_out_as_model_signing_ignore_paths_leaves_it(tmp_path: Path) -> None:
    """The attestations file beside the model (``claims.jsonl``, whose claims name this digest)
    is not covered at the root — model-signing's number with ``ignore_paths=[claims.jsonl]`` —
    and is covered anywhere else, like any file."""
    pytest.importorskip("OpenSSL")
    hashing = pytest.importorskip("model_signing.hashing")
    from model_signing._signing import signing

    root = _tree(tmp_path / "ckpt")
    before = root_digest(root)[0]
    (root / "claims.jsonl").write_text('{"mediaType": "x"}\n')
    ours, files = root_digest(root)
    assert ours == before and "claims.jsonl" not in files
    config = hashing.Config().set_ignored_paths(paths=[root / "claims.jsonl"], ignore_git_paths=True)
    assert ours == signing.Payload(config.hash(root)).statement.pb.subject[0].digest["sha256"]
    assert ours != _model_signing_root(root)  # model-signing's default covers it
    (root / "sub" / "claims.jsonl").write_text("{}\n")
    assert "sub/claims.jsonl" in root_digest(root)[1]
