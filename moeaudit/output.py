"""The certificate's output set — receipts/, certificate.html, certificate.json,
certificate.sigstore.json — appears whole
or not at all (issue 14).

Everything is written into a staging directory beside the output (same filesystem), then put in
place by renames: the output directory is always either the previous complete set or the new
complete set, never a mix (no stale receipts after ``--force``, no page without its
certificate after a full disk). A lock file beside the output serialises two ``certify`` runs
aimed at one directory: the second stops at once, before its replay. Creating the staging
directory up front also proves the location is writable before hours of replay are spent.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from moeaudit.errors import InputError

OURS = {"certificate.json", "certificate.html", "certificate.sigstore.json", "receipts"}


class OutputSet:
    """``with OutputSet(out_dir, force) as target:`` write into ``target.staging``, then
    ``target.commit()``; leaving the block without committing removes the staging directory."""

    def __init__(self, out_dir: Path, force: bool = False):
        self.out_dir = Path(out_dir)
        self.force = force
        self.staging = self.out_dir.parent / f".{self.out_dir.name}.staging-{uuid.uuid4().hex[:12]}"
        self._lock_fd: int | None = None
        self.committed = False

    def __enter__(self) -> OutputSet:
        parent = self.out_dir.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the output location ({exc.strerror or exc})",
                             path=parent) from exc
        self._lock()
        try:
            self._check_existing()
            self.staging.mkdir()
        except BaseException:
            self._unlock()
            raise
        return self

    def _lock(self) -> None:
        import fcntl

        lock = self._lock_path = self.out_dir.parent / f".{self.out_dir.name}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise InputError(f"cannot write to the output location ({exc.strerror or exc})",
                             path=self.out_dir.parent, hint="choose a writable --out") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise InputError("another moeaudit run is writing to this output directory",
                                 path=self.out_dir, hint="wait for it, or choose another --out") from exc
            raise
        try:  # the lock file we hold must still be the one at the path (a finished run unlinks it)
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            raise InputError("another moeaudit run was writing to this output directory",
                             path=self.out_dir, hint="run the command again")
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:  # unlink while holding it, so nothing is left behind (see the check in _lock)
                os.unlink(self._lock_path)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def _check_existing(self) -> None:
        out = self.out_dir
        if os.path.islink(out) or (out.exists() and not out.is_dir()):
            raise InputError("the output path exists and is not a directory", path=out,
                             hint="choose a new or empty --out directory")
        if not out.is_dir():
            return
        entries = {p.name for p in out.iterdir()}
        foreign = sorted(entries - OURS)
        if foreign:
            raise InputError(f"the output directory holds other files ({', '.join(foreign[:3])}"
                             f"{', …' if len(foreign) > 3 else ''}); a certificate's output set "
                             "replaces the directory as a whole", path=out,
                             hint="choose a new or empty --out directory")
        if entries & OURS and not self.force:
            raise InputError("a certificate already exists here", path=out / "certificate.json",
                             hint="pass --force to replace it")

    def commit(self) -> None:
        """Put the staged set in place: a rename when the output is new; otherwise the old set is
        moved aside, the new one renamed in, and the old one removed."""
        out = self.out_dir
        old = None
        if out.exists():
            self._check_existing()  # nothing foreign appeared while we worked
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(out, old)
        try:
            os.rename(self.staging, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
        self.committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, *exc: Any) -> None:
        try:
            if not self.committed:
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._unlock()
