"""torch.distributed.checkpoint (DCP) directories, read without general unpickling.

torchtitan, OLMo-core and Megatron's torch_dist format save mid-run checkpoints as a directory
with a pickled ``.metadata`` (what each tensor is and where its chunks are) and ``__R_I.distcp``
files holding the chunks. Both are pickles in torch's own reader; here neither is unpickled in
general:

* ``.metadata`` goes through :class:`MetadataUnpickler`, whose ``find_class`` answers only the
  globals a real torch 2.x ``.metadata`` names (the DCP metadata dataclasses, ``_StorageInfo``,
  ``torch.Size``, dtypes, the layout and memory-format encodings, ``pathlib`` paths) — each
  with an inert stand-in of ours, so not even torch's own classes run. Any other global is
  refused, naming it, before it is called.
* each tensor chunk is a ``torch.save`` zip archive at ``[offset, offset + length)`` of its
  ``.distcp`` file (``filesystem._write_item``, the default ``SerializationFormat.TORCH_SAVE``).
  Its zip directory is read with :mod:`zipfile`; its ``data.pkl`` (storage offset, size and
  strides) goes through :class:`TensorUnpickler`, which knows only ``_rebuild_tensor_v2``,
  typed-storage names (stand-ins again) and the empty hooks ``OrderedDict``, and maps persistent
  ids to storage records; the bytes are the archive's ``data/<key>`` record, CRC-checked and
  used in place.

Only whole tensors are returned: a tensor saved as several chunks (FSDP/TP shards) is
reassembled after checking that its chunks tile it exactly. ``BytesStorageMetadata`` entries
(optimizer step counters, dataloader state: pickles) are never read.

Names: a DCP whose keys are already Hugging Face names (``dcp.save(model.state_dict())`` of a
transformers model, optionally under torchtitan's ``model.`` wrapper prefix) is read as is;
torchtitan names are mapped with the tables below (data, not code).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import re
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from moeaudit.checkpoint.digest import FileId, pinned, read_bytes
from moeaudit.checkpoint.safetensors import DTYPES, TensorInfo
from moeaudit.checkpoint.sealed import Sealed, seal
from moeaudit.errors import CheckpointError
from moeaudit.spec.torchtitan import TORCHTITAN_COMMON

if TYPE_CHECKING:
    import torch

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 256 * 1024 * 1024
TORCH_SAVE_MAGIC = b"PK\x03\x04"
REFUSED_HINT = "the file is not a DCP .metadata written by torch.distributed.checkpoint; do not load it"

# torch dtype name → safetensors dtype name (what TensorInfo and the layout checks speak)
ST_DTYPE = {torch_name: st for st, (torch_name, _size) in DTYPES.items()}
ITEMSIZE = {torch_name: size for _st, (torch_name, size) in DTYPES.items()}
# typed-storage class names torch.save writes (torch/storage.py) → dtype name
STORAGE_DTYPE = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "Float8_e4m3fnStorage": "float8_e4m3fn",
    "Float8_e5m2Storage": "float8_e5m2",
}
LAYOUTS = {"torch.strided"}
MEM_FORMATS = {0, 1, 2}  # metadata._MEM_FORMAT_ENCODING: contiguous, channels_last, preserve


# ----- the allow-list unpicklers ---------------------------------------------------------------


class _Record:
    """An inert stand-in for one allowed class: ``NEWOBJ`` makes it, ``BUILD`` fills it."""

    state: Any = None

    def __init__(self) -> None:  # REDUCE with arguments is a TypeError: no real pickle does it
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
            state = state[0]  # (dict, slots) form
        self.state = state

    def get(self, name: str, default: Any = None) -> Any:
        return self.state.get(name, default) if isinstance(self.state, dict) else default


class _Metadata(_Record): ...


class _TensorStorageMetadata(_Record): ...


class _BytesStorageMetadata(_Record): ...


class _ChunkStorageMetadata(_Record): ...


class _TensorProperties(_Record): ...  # state: (dtype, layout, requires_grad, mem_format, pin)


class _MetadataIndex(_Record): ...


class _StorageMeta(_Record): ...


class _StorageInfo(_Record): ...


@dataclass(frozen=True)
class _DType:
    name: str


def _size(dims: Any = ()) -> tuple[int, ...]:
    """torch.Size(...) → a tuple of non-negative ints."""
    dims = tuple(dims)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"torch.Size of {dims!r}")
    return dims


def _layout(name: Any) -> str:
    if name not in LAYOUTS:
        raise ValueError(f"tensor layout {name!r} (only dense strided tensors are read)")
    return str(name)


def _mem_format(code: Any) -> int:
    if code not in MEM_FORMATS or isinstance(code, bool):
        raise ValueError(f"memory-format code {code!r}")
    return int(code)


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("a path of non-strings")
    return str(PurePosixPath(*parts)) if parts else ""


_DCP = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): _Metadata,
    (_DCP, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_DCP, "TensorProperties"): _TensorProperties,
    (_DCP, "MetadataIndex"): _MetadataIndex,
    (_DCP, "StorageMeta"): _StorageMeta,
    (_DCP, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): _DType(name) for name in ITEMSIZE},
}


def _refused(module: str, name: str, where: Path) -> CheckpointError:
    return CheckpointError(
        f"refusing to unpickle global {module}.{name}: not a DCP metadata class", path=where, hint=REFUSED_HINT
    )


class MetadataUnpickler(pickle.Unpickler):
    """Answers only :data:`METADATA_GLOBALS` (inert stand-ins); anything else is refused
    before it is looked up, let alone called. Persistent ids are refused too (the base
    class raises ``UnpicklingError``)."""

    allowed: dict[tuple[str, str], Any] = METADATA_GLOBALS

    def __init__(self, raw: bytes, where: Path):
        super().__init__(io.BytesIO(raw))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise _refused(str(module), str(name), self.where) from None


@dataclass(frozen=True)
class _StorageRef:
    dtype: str
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _TensorRef:
    if not isinstance(storage, _StorageRef) or not isinstance(storage_offset, int):
        raise ValueError("a tensor record without a storage")
    if backward_hooks or metadata:
        raise ValueError("a tensor record with hooks or metadata")
    return _TensorRef(storage, storage_offset, _size(size), _size(stride))


TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): _DType(dtype) for name, dtype in STORAGE_DTYPE.items()},
}


class TensorUnpickler(MetadataUnpickler):
    """A ``torch.save`` archive's ``data.pkl``: one tensor record, nothing else."""

    allowed = TENSOR_GLOBALS

    def persistent_load(self, pid: Any) -> _StorageRef:
        # ('storage', storage_type, key, location, numel), torch/serialization.py persistent_id
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _DType)
            and isinstance(pid[2], str)
            and isinstance(pid[4], int)
            and pid[4] >= 0
        ):
            raise ValueError(f"persistent id {pid!r} is not a storage")
        return _StorageRef(pid[1].name, pid[2], pid[4])


_UNPICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    TypeError,
    ValueError,
    AttributeError,
    IndexError,
    KeyError,
    RecursionError,
    UnicodeDecodeError,
    OverflowError,
)


class _View(io.RawIOBase):
    """A seekable read-only file over a memoryview (``zipfile`` without copying the buffer)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos + (0, self.pos, len(self.view))[whence])
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n


def _stored_range(raw: bytearray, info: zipfile.ZipInfo) -> range:
    """The bytes of an uncompressed zip member, after its local header, CRC-checked."""
    head = bytes(raw[info.header_offset : info.header_offset + 30])
    if len(head) != 30 or not head.startswith(TORCH_SAVE_MAGIC):
        raise ValueError(f"no local header for {info.filename}")
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    if info.compress_size != info.file_size or start + info.file_size > len(raw):
        raise ValueError(f"{info.filename} runs past its archive")
    if zlib.crc32(memoryview(raw)[start : start + info.file_size]) != info.CRC:
        raise ValueError(f"{info.filename} fails its CRC")
    return range(start, start + info.file_size)


# ----- the metadata as plain data --------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative path of its .distcp
    begin: int  # byte range of its torch.save record
    length: int


@dataclass(frozen=True)
class DcpTensor:
    fqn: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


def _chunks_tile(shape: tuple[int, ...], chunks: list[Chunk]) -> str | None:
    """Why the chunks do not cover the tensor exactly once (None when they do)."""
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            return f"a chunk of rank {len(c.sizes)} for a tensor of rank {len(shape)}"
        if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            return f"chunk at {list(c.offsets)} of size {list(c.sizes)} runs past {list(shape)}"
    boxes = [c for c in chunks if 0 not in c.sizes]  # an empty chunk overlaps nothing
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap"
    covered = sum(math.prod(c.sizes) for c in chunks)
    if covered != math.prod(shape):
        return f"chunks cover {covered} of {math.prod(shape)} elements"
    return None


class DcpDirectory:
    """The ``.metadata`` of a DCP directory, validated; whole tensors read on demand by their
    DCP name (``read``) or, through ``tensors``/``read``, by Hugging Face name once
    :meth:`map_names` has run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta_path = self.path / METADATA_NAME
        self.pins: dict[str, FileId] = {}
        if self.meta_path.is_file() and (size := self.meta_path.stat().st_size) > MAX_METADATA_BYTES:
            raise self._fail(f"{size} bytes, over the {MAX_METADATA_BYTES}-byte limit")
        raw, self.pins[METADATA_NAME] = read_bytes(self.meta_path)
        # of the bytes unpickled (docs/security.md, "One read per input")
        self.meta_sha256 = hashlib.sha256(raw).digest()
        self.sealed: dict[str, Sealed] = {}  # .distcp file → read once and hashed (sealed.py)
        if len(raw) > MAX_METADATA_BYTES:  # grew since
            raise self._fail(f"{len(raw)} bytes, over the {MAX_METADATA_BYTES}-byte limit")
        self.entries: dict[str, DcpTensor] = {}
        self.byte_entries: list[str] = []
        self._load(raw)
        # filled by map_names: Hugging Face name → how to make it
        self.tensors: dict[str, TensorInfo] = {}
        self._sources: dict[str, tuple[str, ...]] = {}

    def _fail(self, what: str, hint: str | None = None, path: Path | None = None) -> CheckpointError:
        return CheckpointError(what, path=path or self.meta_path, hint=hint)

    # ----- .metadata -------------------------------------------------------------------------

    def _load(self, raw: bytes) -> None:
        try:
            meta = MetadataUnpickler(raw, self.meta_path).load()
        except CheckpointError:
            raise
        except (*_UNPICKLE_ERRORS, MemoryError) as exc:
            raise self._fail(
                f"unreadable DCP metadata ({type(exc).__name__}: {exc})",
                "the file is truncated or not written by torch.distributed.checkpoint",
            ) from None
        if not isinstance(meta, _Metadata) or not isinstance(meta.state, dict):
            raise self._fail("not a DCP Metadata record")
        sd_meta, storage = meta.get("state_dict_metadata"), meta.get("storage_data")
        if not isinstance(sd_meta, dict) or not isinstance(storage, dict):
            raise self._fail(
                "DCP metadata without state_dict_metadata and storage_data",
                "only checkpoints of torch.distributed.checkpoint's FileSystemWriter are read",
            )
        where: dict[tuple[str, tuple[int, ...]], Chunk] = {}
        for index, info in storage.items():
            if not isinstance(index, _MetadataIndex) or not isinstance(info, _StorageInfo):
                raise self._fail("storage_data entry of the wrong type")
            fqn, offset = index.get("fqn"), index.get("offset")
            if offset is None:  # a bytes entry
                continue
            chunk = self._chunk(fqn, info)
            where[(fqn, offset)] = chunk
        for fqn, entry in sd_meta.items():
            if not isinstance(fqn, str):
                raise self._fail(f"state_dict_metadata key {fqn!r} is not a string")
            if isinstance(entry, _BytesStorageMetadata):
                self.byte_entries.append(fqn)
            elif isinstance(entry, _TensorStorageMetadata):
                self.entries[fqn] = self._tensor(fqn, entry, where)
            else:
                raise self._fail(f"entry {fqn!r} is neither tensor nor bytes metadata")

    def _chunk(self, fqn: Any, info: _StorageInfo) -> Chunk:
        rel, begin, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if info.get("transform_descriptors"):
            raise self._fail(
                f"{fqn!r} is stored through transforms {info.get('transform_descriptors')!r}",
                "compressed or otherwise transformed DCP entries are not read",
            )
        if not isinstance(rel, str) or PurePosixPath(rel).name != rel or rel in ("", ".", ".."):
            raise self._fail(f"{fqn!r} names storage file {rel!r}, not a file of this directory")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (begin, length)):
            raise self._fail(f"{fqn!r} has byte range {begin!r}+{length!r}")
        if rel not in self.pins:
            file = self.path / rel
            if not file.is_file():
                raise self._fail(
                    f"{fqn!r} is stored in {rel}, which is missing", "the checkpoint is incomplete; copy it again"
                )
            self.pins[rel] = pinned(file, None, lambda _fd: None)
        size = self.pins[rel].size
        if begin + length > size:
            raise self._fail(
                f"{fqn!r}: bytes {begin}..{begin + length} run past the end of the {size}-byte file",
                "the file is truncated; copy it again",
                self.path / rel,
            )
        return Chunk((), (), rel, begin, length)

    def _tensor(
        self, fqn: str, entry: _TensorStorageMetadata, where: dict[tuple[str, tuple[int, ...]], Chunk]
    ) -> DcpTensor:
        props, shape, chunks = entry.get("properties"), entry.get("size"), entry.get("chunks")
        pstate = props.state if isinstance(props, _TensorProperties) else None
        dtype = pstate[0] if isinstance(pstate, tuple) and pstate else None
        if not isinstance(dtype, _DType):
            raise self._fail(f"tensor {fqn!r} has no dtype")
        if not isinstance(shape, tuple) or not isinstance(chunks, list) or not chunks:
            raise self._fail(f"tensor {fqn!r} has no size or no chunks")
        placed = []
        for c in chunks:
            ok = isinstance(c, _ChunkStorageMetadata)
            offsets, sizes = (c.get("offsets"), c.get("sizes")) if ok else (None, None)
            if not isinstance(offsets, tuple) or not isinstance(sizes, tuple):
                raise self._fail(f"tensor {fqn!r} has a malformed chunk")
            stored = where.get((fqn, offsets))
            if stored is None:
                raise self._fail(f"tensor {fqn!r}: chunk at {list(offsets)} has no storage entry")
            placed.append(Chunk(offsets, sizes, stored.file, stored.begin, stored.length))
        if why := _chunks_tile(shape, placed):
            raise self._fail(f"tensor {fqn!r}: {why}", "the checkpoint's shards do not form whole tensors")
        return DcpTensor(fqn, dtype.name, shape, tuple(placed))

    # ----- tensor bytes -------------------------------------------------------------------------

    def read_entry(self, fqn: str) -> torch.Tensor:
        """The whole tensor ``fqn`` (DCP name), reassembled from its chunks."""
        import torch

        entry = self.entries[fqn]
        dtype = getattr(torch, entry.dtype)
        if len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
            return self._read_chunk(entry, entry.chunks[0], dtype)
        out = torch.empty(entry.shape, dtype=dtype)
        for c in entry.chunks:
            index = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
            out[index] = self._read_chunk(entry, c, dtype)
        return out

    def _read_chunk(self, entry: DcpTensor, c: Chunk, dtype: torch.dtype) -> torch.Tensor:
        import torch

        file = self.path / c.file
        buf = bytearray(c.length)
        got = self._sealed(c.file).read_into(c.begin, buf)
        name = f"tensor {entry.fqn!r}"
        if got != c.length:
            raise self._fail(f"{name}: file ended early", "the file is truncated; copy it again", file)
        if not buf.startswith(TORCH_SAVE_MAGIC):
            raise self._fail(
                f"{name}: bytes at {c.begin} are not a torch.save record",
                "only DCP's default torch_save serialization format is read",
                file,
            )
        ref, data = self._archive(name, buf, file)
        if ref.storage.dtype != entry.dtype:
            raise self._fail(f"{name}: stored as {ref.storage.dtype}, metadata says {entry.dtype}", path=file)
        if ref.size != c.sizes:
            raise self._fail(f"{name}: stored chunk is {list(ref.size)}, metadata says {list(c.sizes)}", path=file)
        itemsize = ITEMSIZE[entry.dtype]
        if len(data) != ref.storage.numel * itemsize:
            raise self._fail(
                f"{name}: storage holds {len(data)} bytes, not {ref.storage.numel} × {itemsize}", path=file
            )
        numel = math.prod(ref.size)
        if numel == 0:
            return torch.empty(ref.size, dtype=dtype)
        last = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))
        if len(ref.stride) != len(ref.size) or last >= ref.storage.numel:
            raise self._fail(f"{name}: view runs past its {ref.storage.numel}-element storage", path=file)
        flat = torch.frombuffer(buf, dtype=dtype, offset=data.start, count=ref.storage.numel)
        view = flat.as_strided(ref.size, ref.stride, ref.offset)
        if view.is_contiguous() and numel == ref.storage.numel:
            return view  # the whole storage, in order: a view into our own fresh buffer
        return view.clone(memory_format=torch.contiguous_format)

    def _archive(self, name: str, raw: bytearray, file: Path) -> tuple[_TensorRef, range]:
        """(tensor record, where in ``raw`` its storage bytes are) of one torch.save zip
        archive (read in place: a storage is not copied out of the archive)."""
        try:
            with zipfile.ZipFile(_View(memoryview(raw))) as z:
                pkls = [i for i in z.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
                if len(pkls) != 1:
                    raise ValueError("no single data.pkl")
                prefix = pkls[0].filename[: -len("data.pkl")]
                names = {i.filename: i for i in z.infolist()}
                order = names.get(prefix + "byteorder")
                if order is not None and z.read(order) != b"little":
                    raise ValueError(f"byte order {z.read(order)!r}")
                ref = TensorUnpickler(z.read(pkls[0]), file).load()
                if not isinstance(ref, _TensorRef):
                    raise ValueError("data.pkl is not one tensor")
                record = names.get(f"{prefix}data/{ref.storage.key}")
                if record is None or record.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(f"storage record data/{ref.storage.key} missing or compressed")
                return ref, _stored_range(raw, record)
        except CheckpointError:
            raise
        except (*_UNPICKLE_ERRORS, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError) as exc:
            raise self._fail(
                f"{name}: unreadable torch.save record ({exc})",
                "the file is truncated or not written by torch.distributed.checkpoint",
                file,
            ) from None

    # ----- Hugging Face names -------------------------------------------------------------------

    def map_names(self, family: str) -> list[str]:
        """Fill ``tensors`` with Hugging Face names; returns the DCP tensor names left out (not
        model weights: optimizer state and the like)."""
        naming, prefix = self._naming()
        left: list[str] = []
        from moeaudit.families import FAMILIES

        fam = FAMILIES.get(family)
        rules = (fam.torchtitan if fam is not None else ()) + TORCHTITAN_COMMON
        for fqn in self.entries:
            if not fqn.startswith(prefix):
                left.append(fqn)
                continue
            name = fqn[len(prefix) :]
            if naming == "hf":
                if name.startswith(("model.", "lm_head.")):
                    self._add(name, (fqn,))
                else:
                    left.append(fqn)
                continue
            for pattern, template in rules:
                if m := re.fullmatch(pattern, name):
                    if template is not None:
                        self._add(template.format(**m.groupdict()), (fqn,))
                    break
            else:
                left.append(fqn)
        if naming == "torchtitan":
            self._fuse_experts(prefix)
        return left

    def _naming(self) -> tuple[str, str]:
        for naming, prefix, probe in (
            ("hf", "", "model.embed_tokens.weight"),
            ("hf", "model.", "model.model.embed_tokens.weight"),
            ("torchtitan", "", "tok_embeddings.weight"),
            ("torchtitan", "model.", "model.tok_embeddings.weight"),
        ):
            if probe in self.entries:
                return naming, prefix
        raise self._fail(
            "no embedding table under a known name (model.embed_tokens.weight or torchtitan's tok_embeddings.weight)",
            "save the model's state_dict with Hugging Face or torchtitan names",
        )

    def _fuse_experts(self, prefix: str) -> None:
        """torchtitan's GroupedExperts w1, w3 [E, I, H] → ``mlp.experts.gate_up_proj`` [E, 2I, H]
        (gate rows first, as transformers 5 holds it); w2 [E, H, I] → ``down_proj``."""
        layer_re = re.compile(re.escape(prefix) + r"layers\.(\d+)\.moe\.experts\.w1")
        for fqn in list(self.entries):
            if not (m := layer_re.fullmatch(fqn)):
                continue
            stem = f"{prefix}layers.{m.group(1)}.moe.experts."
            w1, w3, w2 = stem + "w1", stem + "w3", stem + "w2"
            if w3 not in self.entries or w2 not in self.entries:
                raise self._fail(f"{w1!r} without {w3!r} and {w2!r}")
            a, b = self.entries[w1], self.entries[w3]
            if a.dtype != b.dtype or a.shape != b.shape or len(a.shape) != 3:
                raise self._fail(
                    f"{w1!r} {a.dtype} {list(a.shape)} and {w3!r} {b.dtype} "
                    f"{list(b.shape)} are not two stacks of one shape"
                )
            hf = f"model.layers.{m.group(1)}.mlp.experts."
            self._add(hf + "gate_up_proj", (w1, w3), (a.shape[0], 2 * a.shape[1], a.shape[2]))
            self._add(hf + "down_proj", (w2,))

    def _add(self, hf: str, sources: tuple[str, ...], shape: tuple[int, ...] | None = None) -> None:
        if hf in self.tensors:
            raise self._fail(f"two DCP tensors map to {hf!r}: {self._sources[hf][0]!r} and {sources[0]!r}")
        entry = self.entries[sources[0]]
        if entry.dtype not in ST_DTYPE:
            raise self._fail(f"tensor {entry.fqn!r} has unsupported dtype {entry.dtype}")
        shape = entry.shape if shape is None else shape
        nbytes = math.prod(shape) * ITEMSIZE[entry.dtype]
        self.tensors[hf] = TensorInfo(hf, ST_DTYPE[entry.dtype], shape, 0, nbytes)
        self._sources[hf] = sources

    def read(self, hf: str) -> torch.Tensor:
        """The tensor of Hugging Face name ``hf`` (a fresh CPU tensor in its stored dtype)."""
        import torch

        parts = [self.read_entry(fqn) for fqn in self._sources[hf]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @property
    def data_files(self) -> list[str]:
        return sorted(self.pins)

    def _sealed(self, rel: str) -> Sealed:
        if rel not in self.sealed:
            self.sealed[rel] = seal(self.path / rel, self.pins[rel])
        return self.sealed[rel]

    def seal(self) -> dict[str, bytes]:
        """Relative path → SHA-256 of the bytes read and used: the ``.metadata`` as unpickled,
        each ``.distcp`` file as read once into private memory (every chunk comes from there)."""
        return {
            METADATA_NAME: self.meta_sha256,
            **{rel: self._sealed(rel).sha256 for rel in self.pins if rel != METADATA_NAME},
        }


def is_dcp(path: Path) -> bool:
    return os.path.lexists(path / METADATA_NAME)


__all__ = ["DcpDirectory", "MetadataUnpickler", "TensorUnpickler", "is_dcp", "METADATA_NAME"]
