"""The OpenSSF model-signing root digest of a checkpoint directory, and pinned reads.

model-signing (``sigstore/model-transparency``) hashes every file of a model directory with
SHA-256, then hashes the raw 32-byte file digests concatenated in sorted path order; that root
is the in-toto subject digest. We do the same, so a moeaudit certificate names a checkpoint by
the digest a model-signing signature names it by.

Hash exactly the bytes that are used (docs/decisions.md, "Pinned reads", "Read once"): a weight file is read once, into
private memory, and hashed as it is read (``sealed``); its tensors come from that private copy
or from re-reads proven block by block against digests taken in the same pass. config.json and
the shard index are hashed from the very bytes that were parsed. Every open is also *pinned*:
``fstat`` before and after the I/O must give the identity recorded the first time the file was
opened (device, inode, size, mtime, ctime), so a file renamed over, rewritten in place or grown
meanwhile is an error naming it. Metadata is not what proves the bytes (a write through a shared
mapping into an already-dirty page moves no timestamp); it names honest changes early. A file
changed within ``RACY_NS`` of when we first saw it may keep its timestamps through one more
write, so such a file is hashed again at the end (:meth:`Snapshot.verify`), as git does for its
"racily clean" index entries: a checkpoint still being written fails rather than passes.

What is covered: every regular file below the checkpoint directory except git's metadata at its
root, exactly model-signing's default ignore list (``hashing.Config.hash`` in model-signing
1.1.1 adds ``.git/``, ``.gitattributes``, ``.github/`` and ``.gitignore`` and nothing else), and
the attestations file ``claims.jsonl`` at its root (whose claims name this digest), so
README.md and a ``hf download --local-dir`` directory's ``.cache/huggingface/`` metadata are
covered (docs/security.md). The root digest does not bind names: two files renamed so that the
sorted order is kept give the same root, so the certificate also signs :attr:`Snapshot.resources`
(name, size, SHA-256 of each file, as model-signing's predicate lists its ``resources``).

Symbolic links are refused, except the Hugging Face cache layout
(``models--ORG--NAME/snapshots/REV/NAME`` → ``../../blobs/SHA``, what ``huggingface_hub``
downloads write): a link to a file that resolves to a regular file directly inside the same
repository's ``blobs/`` folder is followed, its target hashed and its name in the snapshot
signed, as model-signing does with ``allow_symlinks`` set.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError

CHUNK = 1 << 20
# model-signing ignores git metadata at the model root by default (hashing.Config).
IGNORED_AT_ROOT = {".git", ".gitattributes", ".github", ".gitignore"}
# The attestations file beside the model (the claims.jsonl layout of model-transparency's
# "unified bundle" proposal): its claims name the model's root digest, so the digest cannot cover
# it — model-signing computes the same number with ``ignore_paths=[claims.jsonl]``.
ATTESTATIONS_AT_ROOT = {"claims.jsonl"}
RACY_NS = 2_000_000_000  # timestamps this close to our first look do not prove "unchanged"
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
CHANGED_HINT = (
    "audit a checkpoint only once it is completely written, and leave it alone until the audit ends; then rerun"
)


@dataclass(frozen=True)
class FileId:
    """What must not change between hashing a file and reading it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    seen_ns: int = field(default=0, compare=False)  # when we took it (wall clock)

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, time.time_ns())

    @property
    def racy(self) -> bool:
        """Changed so shortly before we first saw it that its timestamps may not move again."""
        return self.seen_ns - max(self.mtime_ns, self.ctime_ns) < RACY_NS

    def differs(self, other: FileId) -> str | None:
        """How ``other`` differs from this identity, in words; None when it does not."""
        if (self.dev, self.ino) != (other.dev, other.ino):
            return "it was replaced by another file"
        if self.size != other.size:
            return f"its size went from {self.size} to {other.size} bytes"
        if (self.mtime_ns, self.ctime_ns) != (other.mtime_ns, other.ctime_ns):
            return "it was modified"
        return None


def changed(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"changed while it was being audited: {why}", path=path, hint=CHANGED_HINT)


def _open(path: Path) -> tuple[int, FileId]:
    """A descriptor on the regular file ``path`` (never a pipe or device, nor a link other than a
    Hugging Face cache snapshot's link into its blobs, :func:`hf_blob`) and its id."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if not os.path.islink(path):
            raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from exc
        target = hf_blob(path)
        if target is None:
            raise _link_error(path) from exc
        try:  # the resolved blob itself, still never through a link
            fd = os.open(target, _OPEN_FLAGS)
        except OSError as exc2:
            raise CheckpointError(f"cannot read its blob {target}: {exc2.strerror or exc2}", path=path) from exc2
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(
            "not a regular file (a pipe, socket or device)",
            path=path,
            hint="a checkpoint directory holds only regular files",
        )
    return fd, FileId.of(st)


def pinned(path: Path, expect: FileId | None, io: Callable[[int], object]) -> FileId:
    """Run ``io(fd)`` on ``path`` and return its identity as seen now; raise if it is not
    ``expect`` (the identity of an earlier open) or if it changes while ``io`` runs."""
    fd, before = _open(path)
    try:
        if expect is not None and (why := expect.differs(before)):
            raise changed(path, why)
        try:
            io(fd)
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from exc
        after = FileId.of(os.fstat(fd))
    finally:
        os.close(fd)
    if why := before.differs(after):
        raise changed(path, why)
    return before


def read_bytes(path: Path, expect: FileId | None = None, limit: int | None = None) -> tuple[bytes, FileId]:
    """The whole file, pinned; a file over ``limit`` bytes is refused before (or while) it is read."""
    chunks: list[bytes] = []

    def too_big(size: int) -> CheckpointError:
        return CheckpointError(
            f"{size} bytes, over the {limit}-byte limit for this file",
            path=path,
            hint="this is not a file save_pretrained writes; check the checkpoint",
        )

    def io(fd: int) -> None:
        if limit is not None and (size := os.fstat(fd).st_size) > limit:
            raise too_big(size)
        total = 0
        while chunk := os.read(fd, CHUNK):
            total += len(chunk)
            if limit is not None and total > limit:  # it grew while we read it
                raise too_big(total)
            chunks.append(chunk)

    fid = pinned(path, expect, io)
    return b"".join(chunks), fid


def pread_into(path: Path, expect: FileId | None, offset: int, buf: bytearray) -> int:
    """Fill ``buf`` from ``offset`` (pinned); the number of bytes read (short at end of file)."""
    got = 0

    def io(fd: int) -> None:
        nonlocal got
        view = memoryview(buf)
        while got < len(buf):
            n = (
                os.preadv(fd, [view[got:]], offset + got)
                if hasattr(os, "preadv")
                else _pread_copy(fd, view[got:], offset + got)
            )
            if n == 0:
                break
            got += n

    pinned(path, expect, io)
    return got


def _pread_copy(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, min(len(view), 1 << 30), offset)
    view[: len(data)] = data
    return len(data)


def file_sha256(path: Path, expect: FileId | None = None) -> bytes:
    return hash_file(path, expect)[0]


def hash_file(path: Path, expect: FileId | None = None) -> tuple[bytes, FileId]:
    h = hashlib.sha256()

    def io(fd: int) -> None:
        while chunk := os.read(fd, CHUNK):
            h.update(chunk)

    fid = pinned(path, expect, io)
    return h.digest(), fid


def iter_files(root: Path) -> list[Path]:
    """Regular files below ``root`` in model-signing's order (:func:`order`); links are refused
    (but for a Hugging Face cache snapshot's links into its blobs, :func:`hf_blob`).

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
            if at_root and (name in IGNORED_AT_ROOT or name in ATTESTATIONS_AT_ROOT):
                continue
            path = Path(dirpath) / name
            if hf_blob(path) is None:
                _refuse_link(path)
            if not path.is_file():
                raise CheckpointError(
                    "not a regular file (a pipe, socket or device)",
                    path=path,
                    hint="a checkpoint directory holds only regular files",
                )
            files.append(path)
    return sorted(files, key=lambda p: order(p.relative_to(root).as_posix()))


def order(rel: str) -> list[str]:
    """model-signing's order of files: by ``PurePosixPath``, component by component, so
    ``a/b`` sorts before ``a-b/c`` (as strings it would not: ``-`` < ``/``)."""
    return rel.split("/")


def _unlistable(exc: OSError) -> None:
    """os.walk skips a directory it cannot list unless told otherwise; we refuse instead."""
    raise CheckpointError(f"cannot list directory: {exc.strerror or exc}", path=exc.filename) from exc


def _link_error(path: Path) -> CheckpointError:
    return CheckpointError(
        "symbolic links are not followed in a checkpoint (except a Hugging Face cache snapshot's "
        "links into its own repository's blobs/)",
        path=path,
        hint="copy the target file into the checkpoint directory",
    )


def hf_blob(path: Path) -> Path | None:
    """The blob a Hugging Face cache snapshot's link ``path`` stands for, or None when ``path``
    is not such a link: it lies below ``<repo>/snapshots/<rev>/``, ``<repo>/blobs`` is a real
    directory (not a link), and the link resolves to a regular file directly inside it. Any
    other link (to a directory, outside the repository, into another repository's blobs,
    dangling or looping) is not followed."""
    if not os.path.islink(path):
        return None
    here = Path(os.path.realpath(path.parent))
    for rev in (here, *here.parents):
        if rev.parent.name == "snapshots" and rev.parent.parent != rev.parent:
            blobs = rev.parent.parent / "blobs"
            break
    else:
        return None
    if blobs.is_symlink() or not blobs.is_dir():
        return None
    try:
        target = Path(os.path.realpath(path, strict=True))
        st = os.lstat(target)
    except (OSError, RuntimeError):
        return None
    if target.parent != Path(os.path.realpath(blobs)) or not stat.S_ISREG(st.st_mode):
        return None
    return target


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise _link_error(path)


@dataclass
class Snapshot:
    """A directory's root digest with the identity of every file it hashed."""

    root: Path
    digest: str
    files: dict[str, tuple[FileId, str]]  # relative POSIX path → (identity, hex SHA-256)

    @property
    def per_file(self) -> dict[str, str]:
        return {rel: hexd for rel, (_fid, hexd) in self.files.items()}

    @property
    def resources(self) -> list[dict[str, Any]]:
        """Every file the root digest covers, in its order: as model-signing's predicate lists
        its ``resources`` (``name``, ``algorithm``, ``digest``), with the file's ``size``."""
        return resources(self.files)

    def verify(self) -> None:
        """Raise unless the directory still holds exactly the files hashed, unchanged: same
        names, same identities, and (for racy files) the same SHA-256."""
        now = {p.relative_to(self.root).as_posix() for p in iter_files(self.root)}
        for rel in sorted(now ^ set(self.files)):
            why = "it appeared after hashing" if rel in now else "it was removed"
            raise changed(self.root / rel, why)
        for rel, (fid, hexd) in self.files.items():
            if fid.racy:
                d, fresh = hash_file(self.root / rel, fid)
                if d.hex() != hexd:
                    raise changed(self.root / rel, "its bytes no longer hash to the digest")
                if fresh.seen_ns - max(fid.mtime_ns, fid.ctime_ns) >= RACY_NS:
                    self.files[rel] = (replace(fid, seen_ns=fresh.seen_ns), hexd)
            else:
                pinned(self.root / rel, fid, lambda _fd: None)


def snapshot(root: Path, known: dict[str, FileId] | None = None, hashed: dict[str, bytes] | None = None) -> Snapshot:
    """Hash every file below ``root``; a file in ``known`` (relative path → the identity it had
    when it was first read) must still have that identity. A file in ``hashed`` (relative path →
    SHA-256 of the bytes that were read and used) is not read again: its digest is of the bytes
    used, whatever the file holds now."""
    known, hashed = known or {}, hashed or {}
    h = hashlib.sha256()
    files = {}
    for path in iter_files(root):
        rel = path.relative_to(root).as_posix()
        if rel in hashed:
            d, seen = hashed[rel], pinned(path, known.get(rel), lambda _fd: None)
        else:
            d, seen = hash_file(path, known.get(rel))
        h.update(d)
        files[rel] = (known.get(rel, seen), d.hex())  # the first look decides what is racy
    for rel in sorted((set(known) | set(hashed)) - set(files)):
        raise changed(root / rel, "it was removed")
    return Snapshot(root, h.hexdigest(), files)


def root_digest(root: Path) -> tuple[str, dict[str, str]]:
    """(hex root digest, {relative path: hex file digest})."""
    snap = snapshot(root)
    return snap.digest, snap.per_file


def resources(files: dict[str, tuple[FileId, str]]) -> list[dict[str, Any]]:
    return [
        {"name": rel, "size": fid.size, "algorithm": "sha256", "digest": hexd}
        for rel, (fid, hexd) in sorted(files.items(), key=lambda kv: order(kv[0]))
    ]


def root_of(listed: list[dict[str, Any]]) -> str:
    """The root digest a list of :func:`resources` hashes to (model-signing's subject digest:
    SHA-256 over the file digests in the listed order)."""
    h = hashlib.sha256()
    for r in listed:
        h.update(bytes.fromhex(r["digest"]))
    return h.hexdigest()
