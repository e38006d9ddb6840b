"""How the checkpoint reader holds a layer's tensors: ``LayerWeights`` in canonical names, the routed
experts kept in their on-disk dtype (bf16/fp16, gpt-oss's MXFP4, DeepSeek-V3's block-scaled FP8) and
converted one expert at a time on access, and the records of tensors left out on purpose. Torch is
imported by the functions that build tensors, not by this module."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from moeaudit.checkpoint import mxfp4
from moeaudit.errors import CheckpointError

if TYPE_CHECKING:
    import torch


class StoredExperts(Sequence["dict[str, torch.Tensor]"]):
    """A routed layer's experts kept in their on-disk dtype; ``experts[e]`` returns expert e's
    three matrices in the compute dtype, converted on access (docs/benchmarks.md §2: upcast per expert, not
    per layer), so a bf16 layer costs its bf16 bytes plus one float32 expert at a time.
    Converting bf16/fp16 to float32 is exact: the numbers are those of an eager upcast."""

    def __init__(self, stored: list[dict[str, torch.Tensor]], dtype: torch.dtype):
        self.stored, self.dtype = stored, dtype

    def __len__(self) -> int:
        return len(self.stored)

    def convert(self, w: dict[str, torch.Tensor], device: Any = None) -> dict[str, torch.Tensor]:
        """One expert's stored tensors → its canonical tensors in the compute dtype (moved to
        ``device`` first, so that the conversion runs there)."""
        return {n: (t if device is None else t.to(device)).to(self.dtype) for n, t in w.items()}

    def stored_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as held, for the non-finite check."""
        for e, w in enumerate(self.stored):
            for n, t in w.items():
                yield f"expert {e} {n}", t

    @overload
    def __getitem__(self, e: int) -> dict[str, torch.Tensor]: ...
    @overload
    def __getitem__(self, e: slice) -> list[dict[str, torch.Tensor]]: ...
    def __getitem__(self, e: int | slice) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
        if isinstance(e, slice):
            return [self[i] for i in range(*e.indices(len(self)))]
        return self.convert(self.stored[e])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self[e] for e in range(len(self)))


class MXFP4Experts(StoredExperts):
    """gpt-oss experts kept packed (MXFP4 codes and exponents, 4.25 bits a value); expert e is
    dequantised on access, exactly, into W1, W3 [I, H] (the gate and up rows of its
    ``gate_up_proj``, which alternate), W2 [H, I] and its three biases."""

    def convert(self, w: dict[str, torch.Tensor], device: Any = None) -> dict[str, torch.Tensor]:
        if device is not None:
            w = {n: t.to(device) for n, t in w.items()}
        gate_up = mxfp4.dequantize_rows(w["gate_up_blocks"], w["gate_up_scales"], self.dtype)  # [2I, H]
        b_gu = w["gate_up_bias"].to(self.dtype)
        return {
            "w1": gate_up[0::2],
            "w3": gate_up[1::2],
            "w2": mxfp4.dequantize_rows(w["down_blocks"], w["down_scales"], self.dtype),  # [H, I]
            "b1": b_gu[0::2],
            "b3": b_gu[1::2],
            "b2": w["down_bias"].to(self.dtype),
        }

    def stored_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for e, w in enumerate(self.stored):
            for n, t in w.items():
                if n.endswith("_blocks"):
                    continue  # E2M1 codes: no NaN or Inf among them
                yield f"expert {e} {n}", mxfp4.nan_marker(t) if n.endswith("_scales") else t


class FP8Experts(StoredExperts):
    """Block-scaled FP8 experts (DeepSeek-V3 as released) kept as stored: each weight in
    float8_e4m3fn (one byte a value) beside its float block scales (``<name>_scale_inv``, one
    per bm × bn block). Expert e is dequantised on access — after its stored bytes are moved to
    the device that computes (``DeviceExperts``: a quarter of float32's bytes cross) — into
    the float32 products w · s that :meth:`Checkpoint.read` gives, so the host never holds a
    layer's experts in float32, only one expert's while the host computes (docs/decisions.md,
    "FP8 and MXFP4 weights")."""

    def __init__(self, stored: list[dict[str, torch.Tensor]], dtype: torch.dtype, block: tuple[int, int]):
        super().__init__(stored, dtype)
        self.block = block

    def convert(self, w: dict[str, torch.Tensor], device: Any = None) -> dict[str, torch.Tensor]:
        if device is not None:
            w = {n: t.to(device) for n, t in w.items()}
        return {
            n: (t if (s := w.get(n + SCALE_SUFFIX)) is None else dequantize_fp8(t, s, self.block)).to(self.dtype)
            for n, t in w.items()
            if not n.endswith(SCALE_SUFFIX)
        }

    def stored_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for e, w in enumerate(self.stored):
            for n, t in w.items():
                if n.endswith(SCALE_SUFFIX):
                    continue  # checked with its weight: a non-finite scale is a non-finite w · s
                s = w.get(n + SCALE_SUFFIX)
                yield f"expert {e} {n}", t if s is None else fp8_nonfinite_marker(t, s, self.block)


@dataclass
class LayerWeights:
    """One decoder layer in canonical names (see ``layouts``), float tensors."""

    layer: int
    routed: bool
    params: dict[str, torch.Tensor]
    experts: Sequence[dict[str, torch.Tensor]] = field(default_factory=list)  # w1, w3, w2 each

    def tensors(self) -> list[torch.Tensor]:
        return list(self.params.values()) + [t for e in self.experts for t in e.values()]

    def stored_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as held in memory: lazy experts in their on-disk dtype, not converted."""
        yield from self.params.items()
        if isinstance(self.experts, StoredExperts):
            yield from self.experts.stored_items()
            return
        for e, w in enumerate(self.experts):
            for n, t in w.items():
                yield f"expert {e} {n}", t

    def requires_grad_(self) -> LayerWeights:
        for t in self.tensors():
            t.requires_grad_(True)
        return self


@dataclass(frozen=True)
class LeftOut:
    """Tensors on the family's ignore list (``Layout.left_out``, multi-token-prediction layers,
    rotary buffers, a DCP directory's optimizer state): recognised, deliberately not replayed,
    and named in the receipts (docs/decisions.md, "Extra tensors")."""

    what: str
    reason: str
    keys: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "reason": self.reason,
            "tensors": len(self.keys),
            "names": list(self.keys[:LEFT_OUT_NAMES]),
        }


LEFT_OUT_NAMES = 5  # names written into the receipts per entry (the count is always exact)


SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3's per-block FP8 dequantisation factors


def _fp8_block(cfg: dict[str, Any], path: Path) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of an FP8 checkpoint (DeepSeek-V3: 128×128)."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size", [128, 128])
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(f"config.json: weight_block_size must be two positive ints, got {block!r}", path=path)
    return block[0], block[1]


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w · s per (bm × bn) block, in float32 (DeepSeek-V3's ``weight_dequant``; the last blocks
    of a dimension that is not a multiple of the block size are partial). Runs where ``w`` is
    and allocates one float32 matrix (the result, scaled in place; where the blocks tile the
    matrix the scales are broadcast, not expanded): the products are those of ``w.float() · s``."""
    import torch

    bm, bn = block
    rows, cols = w.shape
    out = w.to(torch.float32, copy=True)
    s = scale.to(torch.float32)
    gr, gc = s.shape
    if rows == gr * bm and cols == gc * bn:
        out.view(gr, bm, gc, bn).mul_(s[:, None, :, None])
    else:
        out.mul_(s.repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bn, dim=1)[:, :cols])
    return out


E4M3_NAN = 0x7F  # float8_e4m3fn: S.1111.111 is NaN; no Inf; magnitudes 0x00-0x7E increase with the code


def _largest_e4m3_code(w: torch.Tensor) -> int:
    """The largest magnitude code (sign bit cleared) of an e4m3fn tensor, from two byte-wide
    reductions and no temporary: as int8 the largest positive code; as uint8, when a negative
    value exists, the negative code of largest magnitude (0x80 | m)."""
    import torch

    largest_neg = int(w.view(torch.uint8).max())
    largest_pos = int(w.view(torch.int8).max())  # negative when every value is
    return max(largest_pos, largest_neg & E4M3_NAN if largest_neg & 0x80 else 0)


def fp8_nonfinite_marker(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A one-element tensor, NaN when the dequantised w · s holds a NaN or Inf, else 0: what the
    non-finite check sees for a weight kept as stored, without forming w · s. A non-finite scale
    makes its whole block non-finite (x · Inf is Inf or NaN); with finite scales, the largest
    |w| times the largest |s| bounds every product and float32 rounding is monotone, so a finite
    bound settles it from the codes' bytes (one byte a value). Only a weight whose bound
    overflows (or one not in e4m3fn) is dequantised to look, exactly."""
    import torch

    s = scale.to(torch.float32)
    if not bool(torch.isfinite(s).all()):
        return torch.tensor(float("nan"))
    if w.dtype == torch.float8_e4m3fn and w.numel():
        code = _largest_e4m3_code(w)
        if code == E4M3_NAN:
            return torch.tensor(float("nan"))
        largest = torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        if bool(torch.isfinite(largest * s.abs().max())):
            return torch.tensor(0.0)
    finite = bool(torch.isfinite(dequantize_fp8(w, scale, block)).all())
    return torch.tensor(0.0 if finite else float("nan"))
