"""A strict, lazy reader of safetensors files.

Checkpoints are untrusted input. We parse the header ourselves so that every way a file can
be wrong has its own message (the checklist of ``huggingface/safetensors``), and read one
tensor at a time by offset: answering ``inspect`` never materialises a tensor, and a replay
holds only the tensors it asked for. Every read is pinned to the file the header came from
(``digest.pinned``): a file replaced or rewritten after its header was parsed is an error.

A checkpoint's weight files are opened ``sealed`` (docs/security.md, "One read per input"): the first tensor read, or
the root digest, reads the whole file once into private memory and hashes it (``sealed.seal``);
the header parsed earlier must be the header that was hashed, and every tensor comes from the
hashed bytes (the private copy, or a re-read proven block by block against the digests of that
one pass). Nothing is mapped: a writer sharing the file's pages cannot reach what is replayed.

Torch is imported only by the functions that build tensors, so reading headers (``inspect``,
``canary show``) does not pay for it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit.checkpoint.digest import FileId, changed, pinned, pread_into
from moeaudit.checkpoint.sealed import Sealed, seal
from moeaudit.errors import CheckpointError
from moeaudit.jsonio import DuplicateKey, no_duplicate_keys

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # same ceiling as the reference implementation

# safetensors dtype → (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (imports torch)."""
    import torch

    return getattr(torch, DTYPES[name][0])


# JSON objects whose keys repeat are refused: which entry wins is up to the parser, so a
# repeated tensor name would describe different bytes to different readers (one hook for every
# JSON moeaudit reads: moeaudit.jsonio).


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """Header of one ``.safetensors`` file, validated; tensors read on demand."""

    def __init__(self, path: str | Path, *, sealed: bool = False):
        self.path = Path(path)
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.identity: FileId | None = None  # the file the header was read from
        self.sealed = sealed  # tensors only from the hashed bytes (a checkpoint's weights)
        self._seal: Sealed | None = None
        self._head_sha256, self._head_len = b"", 0  # of the 8 + n header bytes parsed
        self._parse()

    def _fail(self, what: str, hint: str | None = None) -> CheckpointError:
        return CheckpointError(what, path=self.path, hint=hint)

    def _parse(self) -> None:
        got: dict[str, Any] = {}
        self.identity = pinned(self.path, None, lambda fd: got.update(self._read_header(fd)))
        raw, n, size = got["raw"], got["n"], got["size"]
        self._head_sha256 = hashlib.sha256(struct.pack("<Q", n) + raw).digest()
        self._head_len = 8 + n
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except DuplicateKey as exc:
            raise self._fail(
                f"header repeats the key {exc.key!r}", "the file was written by a non-standard writer; re-save it"
            ) from exc
        except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, huge ints
            raise self._fail(f"header is not valid JSON ({exc})", "not a safetensors file") from exc
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        self._load_entries(header, data_start=8 + n, data_len=size - 8 - n)

    def _read_header(self, fd: int) -> dict[str, Any]:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise self._fail(
                f"file is {size} bytes, too short for a safetensors header",
                "the file is truncated; copy it again",
            )
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise self._fail(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        if 8 + n > size:
            raise self._fail(
                f"header length {n} runs past the end of the {size}-byte file",
                "the file is truncated or not a safetensors file",
            )
        raw = bytearray(n)
        view, got = memoryview(raw), 0
        while got < n and (chunk := os.pread(fd, n - got, 8 + got)):
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        if got != n:
            raise self._fail("file ended inside its header", "the file changed while reading")
        return {"raw": raw, "n": n, "size": size}

    def _load_entries(self, header: dict[str, Any], data_start: int, data_len: int) -> None:
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._fail("__metadata__ must map strings to strings")
        self.metadata = meta
        spans = []
        for name, entry in header.items():
            info = self._entry(name, entry, data_start, data_len)
            self.tensors[name] = info
            spans.append((info.begin, info.end, name))
        spans.sort()
        for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise self._fail(f"tensors {n0!r} and {n1!r} overlap in the data section")
        self._check_covered(spans, data_start, data_start + data_len)

    def _check_covered(self, spans: list[tuple[int, int, str]], start: int, end: int) -> None:
        """Tensors tile the data section exactly, as the reference reader requires (it refuses
        gaps and trailing bytes), so no byte of the file is digested but never read."""
        hint = "the file was padded or rewritten by a non-standard writer; re-save it"
        for begin, stop, _name in spans:
            if begin != start:
                raise self._fail(f"{begin - start} bytes at offset {start} belong to no tensor", hint)
            start = stop
        if start != end:
            raise self._fail(f"{end - start} bytes after the last tensor belong to no tensor", hint)

    def _entry(self, name: str, entry: Any, data_start: int, data_len: int) -> TensorInfo:
        if not isinstance(entry, dict) or {"dtype", "shape", "data_offsets"} - set(entry):
            raise self._fail(f"tensor {name!r}: entry needs dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self._fail(f"tensor {name!r}: unsupported dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise self._fail(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise self._fail(f"tensor {name!r}: data_offsets {offsets!r} are invalid")
        begin, end = offsets
        if end > data_len:
            raise self._fail(
                f"tensor {name!r}: data_offsets end {end} past the {data_len}-byte data section",
                "the file is truncated; copy it again",
            )
        want = math.prod(shape) * DTYPES[dtype][1]
        if end - begin != want:
            raise self._fail(f"tensor {name!r}: {end - begin} bytes on disk but shape {shape} {dtype} needs {want}")
        return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)

    def seal(self) -> Sealed:
        """Read and hash the whole file once (``sealed.seal``), checking that its header is the
        one parsed; idempotent. Every later tensor read is served from what this hashed."""
        if self._seal is None:
            sealed = seal(self.path, self.identity)
            head = bytearray(self._head_len)
            if sealed.read_into(0, head) != len(head) or hashlib.sha256(head).digest() != self._head_sha256:
                raise changed(self.path, "its header is not the one read before it was hashed")
            self._seal = sealed
        return self._seal

    def _read_bytes(self, name: str) -> bytearray:
        info = self.tensors[name]
        buf = bytearray(info.end - info.begin)
        try:
            if self.sealed:
                got = self.seal().read_into(info.begin, buf)
            else:
                got = pread_into(self.path, self.identity, info.begin, buf)
        except CheckpointError as exc:
            what = (
                f"{exc.what} (reading tensor {name!r})" if self.sealed else f"cannot read tensor {name!r}: {exc.what}"
            )
            raise self._fail(what, exc.hint) from exc
        if got != len(buf):
            raise self._fail(f"tensor {name!r}: file ended early", "the file changed while reading")
        return buf

    def _aliased(self, name: str) -> memoryview | None:
        """The tensor's bytes as a view of the private copy, where the host plan allows it."""
        info = self.tensors[name]
        try:
            return self.seal().view(info.begin, info.end - info.begin)
        except CheckpointError as exc:
            raise self._fail(f"{exc.what} (reading tensor {name!r})", exc.hint) from exc

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor in its on-disk dtype: a fresh, writable CPU tensor, or under a host plan
        that aliases (``sealed.HostPlan``, a replay on an accelerator) a view of the private copy
        that callers only convert or copy."""
        import torch

        info = self.tensors[name]
        dtype = torch_dtype(info.dtype)
        if self.sealed and info.end > info.begin and (view := self._aliased(name)) is not None:
            return torch.frombuffer(view, dtype=dtype).reshape(info.shape)
        buf = self._read_bytes(name)
        if not buf:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)

    def read_raw(self, name: str) -> bytearray:
        """One tensor's stored bytes (little-endian, row-major), as a fresh buffer; no numpy or
        torch needed (the canary reads its int32 tensors so)."""
        return self._read_bytes(name)


def write_safetensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors atomically (temp file + rename) with deterministic bytes: tensors in sorted
    key order, header JSON with sorted keys (``__metadata__`` too), padded with spaces to a
    multiple of 8 — the layout the reference writer produces, minus its hash-map key order."""
    import torch

    names = {torch_dtype(name): name for name in DTYPES}
    from moeaudit.jsonio import check_output_target

    path = Path(path)
    check_output_target(path, force=True)  # never replace a device, FIFO or link (docs/security.md)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    blobs, offset = [], 0
    for name, tensor in sorted(tensors.items()):
        t = tensor.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for raw in blobs:
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
