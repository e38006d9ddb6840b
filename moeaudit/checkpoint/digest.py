"""The OpenSSF model-signing root digest of a checkpoint directory.

model-signing (``sigstore/model-transparency``) hashes every file of a model directory with
SHA-256, then hashes the raw 32-byte file digests concatenated in sorted path order; that root
is the in-toto subject digest. We do the same, so a moeaudit certificate names a checkpoint by
the digest a model-signing signature names it by.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from moeaudit.errors import CheckpointError

CHUNK = 1 << 20
# model-signing ignores git metadata at the model root by default (hashing.Config).
IGNORED_AT_ROOT = {".git", ".gitattributes", ".github", ".gitignore"}


def iter_files(root: Path) -> list[Path]:
    """Regular files below ``root`` in sorted POSIX-path order; links are refused.

    os.walk lists a link to a directory among the directories and does not descend into it,
    so both lists are checked: a linked directory is refused, never silently left out of the
    digest. Pipes, sockets and devices are refused before anything opens them (a pipe would
    block the read forever).
    """
    files = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_unlistable, followlinks=False):
        at_root = Path(dirpath) == root
        dirnames[:] = sorted(d for d in dirnames if not (at_root and d in IGNORED_AT_ROOT))
        for name in dirnames:
            _refuse_link(Path(dirpath) / name)
        for name in filenames:
            if at_root and name in IGNORED_AT_ROOT:
                continue
            path = Path(dirpath) / name
            _refuse_link(path)
            if not path.is_file():
                raise CheckpointError("not a regular file (a pipe, socket or device)", path=path,
                                      hint="a checkpoint directory holds only regular files")
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _unlistable(exc: OSError) -> None:
    """os.walk skips a directory it cannot list unless told otherwise; we refuse instead."""
    raise CheckpointError(f"cannot list directory: {exc.strerror or exc}",
                          path=exc.filename) from exc


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise CheckpointError(
            "symbolic links are not followed in a checkpoint", path=path,
            hint="copy the target file into the checkpoint directory",
        )


def file_sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from exc
    return h.digest()


def root_digest(root: Path) -> tuple[str, dict[str, str]]:
    """(hex root digest, {relative path: hex file digest})."""
    files = iter_files(root)
    h = hashlib.sha256()
    per_file = {}
    for path in files:
        d = file_sha256(path)
        h.update(d)
        per_file[path.relative_to(root).as_posix()] = d.hex()
    return h.hexdigest(), per_file
