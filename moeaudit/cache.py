"""Receipts cache: re-auditing an unchanged run costs almost nothing (docs/benchmarks.md §4).

Entries are JSON documents keyed by SHA-256 of (kind, checkpoint root digest(s), canary digest,
tool version, receipt settings, the machine that computes them: ``replay_machine``). They live
under ``$MOEAUDIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/moeaudit``, else ``~/.cache/moeaudit``.
Writes are atomic (temp + rename), so concurrent runs at worst compute the same entry twice.

A cached number ends up in a signed certificate, so an entry is trusted only if this machine's
moeaudit wrote it (docs/decisions.md, "Receipts cache"): every entry carries an HMAC-SHA256 over its key and content,
keyed by a local secret (``hmac.key`` in the cache directory, 32 random bytes, mode 0600,
created once). An entry that is absent, unreadable, malformed, of the wrong shape, for another
key, or whose MAC does not verify is a miss: it is recomputed, never trusted and never an error.
Every cache file is opened without blocking and checked to be a regular file before it is read:
a FIFO or device planted as ``hmac.key`` turns the cache off with a warning, one planted as an
entry is a miss named in a warning — never a hang (docs/security.md, "Resource caps").
``served`` lists the keys answered from the cache, so a certificate can say which receipts
were not recomputed by the run that signed them.

Tensor entries (safetensors, never pickle) hold a baseline's anchor states, so that adding one
checkpoint to a run replays only that checkpoint: its pair receipts need the baseline's states
(`003` §5), which the baseline's cached receipts do not carry. They are N·H floats per routed
layer, so entries above ``TENSORS_MAX_BYTES`` are not written (the baseline is then replayed).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import platform
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit import __version__
from moeaudit.errors import MoeauditError
from moeaudit.jsonio import atomic_write, dumps
from moeaudit.limits import kind_of

if TYPE_CHECKING:
    import torch

TENSORS_MAX_BYTES = 1 << 30  # z and y of a 4096-token canary at H = 4096 over 8 routed layers
# A JSON entry is one receipts document (~1.5 MB for 60 routed layers) or a compiled template;
# a larger file under an entry's name is not ours and is not read.
ENTRY_MAX_BYTES = 256 << 20
SECRET_NAME = "hmac.key"
SECRET_BYTES = 32
MAC_DOMAIN = b"moeaudit.cache/v1\0"
# Reading a cache entry may fail in any of these ways; each is a miss, never an error (and
# never a hang: entries are opened without blocking, see _read_small).
_BAD_ENTRY = (OSError, ValueError, TypeError, LookupError, AttributeError, RecursionError)
# Writing one may fail in these: a slower next run, not a failure (MoeauditError: the name is
# taken by something atomic_write will not replace, e.g. a FIFO).
_UNWRITABLE = (OSError, ValueError, MoeauditError)


def replay_machine(device: str | None) -> dict[str, str]:
    """What a replay's bits depend on besides its inputs (docs/decisions.md, "The GPU model is in
    the cache key"): receipts are bit-identical on the same device model, driver and torch version, not across them. On
    the CPU: the device name, torch version and the SIMD level torch's kernels use; on a GPU
    (:func:`moeaudit.replay.device.describe_device`): model, compute capability, CUDA runtime,
    driver, cuDNN and torch. The CPU's is read without importing torch, so that a fully cached
    certify still never loads it (docs/decisions.md, "A fully cached certify loads neither torch
    nor numpy")."""
    if device is None or device.split(":")[0] == "cpu":
        return {"device": device or "cpu", "torch": _torch_version(), "cpu": cpu_capability()}
    from moeaudit.replay.device import describe_device

    return describe_device(device)


def _torch_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")  # the same string as torch.__version__
    except importlib.metadata.PackageNotFoundError:
        import torch

        return torch.__version__


_X86 = {"x86_64", "amd64", "i386", "i686", "x86"}


def cpu_capability() -> str:
    """``torch.backends.cpu.get_cpu_capability()`` without importing torch: the machine and the
    widest kernel set torch dispatches to on it — ATEN_CPU_CAPABILITY when set, else on x86
    AVX512 (AVX-512 F/BW/VL/DQ and FMA) or AVX2 (AVX2 and FMA) or DEFAULT, the rules of ATen's
    ``cpuinfo`` dispatch; other architectures by name (their kernel level is not split here)."""
    machine = platform.machine().lower() or "unknown"
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if forced:
        return f"{machine} {forced.upper()}"
    if machine not in _X86:
        return machine
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return f"{machine} AVX512"
    return f"{machine} {'AVX2' if {'avx2', 'fma'} <= flags else 'DEFAULT'}"


def _cpu_flags() -> set[str]:
    try:
        text = _read_small(Path("/proc/cpuinfo"), 1 << 22)[0].decode("ascii", "replace")
    except (OSError, ValueError):  # not Linux: no flags read, the machine name alone
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cache_dir() -> Path:
    if os.environ.get("MOEAUDIT_CACHE_DIR"):
        return Path(os.environ["MOEAUDIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moeaudit"


class SecretUnusable(Exception):
    """The cache's key file exists but cannot be trusted (the cache is then not used)."""


def load_or_create_secret(root: Path) -> bytes:
    """The cache's HMAC key: read ``root/hmac.key``, or create it if absent.

    Creation is race-free: the random bytes go to a private temp file (O_EXCL, 0600), which is
    then hard-linked to the final name — link fails if the name exists, so of two processes
    creating it at once exactly one wins, and the other reads the winner's complete file.
    """
    path = root / SECRET_NAME
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{SECRET_NAME}.", dir=root)  # O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process won the race: use its key
        except OSError:  # a filesystem without hard links: exclusive create instead
            _create_exclusive(path, Path(tmp).read_bytes())
    finally:
        Path(tmp).unlink(missing_ok=True)
    return _read_secret(path)


def _create_exclusive(path: Path, secret: bytes) -> None:
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
        f.flush()
        os.fsync(f.fileno())


_READ_FLAGS = (
    os.O_RDONLY
    | os.O_NONBLOCK
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class SpecialFile(OSError):
    """A cache path that is not a regular file (a FIFO, device, socket or directory)."""


def _read_small(path: Path, limit: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``path`` (at most ``limit``) and its stat. Opened without
    blocking and never following a link, and checked on the open descriptor before any read: a
    FIFO planted in the cache returns at once (SpecialFile) instead of hanging the run."""
    fd = os.open(path, _READ_FLAGS)  # O_NONBLOCK: opening a FIFO does not wait for a writer
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecialFile(errno.EINVAL, f"{kind_of(st.st_mode)}, not a regular file", str(path))
        if st.st_size > limit:
            raise ValueError(f"{path} is {st.st_size} bytes, over {limit}")
        os.set_blocking(fd, True)
        return f.read(limit + 1), st


def _read_secret(path: Path) -> bytes:
    hint = "; delete it and moeaudit creates a new one (cached receipts are then recomputed)"
    try:
        secret, st = _read_small(path, SECRET_BYTES)
    except FileNotFoundError:
        raise
    except SpecialFile as exc:
        raise SecretUnusable(f"{path} is {exc.strerror}{hint}") from exc
    except ValueError as exc:
        raise SecretUnusable(f"{path} is not a {SECRET_BYTES}-byte key{hint}") from exc
    except OSError as exc:
        raise SecretUnusable(f"cannot read {path} ({exc.strerror or exc})") from exc
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise SecretUnusable(f"{path} belongs to another user{hint}")
    if st.st_mode & 0o077:
        raise SecretUnusable(f"{path} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o}){hint}")
    if len(secret) != SECRET_BYTES:
        raise SecretUnusable(f"{path} is not a {SECRET_BYTES}-byte key{hint}")
    return secret


def _canonical(document: Any) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


class ReceiptsCache:
    def __init__(self, root: Path | None = None, enabled: bool = True, warn: Callable[[str], None] | None = None):
        self.root = root or cache_dir()
        self.enabled = enabled
        self.warnings: list[str] = []  # entries ignored because they are not regular files
        self._warn = warn
        self.hits = self.misses = 0
        self.served: list[str] = []  # keys answered from the cache, in order
        self._problem: str | None = None
        self._secret: bytes | None = None

    @staticmethod
    def key(kind: str, *parts: Any) -> str:
        material = json.dumps([kind, __version__, *parts], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(material.encode()).hexdigest()

    # ----- authentication ----------------------------------------------------------------

    @property
    def problem(self) -> str | None:
        """Why the cache is off although it was enabled (its key file cannot be trusted or
        created), or None."""
        self._usable()
        return self._problem

    def _usable(self) -> bool:
        """Enabled and holding its key (created on first use); False turns the cache off."""
        if not self.enabled:
            return False
        if self._secret is None:
            try:
                self._secret = load_or_create_secret(self.root)
            except SecretUnusable as exc:
                self._problem = f"receipts cache not used: {exc}"
                self.enabled = False
                return False
            except OSError as exc:  # no cache directory can be made: a slower run, not a failure
                self._problem = f"receipts cache not used: {exc.strerror or exc}"
                self.enabled = False
                return False
        return True

    def _mac(self, kind: bytes, key: str, *parts: bytes) -> str:
        assert self._secret is not None
        h = hmac.new(self._secret, MAC_DOMAIN + kind + b"\0" + key.encode() + b"\0", "sha256")
        for part in parts:
            h.update(part)
        return h.hexdigest()

    def _read_entry(self, path: Path) -> bytes | None:
        """An entry's bytes, or None (a miss). A special file under an entry's name is named in
        a warning: it cannot be a moeaudit entry, and it is never waited on."""
        try:
            return _read_small(path, ENTRY_MAX_BYTES)[0]
        except SpecialFile as exc:
            self._note(f"receipts cache entry {path} is {exc.strerror}: ignored, recomputed (delete it)")
        except (OSError, ValueError):
            pass
        return None

    def _note(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            if self._warn is not None:
                self._warn(f"warning: {message}")

    def _served(self, key: str) -> None:
        self.hits += 1
        self.served.append(key)

    # ----- opaque bytes (compiled certificate templates) -----------------------------------

    def _bytes_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.bin"

    def get_bytes(self, key: str) -> bytes | None:
        """Bytes stored under ``key`` by this machine's moeaudit, or None. Used for Jinja2's
        compiled templates (marshalled code), so the MAC is checked before anything reads them."""
        if not self._usable():
            return None
        raw = self._read_entry(self._bytes_path(key))
        if raw is None:
            return None
        mac, sep, data = raw.partition(b"\n")
        if not sep or not hmac.compare_digest(mac, self._mac(b"bytes", key, data).encode()):
            return None
        return data

    def put_bytes(self, key: str, data: bytes) -> None:
        if not self._usable():
            return
        path = self._bytes_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, self._mac(b"bytes", key, data).encode() + b"\n" + data)
        except _UNWRITABLE:
            pass  # a slower next run, not a failure

    # ----- JSON documents ----------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str, check: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any] | None:
        """The document stored under ``key`` if this machine's moeaudit wrote it and ``check``
        (the caller's shape test) accepts it; else None (counted as a miss)."""
        if not self._usable():
            return None
        try:
            raw = self._read_entry(self._path(key))
            if raw is None:
                raise ValueError("no entry")
            entry = json.loads(raw.decode("utf-8"))
            document, mac = entry["document"], entry["mac"]
            ok = (
                entry["key"] == key
                and isinstance(document, dict)
                and isinstance(mac, str)
                and hmac.compare_digest(mac, self._mac(b"json", key, _canonical(document)))
                and (check is None or bool(check(document)))
            )
        except _BAD_ENTRY:
            ok = False
        if not ok:
            self.misses += 1
            return None
        self._served(key)
        return document

    def put(self, key: str, document: Mapping[str, Any]) -> None:
        if not self._usable():
            return
        path = self._path(key)
        try:
            # the MAC is over the document as it will be read back (JSON turns tuples into lists,
            # keys into strings), so a stored entry verifies
            stored = json.loads(_canonical(document))
            entry = {"key": key, "mac": self._mac(b"json", key, _canonical(stored)), "document": stored}
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, dumps(entry))
        except _UNWRITABLE:
            pass  # a cache that cannot be written (or a non-finite document) is a slower run

    # ----- tensors -----------------------------------------------------------------------

    def _tensor_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def _tensor_mac(self, key: str, tensors: dict[str, Any]) -> str:
        """Over every tensor's name, dtype, shape and bytes, in name order (not over the file's
        header bytes, which the writer may lay out as it likes)."""
        parts = []
        for name in sorted(tensors):
            t = tensors[name].detach().contiguous().cpu()
            raw = t.reshape(-1).view(_uint8()).numpy().tobytes() if t.numel() else b""
            head = json.dumps([name, str(t.dtype), list(t.shape), len(raw)]).encode()
            parts += [len(head).to_bytes(8, "little"), head, raw]
        return self._mac(b"tensors", key, *parts)

    def get_tensors(self, key: str) -> dict[str, torch.Tensor] | None:
        """Tensors stored under ``key``, or None (disabled, absent, corrupt, foreign or forged)."""
        if not self._usable():
            return None
        from moeaudit.checkpoint.safetensors import SafetensorsFile

        path = self._tensor_path(key)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = stat.S_IFREG  # absent: SafetensorsFile says so below
        if not stat.S_ISREG(mode):
            self._note(
                f"receipts cache entry {path} is {kind_of(mode)}, not a regular file: ignored, recomputed (delete it)"
            )
        try:
            f = SafetensorsFile(path)
            mac = f.metadata.get("mac", "")
            ok = f.metadata.get("key") == key and bool(mac) and bool(f.tensors)
            tensors = {name: f.read(name) for name in f.tensors} if ok else {}
            ok = ok and hmac.compare_digest(mac, self._tensor_mac(key, tensors))
        except (*_BAD_ENTRY, MoeauditError):
            ok = False
        if not ok:
            self.misses += 1
            return None
        self._served(key)
        return tensors

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Store ``tensors`` under ``key`` unless disabled or larger than TENSORS_MAX_BYTES."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > TENSORS_MAX_BYTES or not self._usable():
            return False
        from moeaudit.checkpoint.safetensors import write_safetensors

        path = self._tensor_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(path, tensors, metadata={"key": key, "mac": self._tensor_mac(key, tensors)})
        except _UNWRITABLE:
            return False
        return True


def _uint8() -> Any:
    import torch

    return torch.uint8
