"""PyTorch's fused CPU kernels for symmetric integer weights and bfloat16 activations.

They cover two of hilt's integer formats exactly. QuantLinear runs row-wise int8 through them
(``PREFERRED_BITS``); the int4 one is kept as the peer `hilt bench decode` measures the LUT kernel
against:

* ``aten._weight_int4pack_mm_for_cpu``: group-wise 4-bit, ``W[n, k] = (q - 8) * scale + zero`` per
  group of 32-256 along k, float32 accumulation. A symmetric hilt int4 weight is that with zero = 0
  (its codebook is -8..7, so level c is c - 8). The kernel wants its own packed layout, which
  depends on the CPU's instruction set: it is made when a layer first runs (:func:`prepack`), kept
  beside the hilt codes, and never saved.
* ``aten._weight_int8pack_mm``: 8-bit with one scale per output row, ``W[n, k] = q * scale[n]``
  with q int8. A symmetric hilt int8 weight with one block per row is that with q = c - 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hilt.errors import HiltError
from hilt.kernels.lut_matmul import PackedWeight
from hilt.kernels.packing import unpack_codes

INT4_GROUPS = (32, 64, 128, 256)  # what the int4 kernel takes
_ROWS = 64  # the int4 kernel's widest row tile (AVX-512): pad N to it, convert in whole tiles


# The width QuantLinear runs through these kernels rather than the LUT kernel (kernels.lut_cpu): row-wise
# int8 at up to 16 rows of x, measured 1.3-1.6x faster at M = 1 (at 256 rows the LUT kernel's bfloat16
# bands are the faster: SmolLM2's int8 head made its prefill 0.43x dense through this kernel). At int4
# the two are level (docs/results/kernels.md), and the LUT kernel reads hilt's codes as stored where
# this one needs a second copy of the weight.
PREFERRED_BITS = (8,)


@dataclass(frozen=True, eq=False)
class IntPack:
    """The kernel's copy of a weight; calling it is :func:`int_matmul`."""

    bits: int  # 4: weight in the int4 kernel's layout (N rounded up to 64); 8: int8 (N, K)
    weight: torch.Tensor
    scales: torch.Tensor  # 4: bfloat16 (K / B, N rounded up, 2), scale and zero; 8: bfloat16 (N,)
    out_features: int
    in_features: int
    block_size: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int_matmul(x, self, bias)


def _symmetric_levels(w: PackedWeight) -> bool:
    half = 1 << (w.bits - 1)
    return torch.equal(w.codebook.float().cpu(), torch.arange(-half, half, dtype=torch.float32))


def supports(w: PackedWeight) -> bool:
    """Symmetric integers (codebook -2^(b-1) .. 2^(b-1) - 1, no offsets): 4-bit with a block the
    int4 kernel takes, or 8-bit with one block per row."""
    if w.offsets is not None or w.per_block_codebook:
        return False
    if w.bits == 4:
        fits = w.block_size in INT4_GROUPS and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    elif w.bits == 8:
        fits = w.block_size == w.in_features and hasattr(torch.ops.aten, "_weight_int8pack_mm")
    else:
        return False
    return fits and _symmetric_levels(w)


def prepack(w: PackedWeight, chunk_rows: int = 4096) -> IntPack:
    """The kernel's copy of ``w`` (4-bit: as many bytes as the codes plus twice the scales; 8-bit: the codes)."""
    n, k = w.out_features, w.in_features
    if w.bits == 8:
        return IntPack(8, (w.codes ^ 0x80).view(torch.int8), w.scales[:, 0].to(torch.bfloat16).contiguous(), n, k, k)
    rows = -(-n // _ROWS) * _ROWS
    codes, scales = w.codes, w.scales
    if rows != n:
        codes = torch.cat([codes, codes.new_zeros(rows - n, codes.shape[1])])
        scales = torch.cat([scales, scales.new_zeros(rows - n, scales.shape[1])])
    parts = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_codes(codes[r:r + chunk_rows], 4, k, torch.int32), 1)
             for r in range(0, rows, chunk_rows)]
    scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1).transpose(0, 1).contiguous()
    return IntPack(4, torch.cat(parts), scales_and_zeros.to(torch.bfloat16), n, k, w.block_size)


def int_matmul(x: torch.Tensor, pack: IntPack, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(w).T (+ bias) for bfloat16 x on the CPU, ``pack`` = :func:`prepack` (w), through
    PyTorch's fused integer kernels."""
    if x.shape[-1] != pack.in_features:
        raise HiltError(f"input has {x.shape[-1]} features, the weight expects {pack.in_features}")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if pack.bits == 4:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, pack.weight, pack.block_size, pack.scales)
        y = y[:, :pack.out_features]
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2, pack.weight, pack.scales)
    if bias is not None:
        y = (y.float() + bias.float()).to(y.dtype)
    return y.reshape(*x.shape[:-1], pack.out_features)
