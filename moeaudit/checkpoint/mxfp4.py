"""MXFP4 expert weights (OCP Microscaling FP4, gpt-oss's released checkpoints).

A quantised tensor W [E, out, in] is stored as two uint8 tensors: ``<name>_blocks``
[E, out, in/32, 16], two E2M1 codes per byte (low nibble first), and ``<name>_scales``
[E, out, in/32], one E8M0 exponent (bias 127) per block of 32 values. W = fp4(code) ·
2^(scale − 127). Every value is exactly representable in bfloat16 and float32 (one mantissa
bit, an 8-bit exponent range), so dequantising is exact; the replay then sees the
``[E, in, out]`` tensor transformers' ``convert_moe_packed_tensors`` hands the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BLOCK = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# E2M1: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(cfg: dict[str, Any]) -> bool:
    q = cfg.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def packed_shapes(want: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(blocks, scales) shapes for a dequantised ``want`` = [E, in, out]; None when ``in`` is
    not a whole number of blocks."""
    E, n_in, n_out = want
    if n_in % BLOCK:
        return None
    return (E, n_out, n_in // BLOCK, BLOCK // 2), (E, n_out, n_in // BLOCK)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, out, G, 16] codes and [E, out, G] exponents → W [E, in = 32·G, out] in ``dtype``."""
    import torch

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)  # low nibble first
    E, n_out, G, _ = blocks.shape
    w = torch.ldexp(values.reshape(E, n_out, G, BLOCK), (scales.to(torch.int32) - 127)[..., None])
    return w.reshape(E, n_out, G * BLOCK).to(dtype).transpose(1, 2)
