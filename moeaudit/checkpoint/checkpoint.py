"""A checkpoint directory: config + safetensors files + the family's layout, validated.

Opening a checkpoint reads headers only (torch is imported by the methods that build tensors,
not by this module). ``layer_weights(i)`` materialises one decoder layer in canonical form
(layer-local streaming, docs/glossary.md, "Replay"); ``read_global`` the embeddings, final norm and LM head.

The root digest is of the bytes the replay uses (docs/decisions.md, "Pinned reads", "Read once"): config.json and the
shard index are hashed from the bytes parsed, each weight file is read once into private memory
and hashed as it is read, and every tensor comes from those hashed bytes (``sealed``; a file too
large to keep is re-read with each 64 KiB block proven against the digests of that pass).
Every file is also pinned from its first read on (``digest``), and
:meth:`Checkpoint.verify_unchanged` says, after a replay, that nothing was swapped, rewritten
with new timestamps, added or removed meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeaudit.checkpoint import mxfp4
from moeaudit.checkpoint.adapter import refuse_unreadable
from moeaudit.checkpoint.dcp import METADATA_NAME, DcpDirectory, is_dcp
from moeaudit.checkpoint.digest import FileId, Snapshot, changed, read_bytes, snapshot
from moeaudit.checkpoint.names import (  # noqa: F401 (re-exported: the names a checkpoint must hold)
    ARCH_FIELDS,
    _layer_index,
    check_compatible,
    expected_layer_names,
    expected_shapes,
    weight_files,
)
from moeaudit.checkpoint.safetensors import (
    FLOAT_DTYPES,
    DuplicateKey,
    SafetensorsFile,
    TensorInfo,
    no_duplicate_keys,
)
from moeaudit.checkpoint.stored import (  # noqa: F401 (re-exported: how a layer's tensors are held)
    LEFT_OUT_NAMES,
    SCALE_SUFFIX,
    FP8Experts,
    LayerWeights,
    LeftOut,
    MXFP4Experts,
    StoredExperts,
    _fp8_block,
    _largest_e4m3_code,
    dequantize_fp8,
    fp8_nonfinite_marker,
)
from moeaudit.errors import CheckpointError
from moeaudit.families import spec_from_config
from moeaudit.limits import MAX_CONFIG_BYTES, MAX_INDEX_BYTES
from moeaudit.spec.config import ModelSpec, parse_config

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt")


# RoPE buffers that older transformers versions saved beside the weights; transformers never loads
# them (non-persistent buffers, recomputed from config.json), and neither does the replay
ROTARY_BUFFER = re.compile(r"(?:^|\.)rotary_emb\.inv_freq$")
SHARED_MODULE = re.compile(r"\.mlp\.shared_experts?\.")  # a decoder layer's shared-expert module

# RMSNorm gains stored as w with the norm applying 1 + w (Qwen3-Next); the DeltaNet's gated
# output norm (lin_norm) applies its weight as stored.
ZERO_CENTRED_NORMS = frozenset({"input_norm", "post_norm", "q_norm", "k_norm"})


class Checkpoint:
    """A validated MoE checkpoint directory: Hugging Face ``save_pretrained`` safetensors, or a
    torch.distributed.checkpoint (DCP) directory with the model's ``config.json`` beside its
    ``.metadata`` (``dcp``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError("no such checkpoint directory", path=self.path)
        if not self.path.is_dir():
            raise CheckpointError(
                "not a directory", path=self.path, hint="pass the save_pretrained directory, not a file"
            )
        self._pins: dict[str, FileId] = {}  # relative path → identity at its first read
        self._hashed: dict[str, bytes] = {}  # relative path → SHA-256 of the bytes parsed
        self._snapshot: Snapshot | None = None
        self.config: dict[str, Any] = self._read_config()
        self.spec: ModelSpec = spec_from_config(self.config, self.path / "config.json")
        self.layout = self.spec.layout
        self.files: dict[str, SafetensorsFile | DcpDirectory] = {}
        self.key_file: dict[str, str] = {}
        self.warnings: list[str] = []
        self.notes: list[str] = []  # recognised and deliberately left out (not a problem)
        self.left_out: list[LeftOut] = []  # the same, as records for the receipts
        self._open_files()
        self.fp8_block = _fp8_block(self.config, self.path / "config.json")
        self.packed = self._find_mxfp4()  # dequantised key → (blocks key, scales key)
        self.scales = {
            k[: -len(SCALE_SUFFIX)]: k for k in self.key_file if k.endswith(SCALE_SUFFIX)
        }  # weight key → its block scales' key
        self._resolved: dict[str, str] = {}
        self.fused = self._detect_fused()
        self._validate()

    # ----- files -------------------------------------------------------------------------

    def _read_config(self) -> dict[str, Any]:
        cfg_path = self.path / "config.json"
        refuse_unreadable(self.path)  # no config.json, or a PEFT adapter instead of weights
        raw, self._pins["config.json"] = read_bytes(cfg_path, limit=MAX_CONFIG_BYTES)
        self._hashed["config.json"] = hashlib.sha256(raw).digest()
        return parse_config(raw, cfg_path)

    def read_member(self, name: str, limit: int) -> bytes:
        """A small file of this checkpoint that some step reads on its own (``trainer_state.json``)
        read once, pinned, and hashed from the bytes returned: the root digest covers exactly
        these bytes — or, were it taken before, they must hash to its part of it
        (docs/security.md, "One read per input")."""
        path = self.path / name
        raw, fid = read_bytes(path, expect=self._pins.get(name), limit=limit)
        sha = hashlib.sha256(raw).digest()
        before = self._hashed.get(name) or (
            bytes.fromhex(self._snapshot.files[name][1])
            if self._snapshot is not None and name in self._snapshot.files
            else None
        )
        if before is not None and before != sha:
            raise changed(path, "its bytes no longer hash to the digest")
        self._pins.setdefault(name, fid)
        self._hashed[name] = sha
        return raw

    def _open_files(self) -> None:
        index = self.path / INDEX_NAME
        single = self.path / SINGLE_NAME
        if is_dcp(self.path):
            self._open_dcp(index, single)
            return
        if index.is_file() and single.is_file():
            # transformers loads model.safetensors and never reads the index; we would read
            # the shards: two readers, two models. Refuse rather than pick one (docs/decisions.md, "Ambiguous weights").
            raise CheckpointError(
                f"both {SINGLE_NAME} and {INDEX_NAME}: which weights are the checkpoint is ambiguous",
                path=self.path,
                hint=f"delete the stale one (transformers would load {SINGLE_NAME})",
            )
        if index.is_file():
            weight_map = self._read_index(index)
            for shard in sorted(set(weight_map.values())):
                shard_path = self.path / shard
                if Path(shard).name != shard or not shard_path.is_file():
                    raise CheckpointError(f"index names shard {shard!r}, which is missing", path=index)
                self._open_shard(shard)
            for key, shard in weight_map.items():
                if key not in self.files[shard].tensors:
                    raise CheckpointError(f"index maps {key!r} to {shard}, which lacks it", path=index)
                self.key_file[key] = shard
            self._refuse_strays(INDEX_NAME)
            self._refuse_repeated_names()
        elif single.is_file():
            self._open_shard(SINGLE_NAME)
            self.key_file = dict.fromkeys(self.files[SINGLE_NAME].tensors, SINGLE_NAME)
            self._refuse_strays(SINGLE_NAME)
        else:
            pickled = [n for n in PICKLE_NAMES if (self.path / n).exists()]
            hint = (
                "pickled weights are never loaded; convert them to safetensors "
                "(save_pretrained(..., safe_serialization=True))"
                if pickled
                else "expected model.safetensors or model.safetensors.index.json"
            )
            raise CheckpointError("no safetensors weights", path=self.path, hint=hint)

    def _open_dcp(self, index: Path, single: Path) -> None:
        """A DCP directory: tensors named as Hugging Face names (``DcpDirectory.map_names``)."""
        others = [p.name for p in (single, index) if p.exists()]
        if others:  # as for model.safetensors beside its index: two readers, two models
            raise CheckpointError(
                f"both {METADATA_NAME} and {others[0]}: which weights are the checkpoint is ambiguous",
                path=self.path,
                hint="keep one format per checkpoint directory",
            )
        dcp = DcpDirectory(self.path)
        left = dcp.map_names(self.spec.family)
        self.files[METADATA_NAME] = dcp
        self._refuse_strays(METADATA_NAME)  # a *.safetensors beside it: another reader's model
        self._pins.update(dcp.pins)
        self.key_file = dict.fromkeys(dcp.tensors, METADATA_NAME)
        if left or dcp.byte_entries:
            shown = ", ".join((left + dcp.byte_entries)[:3])
            self.left_out.append(
                LeftOut(
                    "DCP entries that are not model weights",
                    "optimizer or trainer state",
                    tuple(left + dcp.byte_entries),
                )
            )
            self.notes.append(
                f"{len(left)} DCP tensor(s) and {len(dcp.byte_entries)} pickled entr"
                f"{'y' if len(dcp.byte_entries) == 1 else 'ies'} that are not model "
                f"weights left out (optimizer or trainer state: {shown}…)"
            )

    def _refuse_strays(self, read: str) -> None:
        """Refuse a weight file beside the ones read (:func:`weight_files`): a shard the index
        does not reference, or any weight file beside a single ``model.safetensors`` or a DCP
        ``.metadata``. Another loader may read it (a stale ``pytorch_model.bin`` is what
        ``use_safetensors=False`` loads), and a rename that keeps the root digest makes it the
        checkpoint (docs/security.md): refused as :meth:`_set_aside` refuses a tensor the replay
        does not use."""
        stray = [n for n in weight_files(self.path) if n not in self.files]
        if stray:
            shown = ", ".join(stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
            why = "the shard index does not reference" if read == INDEX_NAME else f"beside {read}"
            raise CheckpointError(
                f"{len(stray)} weight file(s) {why}: {shown}",
                path=self.path / stray[0],
                hint="another loader could read them, so which weights are the checkpoint is ambiguous; "
                "move them out of the checkpoint directory",
            )

    def _refuse_repeated_names(self) -> None:
        """A tensor name stored in two shards: the index maps it to one of them, but a loader
        that reads every shard of the index keeps whichever copy it reads last."""
        where: dict[str, list[str]] = {}
        for name, f in sorted(self.files.items()):
            for key in f.tensors:
                where.setdefault(key, []).append(name)
        repeated = sorted(k for k, files in where.items() if len(files) > 1)
        if repeated:
            key = repeated[0]
            more = f" (and {len(repeated) - 1} more tensor(s))" if len(repeated) > 1 else ""
            raise CheckpointError(
                f"tensor {key!r} is stored in {' and '.join(where[key])}{more}: which copy is the "
                "checkpoint depends on the loader",
                path=self.path / where[key][-1],
                hint="save the checkpoint again so that each tensor is stored once",
            )

    def _open_shard(self, name: str) -> None:
        sf = SafetensorsFile(self.path / name, sealed=True)
        assert sf.identity is not None
        self.files[name], self._pins[name] = sf, sf.identity

    def _read_index(self, index: Path) -> dict[str, str]:
        raw, self._pins[INDEX_NAME] = read_bytes(index, limit=MAX_INDEX_BYTES)
        self._hashed[INDEX_NAME] = hashlib.sha256(raw).digest()
        try:
            data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
            weight_map = data["weight_map"]
        except DuplicateKey as exc:
            raise CheckpointError(f"the shard index repeats the key {exc.key!r}", path=index) from exc
        except (ValueError, RecursionError, KeyError, TypeError) as exc:
            raise CheckpointError(f"unreadable shard index ({exc})", path=index) from exc
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError("weight_map must map tensor names to shard files", path=index)
        return weight_map

    def _find_mxfp4(self) -> dict[str, tuple[str, str]]:
        """MXFP4 expert tensors (``<key>_blocks`` + ``<key>_scales``), when config.json says the
        weights are MXFP4; only the interleaved expert layout (gpt-oss) is stored so."""
        if not mxfp4.is_mxfp4(self.config):
            return {}
        if self.layout.fused_format != "interleaved":
            raise CheckpointError(
                f"MXFP4 weights are read for gpt_oss only, not {self.spec.family!r}", path=self.path / "config.json"
            )
        stems = [k[: -len(mxfp4.BLOCKS_SUFFIX)] for k in self.key_file if k.endswith(mxfp4.BLOCKS_SUFFIX)]
        return {
            s: (s + mxfp4.BLOCKS_SUFFIX, s + mxfp4.SCALES_SUFFIX)
            for s in stems
            if s + mxfp4.SCALES_SUFFIX in self.key_file
        }

    def info(self, key: str) -> TensorInfo:
        return self.files[self.key_file[key]].tensors[key]

    def read_stored(self, key: str) -> torch.Tensor:
        """The tensor exactly as stored (an FP8 weight in float8, without its scales)."""
        return self.files[self.key_file[key]].read(key)

    def read(self, key: str) -> torch.Tensor:
        """The tensor as stored; a block-scaled FP8 weight comes back dequantised in float32, an
        MXFP4 one (``key`` names its blocks and scales) in bfloat16, both exactly."""
        if key in self.packed:
            import torch

            blocks, scales = (self.files[self.key_file[k]].read(k) for k in self.packed[key])
            return mxfp4.dequantize(blocks, scales, torch.bfloat16)
        t = self.files[self.key_file[key]].read(key)
        scale_key = self.scales.get(key)
        if scale_key is None:
            return t
        return dequantize_fp8(t, self.files[self.key_file[scale_key]].read(scale_key), self.fp8_block or (128, 128))

    # ----- layout resolution ---------------------------------------------------------------

    def _resolve(self, name: str, templates: tuple[str, ...], **fmt: int) -> str | None:
        """The on-disk key for a canonical name; picks the template variant once, by layer."""
        if name in self._resolved:
            key = self._resolved[name].format(**fmt)
            return key if key in self.key_file or key in self.packed else None
        for template in templates:
            if template.format(**fmt) in self.key_file or template.format(**fmt) in self.packed:
                self._resolved[name] = template
                return template.format(**fmt)
        return None

    def _detect_fused(self) -> bool:
        self.fused_format = self.layout.fused_format
        first = self.spec.routed_layers[0] if self.spec.routed_layers else None
        if first is None:
            return False
        name = "up" if self.fused_format == "up_down" else "gate_up"  # Nemotron-H: no gate
        fused = self._resolve(name, self.layout.fused.get(name, ()), layer=first)
        if fused is not None:
            self.fused_format = self.layout.fused_formats.get(self._resolved[name], self.fused_format)
        if fused is not None and self.fused_format == "stacked_or_transposed":
            # Qwen3-VL-MoE: the released files hold gate_up [E, H, 2I], transformers 5.24's
            # save_pretrained writes [E, 2I, H]; the stored shape says which (H = 2I reads as stacked)
            shape, s = self.info(fused).shape, self.spec
            self.fused_format = (
                "transposed"
                if shape[1:] == (s.hidden_size, 2 * s.expert_dim) and s.hidden_size != 2 * s.expert_dim
                else "stacked"
            )
        return fused is not None

    def global_key(self, name: str) -> str | None:
        return self._resolve(name, self.layout.globals[name])

    def layer_keys(self, layer: int) -> dict[str, str]:
        """canonical name → on-disk key for every tensor this layer must have."""
        out = {}
        for name in self._expected_layer_names(layer):
            key = self._resolve(name, self.layout.layer[name], layer=layer)
            if key is None:
                key = self.layout.layer[name][0].format(layer=layer)
            out[name] = key
        return out

    def expert_keys(self, layer: int) -> dict[str, str] | list[dict[str, str]]:
        if self.fused:
            return {
                n: self._resolve(n, t, layer=layer) or t[0].format(layer=layer) for n, t in self.layout.fused.items()
            }
        return [
            {
                n: self._resolve(n, t, layer=layer, expert=e) or t[0].format(layer=layer, expert=e)
                for n, t in self.layout.expert.items()
            }
            for e in range(self.spec.parametric_experts)  # LongCat's zero-computation experts have no weights
        ]

    def _expected_layer_names(self, layer: int) -> list[str]:
        return expected_layer_names(self.spec, layer)

    # ----- validation ----------------------------------------------------------------------

    def expected_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        return expected_shapes(self.spec, self.fused_format, layer)

    def _check(self, name: str, key: str, want: tuple[int, ...], seen: set[str]) -> None:
        if key in self.packed:
            self._check_mxfp4(key, want, seen)
            return
        if key not in self.key_file:
            raise CheckpointError(
                f"missing tensor {key!r} ({name})",
                path=self.path,
                hint="the checkpoint is incomplete or of another layout",
            )
        info = self.info(key)
        if name == "router_bias" and info.shape == (1, *want):  # ERNIE 4.5 stores it as [1, E]
            want = info.shape
        stored = self.layout.stored.get(self._resolved.get(name, ""))
        if stored == "transposed":
            want = want[::-1]
        elif stored == "first_row" and len(info.shape) == 2 and info.shape[0] >= 1:
            want = (info.shape[0], *want)
        if info.shape != want:
            raise CheckpointError(
                f"tensor {key!r} has shape {list(info.shape)} but config.json implies {list(want)}",
                path=self.path / self.key_file[key],
            )
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {key!r} has non-float dtype {info.dtype}", path=self.path / self.key_file[key]
            )
        if key in self.scales:
            self._check_scale(key, info, seen)
        elif info.dtype.startswith("F8"):
            raise CheckpointError(
                f"tensor {key!r} is {info.dtype} without {key + SCALE_SUFFIX!r}: an FP8 weight needs its block scales",
                path=self.path / self.key_file[key],
            )
        seen.add(key)

    def _check_mxfp4(self, key: str, want: tuple[int, ...], seen: set[str]) -> None:
        """``key``'s uint8 blocks and scales hold a [E, in, out] = ``want`` tensor."""
        shapes = mxfp4.packed_shapes(want)
        for k, shape in zip(self.packed[key], shapes or ((), ()), strict=True):
            info = self.info(k)
            if shapes is None or info.shape != shape or info.dtype != "U8":
                need = (
                    f"uint8 {list(shape)}"
                    if shapes
                    else f"an input size that is a multiple of {mxfp4.BLOCK} (got {want[1]})"
                )
                raise CheckpointError(
                    f"MXFP4 tensor {k!r} is {info.dtype} {list(info.shape)}; {list(want)} needs {need}",
                    path=self.path / self.key_file[k],
                )
            seen.add(k)

    def _check_scale(self, key: str, info: TensorInfo, seen: set[str]) -> None:
        """DeepSeek-V3's block FP8: weight [out, in] with float scales [⌈out/bm⌉, ⌈in/bn⌉]."""
        scale_key = self.scales[key]
        scale = self.info(scale_key)
        where = self.path / self.key_file[scale_key]
        if len(info.shape) != 2:
            raise CheckpointError(f"block scales for {key!r}, which is not a matrix", path=where)
        bm, bn = self.fp8_block or (128, 128)
        want = (-(-info.shape[0] // bm), -(-info.shape[1] // bn))
        if scale.shape != want or scale.dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(
                f"tensor {scale_key!r} is {scale.dtype} {list(scale.shape)}; {bm}×{bn} blocks of "
                f"{key!r} {list(info.shape)} need float {list(want)}",
                path=where,
            )
        seen.add(scale_key)

    def _validate(self) -> None:
        s = self.spec
        seen: set[str] = set()
        V, H = s.vocab_size, s.hidden_size
        for name, want in (("embed", (V, H)), ("final_norm", (H,))):
            self._check(name, self.global_key(name) or self.layout.globals[name][0], want, seen)
        hc = 0 if s.hc is None else s.hc.streams
        for name, on, want in (
            ("final_norm_bias", s.layer_norm and s.norm_bias, (H,)),
            ("lm_head_bias", s.lm_head_bias, (V,)),
            ("hc_head_fn", bool(hc), (hc, hc * H)),  # HY-V4: the streams' final mix
            ("hc_head_base", bool(hc), (hc,)),
            ("hc_head_scale", bool(hc), (1,)),
        ):
            if on:
                self._check(name, self.global_key(name) or self.layout.globals[name][0], want, seen)
        head = self.global_key("lm_head")
        if head is not None:
            self._check("lm_head", head, (V, H), seen)
        elif not s.tie_embeddings:
            raise CheckpointError("missing tensor 'lm_head.weight' and embeddings are not tied", path=self.path)
        for layer in range(s.num_layers):
            shapes = self.expected_shapes(layer)
            for name, key in self.layer_keys(layer).items():
                self._check(name, key, shapes[name], seen)
            if s.is_routed(layer):
                keys = self.expert_keys(layer)
                for table in keys if isinstance(keys, list) else [keys]:
                    for name, key in table.items():
                        self._check(name, key, shapes[name], seen)
        self._set_aside(sorted(set(self.key_file) - seen))

    def _set_aside(self, extra: list[str]) -> None:
        """Tensors the replay does not read: those on the family's ignore list are recorded in
        ``left_out`` (receipts name them); any other is an error, because replaying without it
        would audit another model than the file holds (docs/decisions.md, "Extra tensors": DeepSeek-V2's ``mlp_bias``
        tensors were warned about and dropped, and every receipt moved)."""
        s = self.spec
        rope = [k for k in extra if ROTARY_BUFFER.search(k)]
        if rope:
            self._leave_out(
                "rotary inv_freq buffers",
                "RoPE frequencies are computed from config.json, as transformers does (it does not load these buffers)",
                rope,
            )
        # the MTP modules stored as decoder layers N … N + mtp_layers − 1 (DeepSeek-V3's layer 61)
        mtp_layers = {
            k: i
            for k in extra
            if (i := _layer_index(k)) is not None and s.num_layers <= i < s.num_layers + s.mtp_layers
        }
        mtp = list(mtp_layers)
        if mtp:
            layers = ", ".join(map(str, sorted(set(mtp_layers.values()))))
            self._leave_out(
                f"multi-token-prediction layer(s) {layers}", "the replay scores next-token prediction only", mtp
            )
        # n_shared_experts = 0: transformers still builds the shared MLP, zero units wide, and
        # saves its empty weights (DeepSeek-V2/V3, GLM-4-MoE, AFMoE); an empty tensor adds nothing
        empty_shared = [k for k in extra if not s.shared_dim and SHARED_MODULE.search(k) and 0 in self.info(k).shape]
        if empty_shared:
            self._leave_out(
                "zero-width shared experts",
                "the config has no shared expert (n_shared_experts = 0): transformers saves empty "
                "shared-expert weights, which add nothing",
                empty_shared,
            )
        taken = set(rope) | set(mtp) | set(empty_shared)
        extra = [k for k in extra if k not in taken]
        by_what: dict[str, list[str]] = {}  # several prefixes may name one module (ERNIE's MTP)
        for prefix, what in self.layout.left_out.items():
            # "{layer}" in a prefix stands for any layer index (A.X-K1's unused norm on dense layers)
            starts = re.compile(re.escape(prefix).replace(re.escape("{layer}"), r"\d+")).match
            by_what.setdefault(what, []).extend(k for k in extra if starts(k))
            extra = [k for k in extra if not starts(k)]
        for what, left in by_what.items():
            if left:
                self._leave_out(what, "the replay audits next-token prediction of the text decoder", left)
        if extra:
            # a few names (each cut to 120 characters: the error stays one short line), then a count
            shown = ", ".join(k if len(k) <= 120 else k[:119] + "…" for k in extra[:3])
            shown += f" and {len(extra) - 3} more" if len(extra) > 3 else ""
            raise CheckpointError(
                f"{len(extra)} tensor(s) that moeaudit's {s.family} replay does not use: {shown}",
                path=self.path,
                hint="moeaudit refuses to audit a model other than the one in the file: if these "
                "are part of the model, moeaudit does not replay them yet; if they are not "
                "model weights (optimizer or trainer state), save the checkpoint without them",
            )

    def _leave_out(self, what: str, reason: str, keys: list[str]) -> None:
        self.left_out.append(LeftOut(what, reason, tuple(keys)))
        self.notes.append(f"{what} ({len(keys)} tensors) left out: {reason}")

    # ----- reading -------------------------------------------------------------------------

    def read_global(self, name: str, dtype: torch.dtype | None | str = "float32") -> torch.Tensor:
        """Embeddings, final norm or LM head (float32 unless told); ``dtype=None`` keeps the
        on-disk dtype."""
        import torch

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        key = self.global_key(name)
        if key is None and name == "lm_head":
            key = self.global_key("embed")
        assert key is not None
        t = self.read(key)
        if name == "final_norm" and self.spec.norm_offset:  # the gain 1 + w, formed in the compute dtype
            return t.to(dtype or torch.float32) + self.spec.norm_offset
        return t if dtype is None else t.to(dtype)

    def layer_weights(
        self,
        layer: int,
        dtype: torch.dtype | None = None,
        *,
        lazy_experts: bool = False,
        device: torch.device | str | None = None,
    ) -> LayerWeights:
        """One decoder layer in ``dtype`` (default float32). ``lazy_experts`` keeps the routed
        experts in their on-disk dtype and converts one expert at a time on access
        (:class:`StoredExperts`); otherwise every tensor is converted now (what a trainer that
        updates them in place needs). ``device``: the layer's other tensors cross in their
        on-disk dtype and are converted there (the same values: widening is exact)."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        params = {n: self._on(self.read(k), device).to(dtype) for n, k in self.layer_keys(layer).items()}
        for n in params.keys() & {n for n, t in self._resolved.items() if t in self.layout.stored}:
            how = self.layout.stored[self._resolved[n]]  # ERNIE 4.5 VL: back to the canonical form
            params[n] = params[n].T.contiguous() if how == "transposed" else params[n][0].contiguous()
        if "router_bias" in params:
            params["router_bias"] = params["router_bias"].reshape(-1)  # [1, E] (ERNIE) → [E]
        if "shared_gate_up" in params:  # Granite 4.0: [gate | up] rows of the shared MLP
            w1, w3 = params.pop("shared_gate_up").chunk(2, dim=0)
            params["shared_w1"], params["shared_w3"] = w1.clone(), w3.clone()
        if self.spec.norm_offset:  # canonical gains: γ = 1 + w for zero-centred norms
            for n in ZERO_CENTRED_NORMS & params.keys():
                params[n] = params[n] + self.spec.norm_offset
        lw = LayerWeights(layer=layer, routed=self.spec.is_routed(layer), params=params)
        if lw.routed:
            experts = self._stored_experts(layer, dtype)
            lw.experts = experts if lazy_experts else [{n: t.contiguous() for n, t in w.items()} for w in experts]
        return lw

    @staticmethod
    def _on(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
        return t if device is None else t.to(device, non_blocking=True)

    def _stored_experts(self, layer: int, dtype: torch.dtype) -> StoredExperts:
        """The layer's experts as stored, converted one at a time on access; MXFP4 and block-scaled
        FP8 experts stay packed until then."""
        keys = self.expert_keys(layer)
        if isinstance(keys, dict) and keys.get("gate_up") in self.packed and keys["down"] in self.packed:
            (gu_b, gu_s), (d_b, d_s) = self.packed[keys["gate_up"]], self.packed[keys["down"]]
            gate_up_b, gate_up_s, down_b, down_s = (
                self.files[self.key_file[k]].read(k) for k in (gu_b, gu_s, d_b, d_s)
            )
            b_gu, b_down = self.read(keys["gate_up_bias"]), self.read(keys["down_bias"])
            return MXFP4Experts(
                [
                    {
                        "gate_up_blocks": gate_up_b[e],
                        "gate_up_scales": gate_up_s[e],
                        "down_blocks": down_b[e],
                        "down_scales": down_s[e],
                        "gate_up_bias": b_gu[e],
                        "down_bias": b_down[e],
                    }
                    for e in range(self.spec.num_experts)
                ],
                dtype,
            )
        zero: list[dict[str, torch.Tensor]] = [{} for _ in range(self.spec.zero_experts)]  # identity experts
        if isinstance(keys, list) and any(k in self.scales for table in keys for k in table.values()):
            return FP8Experts(
                [{m: t for n, k in table.items() for m, t in self._fp8_stored(n, k)} for table in keys] + zero,
                dtype,
                self.fp8_block or (128, 128),
            )
        return StoredExperts(self._read_experts(layer) + zero, dtype)

    def _fp8_stored(self, name: str, key: str) -> Iterator[tuple[str, torch.Tensor]]:
        """``name``'s tensor as stored, and its block scales when it has them."""
        yield name, self.read_stored(key)
        if key in self.scales:
            yield name + SCALE_SUFFIX, self.read_stored(self.scales[key])

    def _read_experts(self, layer: int) -> list[dict[str, torch.Tensor]]:
        """Every expert's w1, w3, w2 in the on-disk dtype (views into the fused tensors)."""
        keys = self.expert_keys(layer)
        if isinstance(keys, list):
            return [{n: self.read(k) for n, k in table.items()} for table in keys]
        I = self.spec.expert_dim
        if self.fused_format == "flat":  # DBRX: gate w1, up v1, down w2 (transposed), each [E·I, H]
            E, H = self.spec.num_experts, self.spec.hidden_size
            w1, w3, w2 = (self.read(keys[n]).view(E, I, H) for n in ("gate_up", "up", "down"))
            return [{"w1": w1[e], "w3": w3[e], "w2": w2[e].T} for e in range(E)]
        if self.fused_format == "split":  # Step 3.5: gate [E, I, H], up [E, I, H], down [E, H, I]
            w1, w3, w2 = (self.read(keys[n]) for n in ("gate_up", "up", "down"))
            return [{"w1": w1[e], "w3": w3[e], "w2": w2[e]} for e in range(self.spec.num_experts)]
        if self.fused_format == "up_down":  # Nemotron-H's non-gated experts: up [E, I, H], down [E, H, I]
            up, down = self.read(keys["up"]), self.read(keys["down"])
            return [{"w1": up[e], "w2": down[e]} for e in range(self.spec.num_experts)]
        gate_up, down = self.read(keys["gate_up"]), self.read(keys["down"])
        if self.fused_format in ("interleaved", "interleaved_rows"):  # gpt-oss: gate/up alternate
            if self.fused_format == "interleaved":  # transformers: [E, H, 2I], [E, I, H]
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            b_gu, b_down = self.read(keys["gate_up_bias"]), self.read(keys["down_bias"])
            return [
                {
                    "w1": gate_up[e, 0::2],
                    "w3": gate_up[e, 1::2],
                    "w2": down[e],
                    "b1": b_gu[e, 0::2],
                    "b3": b_gu[e, 1::2],
                    "b2": b_down[e],
                }
                for e in range(self.spec.num_experts)
            ]
        if self.fused_format == "transposed":  # Llama 4: [E, H, 2I], gate columns first
            return [
                {"w1": gate_up[e, :, :I].T, "w3": gate_up[e, :, I:].T, "w2": down[e].T}
                for e in range(self.spec.num_experts)
            ]
        return [{"w1": gate_up[e, :I], "w3": gate_up[e, I:], "w2": down[e]} for e in range(self.spec.num_experts)]

    # ----- summary -------------------------------------------------------------------------

    def _parameter_count(self) -> int:
        """Model parameters: an MXFP4 tensor counts its values (two per packed byte), not its bytes
        or its scales."""
        packed = {k for pair in self.packed.values() for k in pair}
        count = sum(math.prod(self.info(k).shape) for k in self.key_file if k not in packed)
        return count + sum(2 * math.prod(self.info(blocks).shape) for blocks, _ in self.packed.values())

    @property
    def quantization(self) -> str | None:
        """How quantised weights were read, for receipts (None: every weight read as stored)."""
        if self.packed:
            return f"MXFP4 experts ({len(self.packed)} tensors) dequantised exactly, one expert at a time"
        if self.scales and self.fp8_block:
            bm, bn = self.fp8_block
            return f"FP8 weights ({len(self.scales)} tensors, {bm}×{bn} block scales) dequantised to float32"
        return None

    @cached_property
    def digest(self) -> str:
        """The root digest: of the bytes parsed (config.json, index) and of the weight files as
        read once into private memory (``sealed``), which every tensor is then read from."""
        hashed = dict(self._hashed)
        for name, f in self.files.items():
            if isinstance(f, DcpDirectory):
                hashed.update(f.seal())
            else:
                hashed[name] = f.seal().sha256
        self._snapshot = snapshot(self.path, self._pins, hashed)
        return self._snapshot.digest

    @property
    def resources(self) -> list[dict[str, Any]]:
        """Every file the root digest covers (name, size, SHA-256), in its order."""
        if self._snapshot is None:
            _ = self.digest
        assert self._snapshot is not None
        return self._snapshot.resources

    @property
    def is_dcp(self) -> bool:
        return isinstance(self.files.get(METADATA_NAME), DcpDirectory)

    @property
    def data_files(self) -> list[str]:
        """The weight files read (a DCP directory's .metadata and .distcp files)."""
        dcp = self.files.get(METADATA_NAME)
        return dcp.data_files if isinstance(dcp, DcpDirectory) else sorted(self.files)

    def verify_unchanged(self) -> None:
        """Raise :class:`CheckpointError` naming the file if anything hashed or read has been
        replaced, rewritten, added or removed since (call it after a replay, before trusting
        or caching what the replay computed). The receipts do not rest on this (the bytes used
        are the bytes hashed, ``sealed``); it fails closed on a checkpoint that changed."""
        if self._snapshot is None:
            _ = self.digest
        assert self._snapshot is not None
        self._snapshot.verify()

    def summary(self, with_digest: bool = True) -> dict[str, Any]:
        """What ``inspect`` prints: from headers only, no tensor is read."""
        s = self.spec
        infos = [self.info(k) for k in self.key_file]
        dtypes = Counter(i.dtype for i in infos)
        out: dict[str, Any] = {
            "path": str(self.path),
            "family": s.family,
            "layers": s.num_layers,
            "routed_layers": list(s.routed_layers),
            "dense_layers": [i for i in range(s.num_layers) if not s.is_routed(i)],
            "experts": s.num_experts,
            "top_k": s.top_k,
            "routing": s.routing,
            "shared_expert": bool(s.shared_dim),
            "expert_storage": "fused" if self.fused else "per-expert",
            "hidden_size": s.hidden_size,
            "expert_dim": s.expert_dim,
            "heads": s.num_heads,
            "kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "vocab_size": s.vocab_size,
            **(
                {
                    "mla": {
                        "q_lora_rank": s.mla.q_lora_rank,
                        "kv_lora_rank": s.mla.kv_lora_rank,
                        "qk_nope_head_dim": s.mla.qk_nope_dim,
                        "qk_rope_head_dim": s.mla.qk_rope_dim,
                        "v_head_dim": s.mla.v_head_dim,
                    }
                }
                if s.mla is not None
                else {}
            ),
            **({"rope_scaling": f"yarn ×{s.rope.yarn.factor:g}"} if s.rope.yarn is not None else {}),
            **({"rotary_dim": s.rope.rotary_dim} if s.rope.rotary_dim else {}),  # partial rotary
            **(
                {"fp8_blocks": f"{self.fp8_block[0]}×{self.fp8_block[1]} ({len(self.scales)} block-scaled weights)"}
                if self.scales and self.fp8_block
                else {}
            ),
            **(
                {"mxfp4": f"{len(self.packed)} expert tensors in MXFP4 (blocks of {mxfp4.BLOCK})"}
                if self.packed
                else {}
            ),
            "dtypes": dict(sorted(dtypes.items())),
            "parameters": self._parameter_count(),
            "files": self.data_files,
            **({"format": "torch.distributed.checkpoint"} if self.is_dcp else {}),
            "tied_embeddings": self.global_key("lm_head") is None,
            "warnings": list(self.warnings),
            **({"notes": list(self.notes)} if self.notes else {}),
        }
        if with_digest:
            out["digest"] = {"sha256": self.digest}
        return out
