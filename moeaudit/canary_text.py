"""A canary from raw text and a ``tokenizer.json`` (docs/glossary.md, "Canary"; the optional tokenizer extra).

Input: JSONL, one ``{"text": str, "domain": str}`` per line (a line of at most 4 MiB, as every
JSONL input; split longer documents). Each text is tokenized with the
model's tokenizer (the Hugging Face ``tokenizers`` package, ``pip install 'moeaudit[text]'``),
with the tokenizer's own special tokens (a BOS per document where the tokenizer adds one, as
training data is tokenized). A domain's documents are concatenated in file order into one
stream and cut into non-overlapping windows of T tokens; windows may span two documents, as in
packed pre-training batches. The W windows are shared out between the domains as evenly as
their text allows, each domain's taken evenly spaced along its stream, so the canary samples
all of a domain's text rather than its first documents. Same inputs → same canary, byte for
byte. The canary records the SHA-256 of the tokenizer.json and of the text file, each of the
bytes that were read and used (``Canary.built_from``, in the file's header metadata), so the
canary names what it was built from; they are not part of its digest, which stays that of the
windows alone. Shape legend: W windows, T tokens per window, D domains.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from moeaudit.canary import Canary, _is_unicode
from moeaudit.errors import CanaryError, InputError
from moeaudit.jsonio import no_duplicate_keys
from moeaudit.limits import MiB, iter_lines, read_regular

MAX_TOKENIZER_BYTES = 256 * MiB  # the largest tokenizer.json files of 2025 are ~30 MB
LINE_HINT = 'each line must be {"text": "<document>", "domain": "<name>"}'


def build_from_text(path: str | Path, tokenizer: str | Path, *, window_len: int, windows: int) -> Canary:
    """W windows of T tokens from the texts in ``path``, tokenized with ``tokenizer``."""
    if window_len < 2 or windows < 1:
        raise ValueError(f"need window_len >= 2 and windows >= 1, got {window_len}, {windows}")
    tok, tokenizer_sha256 = load_tokenizer_hashed(tokenizer)
    text_hash = hashlib.sha256()
    texts = read_texts(Path(path), text_hash)
    streams: dict[str, list[int]] = {}
    for domain, ids in zip((d for d, _ in texts), tok.encode_batch([t for _, t in texts])):
        streams.setdefault(domain, []).extend(ids.ids)
    counts = _share(
        windows,
        {d: len(s) // window_len for d, s in streams.items()},
        window_len,
        {d: len(s) for d, s in streams.items()},
        Path(path),
    )
    rows_WT, ids_W = [], []
    for d, (domain, stream) in enumerate(streams.items()):
        available = len(stream) // window_len
        for i in range(counts[domain]):
            start = (i * available // counts[domain]) * window_len
            rows_WT.append(stream[start : start + window_len])
            ids_W.append(d)
    return Canary(
        np.array(rows_WT, dtype=np.int32),
        np.array(ids_W, dtype=np.int32),
        tuple(streams),
        source=str(path),
        built_from={"tokenizer_sha256": tokenizer_sha256, "text_sha256": text_hash.hexdigest()},
    )


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` (a JSON file; nothing is executed)."""
    return load_tokenizer_hashed(path)[0]


def load_tokenizer_hashed(path: str | Path) -> tuple[Any, str]:
    """(the tokenizer, hex SHA-256 of the very bytes it was read from)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise InputError(
            "building a canary from text needs the tokenizers package",
            hint="pip install 'moeaudit[text]' (or pip install tokenizers)",
        ) from exc
    if not Path(path).exists():
        raise CanaryError(
            "no such tokenizer file", path=path, hint="pass the model's tokenizer.json (saved next to its config.json)"
        )
    raw = read_regular(path, "tokenizer", MAX_TOKENIZER_BYTES)
    try:
        return Tokenizer.from_str(raw.decode("utf-8")), hashlib.sha256(raw).hexdigest()
    except Exception as exc:  # tokenizers raises a bare Exception for any malformed file
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CanaryError(
            f"not a tokenizer.json the tokenizers library can read ({why})",
            path=path,
            hint="pass the model's tokenizer.json (a Hugging Face fast tokenizer)",
        ) from exc


def read_texts(path: Path, digest: Any = None) -> list[tuple[str, str]]:
    """(domain, text) per non-blank line; every problem is an error naming the line. ``digest``
    (a hashlib object), when given, is fed the file's bytes as they are read."""
    if not path.exists():
        raise CanaryError("no such text file", path=path, hint=LINE_HINT)
    out = []
    for n, raw, terminated in iter_lines(path, "text JSONL"):
        if digest is not None:
            digest.update(raw + b"\n" if terminated else raw)
        if raw.strip():
            out.append(_parse_line(raw, f"{path}:{n}"))
    if not out:
        raise CanaryError("no texts: the file has no non-blank lines", path=path, hint=LINE_HINT)
    return out


def _parse_line(raw: bytes, where: str) -> tuple[str, str]:
    def fail(what: str) -> CanaryError:
        return CanaryError(what, path=where, hint=LINE_HINT)

    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise fail(f"not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    for key in ("text", "domain"):
        if key not in obj:
            raise fail(f'missing "{key}"')
        if not isinstance(obj[key], str) or not obj[key] or not _is_unicode(obj[key]):
            raise fail(f'"{key}" must be a non-empty string of valid Unicode text, got {obj[key]!r:.60}')
    return obj["domain"], obj["text"]


def _share(
    windows: int, available: dict[str, int], window_len: int, tokens: dict[str, int], path: Path
) -> dict[str, int]:
    """Windows per domain: as equal as the domains' text allows (water-filling), every domain
    at least one; too little text is an error that says how much is missing."""
    short = [d for d, a in available.items() if a == 0]
    if short:
        raise CanaryError(
            f"domain {short[0]!r} has {tokens[short[0]]} tokens, fewer than one window of {window_len}",
            path=path,
            hint="add text for it, or lower --window-len",
        )
    if windows < len(available):
        raise CanaryError(
            f"{windows} window(s) cannot cover the {len(available)} domains",
            path=path,
            hint="raise --windows to at least the number of domains",
        )
    total = sum(available.values())
    if total < windows:
        raise CanaryError(
            f"the text gives {total} windows of {window_len} tokens ({sum(tokens.values())} "
            f"tokens), fewer than --windows {windows} (W×T = {windows * window_len} tokens)",
            path=path,
            hint="add text, or lower --windows or --window-len",
        )
    counts = dict.fromkeys(available, 0)
    left = windows
    while left:
        open_ = [d for d in counts if counts[d] < available[d]]
        for d in open_[:left]:
            counts[d] += 1
        left -= min(left, len(open_))
    return counts
