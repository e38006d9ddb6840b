"""The canary probe set: a fixed, hashed set of equal-length token windows (docs/glossary.md, "Canary").

Every receipt is measured on a canary, and a certificate names the canary by its digest, so
the digest must depend on the content only: the SHA-256 of a canonical encoding of (tokens,
domain ids, domain names) — never of the file bytes, which change with safetensors metadata
order, header padding or JSON whitespace.

Shape legend: W windows, T tokens per window.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit.checkpoint.safetensors import SafetensorsFile, write_safetensors
from moeaudit.errors import CanaryError, CheckpointError
from moeaudit.jsonio import no_duplicate_keys

if TYPE_CHECKING:
    import numpy as np
    import torch

# numpy is imported where arrays are made, not here: a canary read from its file keeps the
# stored int32 bytes, and its digest, shape and names need nothing else, so a fully cached
# certify loads neither numpy nor torch (docs/decisions.md, "A fully cached certify loads neither torch nor numpy").

FORMAT = "moeaudit.canary"
VERSION = "1"
DIGEST_PREFIX = b"moeaudit.canary/v1\n"
MIN_WINDOW_LEN = 2  # next-token NLL needs at least one (context, target) pair per window
MAX_TOKEN_ID = 2**31 - 1  # stored as int32
Fail = Callable[..., CanaryError]
BUILD_HINT = "build one with `moeaudit canary build --tokens FILE.jsonl --out CANARY.safetensors`"


def _as_array(x: Any) -> Any:
    """A numpy copy of a torch tensor or an array (no torch import: a torch tensor is only
    handed in by code that has imported torch already)."""
    import numpy as np

    if hasattr(x, "detach"):  # a torch tensor
        t = x.detach().cpu()
        try:
            return np.array(t.numpy(), copy=True)
        except (TypeError, RuntimeError):  # bfloat16, float8: numpy has no such dtype
            return _Foreign(t)
    return np.array(x, copy=True)


class _Foreign:
    """Stands in for a tensor numpy cannot hold, so that the dtype check can name it."""

    def __init__(self, t: Any):
        self.dtype = t.dtype


class Canary:
    """W token windows of length T, each labelled with a domain (docs/glossary.md, "Canary").

    ``domains[i]`` is the name of domain id ``i``. Two canaries are equal when their
    tokens, domain ids and domain names are equal, i.e. exactly when their digests are.
    A canary read from its file holds the stored little-endian int32 bytes: its digest, shape
    and names need no numpy. ``tokens_array`` / ``domain_ids_array`` are numpy views of them
    and ``tokens`` / ``domain_ids`` torch views, each made on first use.
    """

    __slots__ = ("_raw", "_shape", "_arrays", "domains", "source", "built_from", "_torch")
    _raw: tuple[bytearray, bytearray] | None  # (tokens, domain ids) as little-endian int32
    _shape: tuple[int, int]  # (W, T)
    _arrays: tuple[np.ndarray, np.ndarray] | None
    domains: tuple[str, ...]
    source: str | None
    # what a canary built from text was built from: {"tokenizer_sha256", "text_sha256"} (None for
    # token windows); recorded by the builder, not part of the digest (the content alone is)
    built_from: dict[str, str] | None
    _torch: tuple[torch.Tensor, torch.Tensor] | None

    def __init__(
        self,
        tokens: Any,
        domain_ids: Any,
        domains: tuple[str, ...] | list[str],
        source: str | None = None,
        built_from: dict[str, str] | None = None,
    ):
        import numpy as np

        tokens_WT, ids_W = _as_array(tokens), _as_array(domain_ids)
        names = tuple(domains)
        _check_dtypes(tokens_WT, ids_W, None)
        _check_content(tuple(tokens_WT.shape), tuple(ids_W.shape), tokens_WT.reshape(-1), ids_W, names, None)
        arrays = (np.ascontiguousarray(tokens_WT), np.ascontiguousarray(ids_W))
        self._init(
            None,
            arrays,
            (int(tokens_WT.shape[0]), int(tokens_WT.shape[1])),
            names,
            source,
            _checked_built_from(built_from, None),
        )

    def _init(
        self,
        raw: tuple[bytearray, bytearray] | None,
        arrays: tuple[np.ndarray, np.ndarray] | None,
        shape: tuple[int, int],
        domains: tuple[str, ...],
        source: str | None,
        built_from: dict[str, str] | None = None,
    ) -> None:
        for name, value in (
            ("_raw", raw),
            ("_arrays", arrays),
            ("_shape", shape),
            ("domains", domains),
            ("source", source),
            ("built_from", built_from),
            ("_torch", None),
        ):  # source, built_from: not the digest
            object.__setattr__(self, name, value)

    @classmethod
    def _from_stored(
        cls,
        tokens: bytearray,
        ids: bytearray,
        shape: tuple[int, int],
        domains: tuple[str, ...],
        source: str,
        built_from: dict[str, str] | None = None,
    ) -> Canary:
        """A canary over the stored bytes of a file, already validated by :func:`load`."""
        canary = cls.__new__(cls)
        canary._init((tokens, ids), None, shape, domains, source, built_from)
        return canary

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Canary is immutable ({name})")

    def __repr__(self) -> str:
        return (
            f"Canary({self.num_windows}×{self.window_len} tokens, {len(self.domains)} "
            f"domains, sha256:{self.digest[:16]}…)"
        )

    def _np(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            import numpy as np

            assert self._raw is not None
            tokens, ids = self._raw
            pair = (
                np.frombuffer(tokens, dtype="<i4").reshape(self._shape).astype(np.int32, copy=False),
                np.frombuffer(ids, dtype="<i4").astype(np.int32, copy=False),
            )
            object.__setattr__(self, "_arrays", pair)
        assert self._arrays is not None
        return self._arrays

    @property
    def tokens_array(self) -> np.ndarray:
        """int32 [W, T] (numpy)."""
        return self._np()[0]

    @property
    def domain_ids_array(self) -> np.ndarray:
        """int32 [W] (numpy)."""
        return self._np()[1]

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._torch is not None:
            return self._torch
        import torch

        tokens_WT, ids_W = self._np()
        pair = (torch.from_numpy(tokens_WT), torch.from_numpy(ids_W))
        object.__setattr__(self, "_torch", pair)
        return pair

    @property
    def tokens(self) -> torch.Tensor:
        """int32 [W, T] (torch; shares memory with the canary)."""
        return self._tensors()[0]

    @property
    def domain_ids(self) -> torch.Tensor:
        """int32 [W] (torch; shares memory with the canary)."""
        return self._tensors()[1]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Canary):
            return NotImplemented
        return self.domains == other.domains and self.canonical_bytes() == other.canonical_bytes()

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def num_windows(self) -> int:
        return self._shape[0]

    @property
    def window_len(self) -> int:
        return self._shape[1]

    @property
    def num_tokens(self) -> int:
        return self.num_windows * self.window_len

    def canonical_bytes(self) -> bytes:
        """The byte string the digest hashes (docs/glossary.md, "Canary"), in this order:

        1. the 19 ASCII bytes ``moeaudit.canary/v1\\n``;
        2. W, then T, each as a little-endian uint64;
        3. the tokens as little-endian int32, row-major (window by window), W·T values;
        4. the domain ids as little-endian int32, W values;
        5. the domain names, in id order (not sorted: ids index into the list), as
           ``json.dumps(list(domains), separators=(",", ":"), ensure_ascii=False)``
           encoded as UTF-8.

        Parts 2–4 have lengths fixed by W and T and part 5 runs to the end, so the
        encoding is injective. Nothing about the file enters it: saving twice, or rewriting
        the safetensors file with other metadata order, padding or JSON whitespace, leaves
        the digest unchanged.
        """
        tokens: bytes | bytearray
        ids: bytes | bytearray
        if self._raw is not None:  # the file's bytes are this encoding already
            tokens, ids = self._raw
        else:
            import numpy as np

            tokens_WT, ids_W = self._np()
            tokens = np.ascontiguousarray(tokens_WT, dtype="<i4").tobytes()
            ids = np.ascontiguousarray(ids_W, dtype="<i4").tobytes()
        return b"".join(
            [
                DIGEST_PREFIX,
                struct.pack("<QQ", self.num_windows, self.window_len),
                tokens,
                ids,
                _names_json(self.domains).encode("utf-8"),
            ]
        )

    @property
    def digest(self) -> str:
        """Hex SHA-256 of :meth:`canonical_bytes` — the canary's name in certificates."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def windows_of(self, domain: str) -> torch.Tensor:
        """Indices (int64 [n]) of the windows labelled ``domain``, ascending."""
        import numpy as np
        import torch

        if domain not in self.domains:
            raise CanaryError(
                f"no domain named {domain!r} in the canary",
                hint=f"its domains are {', '.join(map(repr, self.domains))}",
            )
        idx = np.flatnonzero(self.domain_ids_array == self.domains.index(domain))
        return torch.from_numpy(idx.astype(np.int64))

    def check_vocab(self, vocab_size: int, where: str) -> None:
        """Raise unless every token id is below ``vocab_size`` (docs/glossary.md, "Canary").

        ``where`` names the model the vocabulary comes from (e.g. the checkpoint path); it
        is the "file" of the error, since the canary is only wrong relative to it.
        """
        import numpy as np

        tokens_WT = self.tokens_array
        bad = np.argwhere(tokens_WT >= vocab_size)
        if len(bad) == 0:
            return
        window, pos = (int(i) for i in bad[0])
        which = f"canary {self.source}" if self.source else "canary"
        raise CanaryError(
            f"{which} window {window}, position {pos} has token id "
            f"{int(tokens_WT[window, pos])}, outside the model vocabulary of size "
            f"{vocab_size} "
            f"({len(bad)} such token{'s' if len(bad) != 1 else ''} in all)",
            path=where,
            hint="build the canary with this model's tokenizer",
        )

    def check_context(self, config: Mapping[str, Any], where: str) -> None:
        """Raise when the windows are longer than the model's context (``max_position_embeddings``
        of its config, where it states one): positions past it are ones the model was never
        trained at, so receipts there describe an extrapolation, not the model (docs/decisions.md,
        "A canary longer than the model's context")."""
        context = config.get("max_position_embeddings")
        if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
            return
        if self.window_len <= context:
            return
        which = f"canary {self.source}" if self.source else "canary"
        raise CanaryError(
            f"{which} has windows of {self.window_len} tokens, longer than the model's context of "
            f"{context} positions (max_position_embeddings)",
            path=where,
            hint=f"build the canary with windows of at most {context} tokens (`moeaudit canary build --window-len`)",
        )

    def _ids(self) -> Sequence[int]:
        """The domain ids as a sequence of ints (no numpy for a canary read from its file)."""
        if self._raw is not None:
            return _int32s(self._raw[1])
        return self._np()[1].tolist()

    def summary(self) -> dict[str, Any]:
        """Plain data for ``moeaudit canary show`` (README.md, "Commands")."""
        counts = [0] * len(self.domains)
        for d in self._ids():
            counts[d] += 1
        return {
            "format": FORMAT,
            "version": VERSION,
            "windows": self.num_windows,
            "window_len": self.window_len,
            "tokens": self.num_tokens,
            "domains": dict(zip(self.domains, counts, strict=True)),
            "digest": self.digest,
            **(self.built_from or {}),
        }


def _names_json(domains: tuple[str, ...] | list[str]) -> str:
    return json.dumps(list(domains), separators=(",", ":"), ensure_ascii=False)


def _dtype_name(a: Any) -> str:
    return str(a.dtype).removeprefix("torch.")


def _failing(path: Path | None) -> Fail:
    def fail(what: str) -> CanaryError:
        return CanaryError(what, path=path, hint=None if path is None else BUILD_HINT)

    return fail


def _check_dtypes(tokens: Any, domain_ids: Any, path: Path | None) -> None:
    import numpy as np

    int32 = np.dtype("int32")
    if getattr(tokens, "dtype", None) != int32 or getattr(domain_ids, "dtype", None) != int32:
        raise _failing(path)(
            f"tokens and domain ids must be int32, got {_dtype_name(tokens)}, {_dtype_name(domain_ids)}"
        )
    if tokens.ndim != 2:
        raise _failing(path)(f"tokens must be 2-D [windows, window length], got shape {list(tokens.shape)}")


def _check_content(
    tokens_shape: tuple[int, ...],
    ids_shape: tuple[int, ...],
    tokens: Sequence[int],
    domain_ids: Sequence[int],
    domains: tuple[str, ...],
    path: Path | None,
) -> None:
    """The invariants of a canary, whether built in memory or read from a file. ``tokens`` is
    flat (row-major); both are anything with ``min``/``max``: numpy arrays or int32 arrays."""
    fail = _failing(path)
    if len(tokens_shape) != 2:
        raise fail(f"tokens must be 2-D [windows, window length], got shape {list(tokens_shape)}")
    w, t = tokens_shape
    if w == 0:
        raise fail("the canary is empty (0 windows)")
    if t < MIN_WINDOW_LEN:
        raise fail(f"window length is {t}; a window needs at least {MIN_WINDOW_LEN} tokens")
    if list(ids_shape) != [w]:
        raise fail(f"domain_ids must have shape [{w}] (one per window), got {list(ids_shape)}")
    _check_names(domains, fail)
    lo, hi = _bounds(domain_ids)
    if lo < 0 or hi >= len(domains):
        bad = next(i for i, d in enumerate(domain_ids) if not 0 <= d < len(domains))
        raise fail(
            f"window {bad} has domain id {int(domain_ids[bad])}, but there are "
            f"{len(domains)} domain names (ids 0..{len(domains) - 1})"
        )
    if _bounds(tokens)[0] < 0:
        at = next(i for i, tok in enumerate(tokens) if tok < 0)
        raise fail(f"window {at // t}, position {at % t} has negative token id {int(tokens[at])}")


def _bounds(values: Any) -> tuple[int, int]:
    """(min, max) of a non-empty numpy or int32 array, each in one pass in C."""
    if hasattr(values, "min"):
        return int(values.min()), int(values.max())
    return min(values), max(values)


def _int32s(buf: bytearray) -> array:
    """Little-endian int32 bytes as an int32 array (a copy; byte-swapped on a big-endian host)."""
    out = array("i")
    if out.itemsize != 4:  # pragma: no cover - no mainstream platform
        out = array("l")
    out.frombytes(buf)
    if sys.byteorder == "big":  # pragma: no cover
        out.byteswap()
    return out


def _check_names(domains: tuple[str, ...], fail: Fail) -> None:
    """Linear in the number of names (20k domains took 7 s when this was quadratic)."""
    if not domains:
        raise fail("the canary has no domain names")
    for name in domains:
        if not isinstance(name, str) or not name:
            raise fail(f"domain name {name!r} is not a non-empty string")
        if not _is_unicode(name):
            raise fail(f"domain name {name!r} is not valid Unicode text")
    dupes = sorted(n for n, c in Counter(domains).items() if c > 1)
    if dupes:
        raise fail(f"domain names repeat: {', '.join(map(repr, dupes))}")


def _is_unicode(text: str) -> bool:
    """False for strings with lone surrogates (JSON allows "\\ud800"; UTF-8 does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --- building from JSONL -------------------------------------------------------------------


def build_from_jsonl(path: str | Path) -> Canary:
    """Build a canary from JSONL, one ``{"domain": str, "tokens": [int, ...]}`` per line.

    Blank lines are skipped, other keys are ignored, and domains are numbered by first
    appearance (docs/glossary.md, "Canary"). Every problem is a :class:`CanaryError` naming the line.
    """
    path = Path(path)
    rows: list[list[int]] = []
    names: dict[str, int] = {}  # name → id, in order of first appearance
    ids: list[int] = []
    first_len: tuple[int, int] | None = None  # (line number, window length) of the first window
    for lineno, line in _read_lines(path):
        domain, window = _parse_line(line, lineno, path)
        if first_len is None:
            first_len = (lineno, len(window))
        elif len(window) != first_len[1]:
            raise CanaryError(
                f"line {lineno}: window has {len(window)} tokens but the window on line "
                f"{first_len[0]} has {first_len[1]}; all windows must have the same length",
                path=path,
            )
        ids.append(names.setdefault(domain, len(names)))
        rows.append(window)
    if not rows:
        raise CanaryError("no windows: the file has no non-blank lines", path=path)
    import numpy as np

    tokens = np.array(rows, dtype=np.int32)
    return Canary(tokens, np.array(ids, dtype=np.int32), tuple(names))


def _read_lines(path: Path) -> list[tuple[int, str]]:
    """Non-blank lines with their 1-based numbers."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CanaryError(f"cannot read: {exc.strerror or exc}", path=path) from exc
    lines = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CanaryError(f"line {lineno}: not UTF-8 text ({exc.reason})", path=path) from exc
        if text.strip():
            lines.append((lineno, text))
    return lines


def _parse_line(line: str, lineno: int, path: Path) -> tuple[str, list[int]]:
    def fail(what: str) -> CanaryError:
        return CanaryError(
            f"line {lineno}: {what}",
            path=path,
            hint='each line must be {"domain": "<name>", "tokens": [<int>, ...]}',
        )

    try:
        obj = json.loads(line, object_pairs_hook=no_duplicate_keys)
    except (ValueError, RecursionError) as exc:
        raise fail(f"not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    for key in ("domain", "tokens"):
        if key not in obj:
            raise fail(f'missing "{key}"')
    domain, window = obj["domain"], obj["tokens"]
    if not isinstance(domain, str) or not domain:
        raise fail(f'"domain" must be a non-empty string, got {domain!r}')
    if not _is_unicode(domain):
        raise fail(f'"domain" {domain!r} is not valid Unicode text')
    if not isinstance(window, list):
        raise fail(f'"tokens" must be a list of token ids, got {type(window).__name__}')
    _check_window(window, fail)
    return domain, window


def _check_window(window: list[Any], fail: Fail) -> None:
    if len(window) < MIN_WINDOW_LEN:
        raise fail(f"window has {len(window)} token(s); a window needs at least {MIN_WINDOW_LEN}")
    for pos, tok in enumerate(window):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise fail(f"token {pos} is {tok!r}, not an integer token id")
        if tok < 0 or tok > MAX_TOKEN_ID:
            raise fail(f"token {pos} is {tok}, outside the token id range 0..{MAX_TOKEN_ID}")


# --- the safetensors file ------------------------------------------------------------------


def save(canary: Canary, path: str | Path) -> None:
    """Write ``canary`` as one safetensors file, atomically (docs/glossary.md, "Canary")."""
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "domains": _names_json(canary.domains),
        "digest": canary.digest,
        **(canary.built_from or {}),  # a canary built from text only: token-built files are unchanged
    }
    tensors = {"tokens": canary.tokens, "domain_ids": canary.domain_ids}
    try:
        write_safetensors(path, tensors, metadata)
    except OSError as exc:
        raise CanaryError(f"cannot write: {exc.strerror or exc}", path=path) from exc


def load(path: str | Path) -> Canary:
    """Read and fully validate a canary file; the stored digest must match the content."""
    path = Path(path)
    if not path.is_file():
        if not path.exists():
            raise CanaryError("no such canary file", path=path, hint=BUILD_HINT)
        raise not_a_canary(path, "a directory" if path.is_dir() else "not a regular file")
    try:
        sf = SafetensorsFile(path)
    except CheckpointError as exc:
        text = _text_kind(path)
        # the parser's header arithmetic says nothing useful here (docs/decisions.md, "Not a canary")
        if text is not None:
            raise CanaryError(f"not a moeaudit canary ({text})", path=path, hint=_text_hint(text, path)) from exc
        if not _claims_to_be_a_canary(path):  # some other file; else a damaged canary, below
            raise not_a_canary(path, f"not a safetensors file: {exc.what}") from exc
        raise CanaryError(exc.what, path=path, hint=exc.hint) from exc
    try:
        domains = _read_header(sf)
        tokens, domain_ids = sf.read_raw("tokens"), sf.read_raw("domain_ids")
    except CheckpointError as exc:  # the parser's checklist, relabelled for the canary
        raise CanaryError(exc.what, path=path, hint=exc.hint) from exc
    shape, ids_shape = tuple(sf.tensors["tokens"].shape), tuple(sf.tensors["domain_ids"].shape)
    _check_content(shape, ids_shape, _int32s(tokens), _int32s(domain_ids), domains, path)
    built_from = _checked_built_from({k: v for k, v in sf.metadata.items() if k in BUILT_FROM}, path) or None
    canary = Canary._from_stored(
        tokens, domain_ids, (shape[0], shape[1]), domains, source=str(path), built_from=built_from
    )
    stored = sf.metadata["digest"]
    if stored != canary.digest:
        raise CanaryError(
            f"digest mismatch: file says {stored}, content hashes to {canary.digest} — the file was modified",
            path=path,
            hint="rebuild the canary from its JSONL source",
        )
    return canary


BUILT_FROM = ("tokenizer_sha256", "text_sha256")  # header metadata of a canary built from text
_SHA256_HEX = frozenset("0123456789abcdef")


def _checked_built_from(built_from: dict[str, str] | None, path: Path | None) -> dict[str, str] | None:
    """Both digests or neither, each 64 lowercase hex digits; keys in :data:`BUILT_FROM` order."""
    if not built_from:
        return None
    fail = _failing(path)
    if set(built_from) != set(BUILT_FROM):
        raise fail(f"metadata names {', '.join(sorted(built_from))} but not both of {', '.join(BUILT_FROM)}")
    for key in BUILT_FROM:
        value = built_from[key]
        if not isinstance(value, str) or len(value) != 64 or not set(value) <= _SHA256_HEX:
            raise fail(f"metadata {key} is not a hex SHA-256: {str(value)[:80]!r}")
    return {key: built_from[key] for key in BUILT_FROM}


def not_a_canary(path: Path, why: str) -> CanaryError:
    """The plain answer for a file that is something else (a model, a JSON file, random bytes)."""
    return CanaryError(f"not a moeaudit canary ({why})", path=path, hint=BUILD_HINT)


TOKENS_JSONL = "a JSONL file of token windows (a canary's source), not a built canary"
TEXT_JSONL = "a JSONL file of texts (a canary's source), not a built canary"


def _text_kind(path: Path) -> str | None:
    """What a text file given as a canary is, in words, or None for a binary file: a canary is
    a safetensors file, whose first 8 bytes are a little-endian header length."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    try:
        text = head.decode("utf-8").lstrip()
    except UnicodeDecodeError:
        return None
    if not text or len(head) < 8 or not all(ch.isprintable() or ch in "\n\r\t" for ch in text):
        return None  # shorter than a header length: the parser's "too short" says it
    first = text.splitlines()[0]
    if first.startswith("{") and '"tokens"' in first:
        return TOKENS_JSONL
    if first.startswith("{") and '"text"' in first:
        return TEXT_JSONL
    return "a JSON file, not a safetensors file" if first[:1] in "{[" else "a text file, not a safetensors file"


def _text_hint(kind: str, path: Path) -> str:
    if kind == TOKENS_JSONL:
        return (
            f"build the canary from it: `moeaudit canary build --tokens {path} --out "
            "canary.safetensors`, then pass --canary canary.safetensors"
        )
    if kind == TEXT_JSONL:
        return (
            f"build the canary from it: `moeaudit canary build --text {path} --tokenizer "
            "tokenizer.json --out canary.safetensors`, then pass --canary canary.safetensors"
        )
    return BUILD_HINT


def _claims_to_be_a_canary(path: Path) -> bool:
    """Whether the start of the file names our format: a canary is told apart from a damaged one
    by its header's metadata, which is written before any tensor data."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024)
    except OSError:
        return False
    return f'"{FORMAT}"'.encode() in head


def _read_header(sf: SafetensorsFile) -> tuple[str, ...]:
    """Validate metadata and tensor entries before reading any data; return the names."""

    def fail(what: str, hint: str | None = BUILD_HINT) -> CanaryError:
        return CanaryError(what, path=sf.path, hint=hint)

    meta = sf.metadata
    if meta.get("format") != FORMAT:
        fmt = meta.get("format")
        kind = " — model weights, by the look of it" if fmt == "pt" else ""
        raise not_a_canary(
            sf.path, f"a safetensors file of {len(sf.tensors)} tensor(s) whose metadata format is {fmt!r}{kind}"
        )
    if meta.get("version") != VERSION:
        raise fail(
            f"canary format version {meta.get('version')!r} is not supported (this moeaudit reads version {VERSION!r})",
            hint="upgrade moeaudit or rebuild the canary",
        )
    for key in ("domains", "digest"):
        if key not in meta:
            raise fail(f'metadata has no "{key}"')
    if set(sf.tensors) != {"tokens", "domain_ids"}:
        raise fail(f"expected exactly the tensors domain_ids, tokens; found {sorted(sf.tensors)}")
    for name in ("tokens", "domain_ids"):
        if sf.tensors[name].dtype != "I32":
            raise fail(f"tensor {name!r} is {sf.tensors[name].dtype}, expected I32")
    return _parse_names(meta["domains"], fail)


def _parse_names(text: str, fail: Fail) -> tuple[str, ...]:
    try:
        names = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise fail(f"metadata domains is not valid JSON ({exc})") from exc
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise fail(f"metadata domains must be a JSON list of strings, got {text!r}")
    return tuple(names)


# --- the run's own canary ------------------------------------------------------------------------

RUN_COPY = "canary.safetensors"  # the trainer callbacks' copy of the run's canary, in the run directory
TOKENIZER_FILE = "tokenizer.json"


def probe_digests(probe: str | Path) -> list[str | None]:
    """The canary digest of each line of a hook's ``canary_probe.jsonl`` (None: a line that names
    none); unreadable lines are skipped (the metrics reader judges them)."""
    from moeaudit.limits import iter_lines

    out: list[str | None] = []
    for _, line, _ in iter_lines(probe, "canary probe log"):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # a torn last line
            continue
        digest = value.get("canary") if isinstance(value, dict) else None
        out.append(digest if isinstance(digest, str) else None)
    return out


def probe_mismatch(canary: Canary, probe: str | Path) -> dict[str, str] | None:
    """The first canary digest the probe lines name that is not ``canary``'s, as a finding
    (lines that name none are not a mismatch), or None."""
    for digest in probe_digests(probe):
        if digest is not None and digest != canary.digest:
            return {"source": Path(probe).name, "recorded": digest, "given": canary.digest}
    return None


def run_mismatches(
    canary: Canary,
    run_dir: str | Path,
    checkpoints: Sequence[str | Path] = (),
    probe_canaries: Sequence[str | None] | None = None,
) -> list[dict[str, str]]:
    """Where the run records another canary than ``canary`` (docs/decisions.md, "The canary must be
    the run's canary"): the canary probe's lines, the callback's copy ``RUN/canary.safetensors``,
    and — for a canary built from text — each checkpoint's ``tokenizer.json`` against the
    canary's ``tokenizer_sha256``. Each finding: {"source", "recorded", "given"} (SHA-256s).
    ``probe_canaries``: the digests the probe's lines name, as read from the bytes whose digest a
    certificate signs (``Run.read_logs_once``); otherwise the probe is read here."""
    run = Path(run_dir)
    found: list[dict[str, str]] = []
    probe = run / "canary_probe.jsonl"
    if probe_canaries is not None:
        named = next((d for d in probe_canaries if d is not None and d != canary.digest), None)
        if named is not None:
            found.append({"source": probe.name, "recorded": named, "given": canary.digest})
    elif probe.is_file():
        m = probe_mismatch(canary, probe)
        if m is not None:
            found.append(m)
    copy = run / RUN_COPY
    if copy.is_file():
        recorded = _stored_digest(copy)
        if recorded != canary.digest:
            found.append({"source": RUN_COPY, "recorded": recorded, "given": canary.digest})
    tokenizer = (canary.built_from or {}).get("tokenizer_sha256")
    if tokenizer:
        for ckpt in checkpoints:
            path = Path(ckpt) / TOKENIZER_FILE
            if path.is_file():
                shipped = _file_sha256(path)
                if shipped != tokenizer:
                    found.append(
                        {"source": f"{Path(ckpt).name}/{TOKENIZER_FILE}", "recorded": shipped, "given": tokenizer}
                    )
    return found


def mismatch_error(finding: dict[str, str], flag: str | None = None) -> CanaryError:
    """The one-line refusal of a mismatch, both digests named."""
    if finding["source"].endswith(TOKENIZER_FILE):
        what = (
            f"{finding['source']} has sha256:{finding['recorded']}, but the canary was built with a "
            f"tokenizer.json of sha256:{finding['given']} (tokenizer_sha256): its token ids mean other text here"
        )
    else:
        what = (
            f"the run recorded canary sha256:{finding['recorded']} ({finding['source']}), "
            f"but the canary given is sha256:{finding['given']}"
        )
    hint = "use the run's canary" + (f", or pass {flag} to sign the mismatch as a finding" if flag else "")
    return CanaryError(what, hint=hint)


def _stored_digest(path: Path) -> str:
    """The digest a canary file's content hashes to (the file is validated as a canary)."""
    return load(path).digest


def _file_sha256(path: Path) -> str:
    from moeaudit.limits import file_sha256

    return file_sha256(path, "tokenizer file")
