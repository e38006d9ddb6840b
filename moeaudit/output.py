"""The certificate's output set — receipts/, certificate.html, certificate.json,
certificate.sigstore.json — appears whole
or not at all (docs/decisions.md, "Output set").

Everything is written into a staging directory beside the output (same filesystem), then put in
place by renames: the output directory is always either the previous complete set or the new
complete set, never a mix (no stale receipts after ``--force``, no page without its
certificate after a full disk). A lock file beside the output serialises two ``certify`` runs
aimed at one directory: the second stops at once, before its replay. Creating the staging
directory up front also proves the location is writable before hours of replay are spent.

A run killed outright (SIGKILL, power loss) cannot clean up: it leaves its staging directory,
its lock file (holding its process id), and — if killed between the two renames of ``commit`` —
the previous set moved aside. The next run for the same output, once it holds the lock, removes
those by name and says so (docs/decisions.md, "Output set"), restoring a previous set that was moved aside.
Errors while writing name ``--out``, never the hidden staging path.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moeaudit.errors import InputError, MoeauditError

OURS = {"certificate.json", "certificate.html", "certificate.sigstore.json", "receipts"}


class OutputSet:
    """``with OutputSet(out_dir, force) as target:`` write into ``target.staging``, then
    ``target.commit()``; leaving the block without committing removes the staging directory."""

    def __init__(self, out_dir: Path, force: bool = False, warn: Callable[[str], None] | None = None):
        self.out_dir = Path(out_dir)
        self.force = force
        self.staging = self.out_dir.parent / f".{self.out_dir.name}.staging-{uuid.uuid4().hex[:12]}"
        self._lock_fd: int | None = None
        self.committed = False
        self.warnings: list[str] = []  # what an earlier, killed run left and this one cleaned up
        self._warn = warn

    def __enter__(self) -> OutputSet:
        parent = self.out_dir.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the output location ({exc.strerror or exc})", path=parent) from exc
        self._lock()
        try:
            self._clean_up_after_a_killed_run()
            self._check_existing()
            self.staging.mkdir()
        except BaseException as exc:
            self._unlock()
            self._name_out(exc)
            raise
        return self

    def _lock(self) -> None:
        import fcntl

        lock = self._lock_path = self.out_dir.parent / f".{self.out_dir.name}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise InputError(
                f"cannot write to the output location ({exc.strerror or exc})",
                path=self.out_dir.parent,
                hint="choose a writable --out",
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise InputError(
                    "another moeaudit run is writing to this output directory",
                    path=self.out_dir,
                    hint="wait for it, or choose another --out",
                ) from exc
            raise
        try:  # the lock file we hold must still be the one at the path (a finished run unlinks it)
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            raise InputError(
                "another moeaudit run was writing to this output directory",
                path=self.out_dir,
                hint="run the command again",
            )
        self._lock_fd = fd
        self._take_over(fd, lock)

    def _take_over(self, fd: int, lock: Path) -> None:
        """Write our process id into the lock we hold. One already there is a run that held this
        lock and ended without removing it (a finished run always does): killed."""
        try:
            before = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            return  # the lock still works; only the note about a killed run is lost
        if before:
            self._say(
                f"removed the stale lock {lock} left by process {before[:20]}, which ended "
                "without releasing it (killed?)"
            )

    def _say(self, message: str) -> None:
        self.warnings.append(message)
        if self._warn is not None:
            self._warn(f"warning: {message}")

    def _clean_up_after_a_killed_run(self) -> None:
        """Remove the staging directories (and an older set moved aside) that a killed run left
        beside the output; restore that older set when the killed run had moved it aside but not
        yet put the new one in place. Called with the lock held: no live run owns them."""
        out = self.out_dir
        found = {
            kind: sorted((p for p in out.parent.iterdir() if _left_by(p, out.name, kind)), key=_mtime)
            for kind in ("staging", "old")
        }
        for p in found["staging"]:
            self._remove(p, "a staging directory")
        old = found["old"]
        if old and not os.path.lexists(out):
            os.rename(old[-1], out)
            self._say(f"restored {out} from {old[-1].name}, where a killed run had moved it aside")
            old = old[:-1]
        for p in old:
            self._remove(p, "a replaced certificate set")

    def _remove(self, path: Path, what: str) -> None:
        if not _holds_only_ours(path):
            self._say(
                f"left {path} in place: it looks like {what} of a killed run but holds files moeaudit does not write"
            )
            return
        try:
            shutil.rmtree(path)
        except OSError as exc:
            self._say(
                f"could not remove {path}, {what} left by a killed moeaudit run "
                f"({exc.strerror or exc}); remove it by hand"
            )
            return
        self._say(f"removed {path}, {what} left by a killed moeaudit run")

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
            raise InputError(
                "the output path exists and is not a directory", path=out, hint="choose a new or empty --out directory"
            )
        if not out.is_dir():
            return
        entries = {p.name for p in out.iterdir()}
        foreign = sorted(entries - OURS)
        if foreign:
            raise InputError(
                f"the output directory holds other files ({', '.join(foreign[:3])}"
                f"{', …' if len(foreign) > 3 else ''}); a certificate's output set "
                "replaces the directory as a whole",
                path=out,
                hint="choose a new or empty --out directory",
            )
        if entries & OURS and not self.force:
            raise InputError(
                "a certificate already exists here", path=out / "certificate.json", hint="pass --force to replace it"
            )

    def commit(self) -> None:
        """Put the staged set in place: a rename when the output is new; otherwise the old set is
        moved aside, the new one renamed in, and the old one removed."""
        out = self.out_dir
        old = None
        try:
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
        except BaseException as exc:
            self._name_out(exc)
            raise
        self.committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _name_out(self, exc: BaseException) -> None:
        """An error about a file in the staging directory names that file under ``--out``: the
        user chose ``--out`` (a full disk, a permission), the staging path is ours."""
        staged = str(self.staging)

        def mapped(name: Any) -> Any:
            if isinstance(name, str) and (name == staged or name.startswith(staged + os.sep)):
                return str(self.out_dir) + name[len(staged) :]
            return name

        if isinstance(exc, OSError):
            exc.filename, exc.filename2 = mapped(exc.filename), mapped(exc.filename2)
        elif isinstance(exc, MoeauditError) and mapped(exc.path) != exc.path:
            exc.path = mapped(exc.path)
            exc.args = (exc.diagnostics(),)

    def __exit__(self, _type: Any, exc: BaseException | None, _tb: Any) -> None:
        try:
            if not self.committed:
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._unlock()
            if exc is not None:
                self._name_out(exc)


_HEX12 = re.compile(r"[0-9a-f]{12}")


def _left_by(path: Path, name: str, kind: str) -> bool:
    """``.NAME.staging-<12 hex>`` / ``.NAME.old-<12 hex>``, a real directory: what OutputSet
    creates for the output NAME."""
    prefix = f".{name}.{kind}-"
    return (
        path.name.startswith(prefix)
        and bool(_HEX12.fullmatch(path.name[len(prefix) :]))
        and path.is_dir()
        and not path.is_symlink()
    )


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def _holds_only_ours(path: Path) -> bool:
    """Only certificate files, receipts/ and atomic_write's temp files (``.NAME.….tmp``)."""
    try:
        names = [p.name for p in path.iterdir()]
    except OSError:
        return False
    return all(n in OURS or (n.startswith(".") and n.endswith(".tmp")) for n in names)


def refuse_inside(out: Path | str, audited: Iterable[Path], option: str = "--out") -> None:
    """Refuse an output path inside (or equal to) anything the command audits, before anything
    is written: a file written into a checkpoint changes its digest, so the certificate would fail
    its own recheck, and the lock and staging directory would land in the audited tree too."""
    if str(out) == "-":
        return
    target = _resolved(out)
    for item in audited:
        inside = _resolved(item)
        if target == inside or inside in target.parents:
            raise InputError(
                f"{option} is inside {item}, which this command audits: writing there would change the audited files",
                path=out,
                hint="write the output outside the audited checkpoints and run",
            )


def _resolved(path: Path | str) -> Path:
    """The real path; a link loop or an unreadable part is left as written (the command that
    reads it reports it)."""
    try:
        return Path(os.path.abspath(path)).resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop before Python 3.13
        return Path(os.path.abspath(path))
