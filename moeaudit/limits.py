"""Resource caps on untrusted inputs, and the bounded readers that enforce them.

Every file moeaudit reads on a user's say-so (certificate, key, policy, the run's JSONL logs) is
opened without blocking, checked to be a regular file, and read against a size cap *before* its
bytes are held: ``/dev/zero`` is refused instead of filling memory, a FIFO is refused instead of
hanging, a directory is named as one. JSONL logs are streamed line by line with a cap per line,
so a 200 MB line is refused after reading 4 MiB of it, and a long log is never one string.
The numbers, and why they are what they are, are in docs/security.md ("Resource caps").

Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from moeaudit.errors import InputError, from_os_error

MiB = 1 << 20

# The envelope series dominates a certificate, ~310 bytes per logged step and series (the healthy
# sample: 0.3 MB for 150 steps × 5 series); 256 MiB holds ~860k of them, e.g. 20 routed layers ×
# 40k logged steps. certify refuses to write a larger one, so verify reads all that certify writes.
MAX_CERTIFICATE_BYTES = 256 * MiB
MAX_KEY_BYTES = 64 * 1024  # a PEM key is under 1 KB
# A receipts JSON (a --reference) carries 3 × 1000 bootstrap replicates per routed layer, ~25 KB
# a layer: ~1.5 MB for 60 layers. 64 MiB is 40× that.
MAX_RECEIPTS_BYTES = 64 * MiB
# config.json is a few KB (Llama 4's vision-language config ~10 KB); a shard index ~100 bytes a
# tensor (~9 MB for DeepSeek-V3's ~91k FP8 tensors and scales).
MAX_CONFIG_BYTES = 16 * MiB
MAX_INDEX_BYTES = 64 * MiB
MAX_POLICY_BYTES = 1 * MiB  # the shipped policy is ~1.5 KB
# One metrics.jsonl line holds E norms per routed layer: ~22 bytes a norm, so 64 experts × 100
# layers is ~140 KB and 384 experts × 61 layers (the largest MoE layouts of 2025) is ~0.5 MB.
MAX_JSONL_LINE_BYTES = 4 * MiB
MAX_BOOTSTRAP = 100_000  # window-bootstrap resamples; 1000 is the default, 10⁴ plenty for a 95% CI
# Attention costs W·T² per layer: one 16k-token window replays in ~24 s on 2 CPU cores for the
# tiny sample model, 32k in ~92 s, 100k tokens would take ~15 min (docs/security.md).
MAX_WINDOW_TOKENS = 16_384
# Checkpoint files are read once into private memory and hashed as read (checkpoint/sealed.py;
# docs/decisions.md, "Read once"). Up to this many bytes of them are kept, so a checkpoint this small is read exactly
# once; a larger one keeps only 64 KiB-block digests and re-reads what the replay needs, each
# block proven against them, so peak memory stays at one decoder layer (docs/glossary.md, "Replay"; 27 % of the
# 4.3 GB benchmark checkpoint, docs/benchmarks.md §2 and §6).
PRIVATE_COPY_BYTES = 512 * MiB


def kind_of(mode: int) -> str:
    """'a character device', 'a named pipe (FIFO)', ... for a non-regular ``st_mode``."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path, what: str) -> BinaryIO:
    """``path`` opened for reading, after checking (on the open descriptor) it is a regular file.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise InputError(f"{what} not found", path=path) from exc
    except OSError as exc:
        raise from_os_error(exc, f"cannot read {what}", path) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"{what} is {kind_of(mode)}, not a regular file", path=path, hint="pass a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _too_big(what: str, size: int, limit: int, path: str | Path) -> InputError:
    return InputError(
        f"{what} is {size} bytes, over the {_human(limit)} limit",
        path=path,
        hint=f"a {what} is never that large; check that this is the right file",
    )


def _human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // 1024} KiB"


def read_regular(path: str | Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (size checked before reading)."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise _too_big(what, size, limit, path)
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise from_os_error(exc, f"cannot read {what}", path) from exc
    if len(data) > limit:  # it grew while we read it
        raise _too_big(what, len(data), limit, path)
    return data


class Hashed:
    """SHA-256 and length of exactly the bytes a reader took from one open file.

    A reader that parses a file feeds every byte it read here as it reads it, so the digest a
    certificate signs is of the bytes its numbers were parsed from, never of a second read of a
    path that may since name another file (docs/security.md, "One read per input")."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.size = 0

    def update(self, data: bytes) -> None:
        self._sha.update(data)
        self.size += len(data)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def record(self, name: str) -> dict[str, Any]:
        """The ``predicate.inputs`` entry: the file's name, SHA-256 and length as read."""
        return {"path": name, "sha256": self.sha256, "bytes": self.size}


def file_sha256(path: str | Path, what: str) -> str:
    """The SHA-256 (hex) of a regular file's bytes, streamed in 1 MiB blocks (:func:`open_regular`
    names ``what`` in its errors)."""
    digest = hashlib.sha256()
    with open_regular(path, what) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_hashed(data: bytes, name: str) -> dict[str, Any]:
    """The ``predicate.inputs`` entry of bytes already read whole (``read_regular``)."""
    h = Hashed()
    h.update(data)
    return h.record(name)


def hash_regular(path: str | Path, what: str) -> dict[str, Any]:
    """The ``predicate.inputs`` entry of a regular file that is bound but not parsed: one
    streamed read, nothing kept."""
    h = Hashed()
    with open_regular(path, what) as f:
        try:
            while chunk := f.read(MiB):
                h.update(chunk)
        except OSError as exc:
            raise from_os_error(exc, f"cannot read {what}", path) from exc
    return h.record(Path(path).name)


def iter_lines(
    path: str | Path, what: str, max_line: int = MAX_JSONL_LINE_BYTES, hashed: Hashed | None = None
) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, raw bytes without the newline, terminated) for each line of a text log.

    A line longer than ``max_line`` bytes is an input error naming ``file:line``; the line is
    never read past the cap. ``hashed`` is fed every byte read, newlines included: once the
    lines are exhausted it holds the digest of exactly the bytes yielded.
    """
    with open_regular(path, what) as f:
        n = 0
        while True:
            try:
                raw = f.readline(max_line + 1)
            except OSError as exc:
                raise from_os_error(exc, f"cannot read {what}", path) from exc
            if not raw:
                return
            if hashed is not None:
                hashed.update(raw)
            n += 1
            terminated = raw.endswith(b"\n")
            if len(raw) > max_line and not (terminated and len(raw) == max_line + 1):
                raise InputError(
                    f"line is longer than {_human(max_line)}",
                    path=f"{path}:{n}",
                    hint=f"a {what} line is never that long; check that this is the "
                    "right file (docs/security.md, resource caps)",
                )
            yield n, raw[:-1] if terminated else raw, terminated


def check_window_len(window_len: int, canary: str | Path | None = None) -> None:
    """Refuse canary windows longer than MAX_WINDOW_TOKENS before a replay starts: attention
    time grows as T² per window (memory only as T), so a 100k-token window takes many minutes."""
    if window_len > MAX_WINDOW_TOKENS:
        from moeaudit.errors import CanaryError

        raise CanaryError(
            f"canary windows are {window_len} tokens long; a replay takes windows of "
            f"at most {MAX_WINDOW_TOKENS} tokens (attention time grows as the square "
            "of the window length)",
            path=canary,
            hint="build the canary from shorter windows (docs/security.md)",
        )
