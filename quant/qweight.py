"""The one in-memory type for every quantized weight format.

The same object is written to disk (quant.checkpoint), run by QuantLinear,
taken by the kernels and lowered by the ONNX export. k-means with 2 levels is
the 1-bit format; integer formats are uniform codebooks; asymmetric integers
add a per-block offset.

    W[n, k] = codebook[code[n, k]] * scales[n, k // block_size] (+ offsets[n, k // block_size])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hilt.kernels import dequantize_lut, packed_row_bytes

METHODS = ("kmeans", "int", "int-asym", "binary")


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 (out_features, packed bytes per row), see kernels.packing
    codebook: torch.Tensor  # float16: (2**bits,) per layer, or (out, in // block_size, 2**bits) per block
    scales: torch.Tensor  # bfloat16 (out_features, in_features // block_size)
    offsets: torch.Tensor | None  # bfloat16 like scales, only for asymmetric integers
    shape: tuple[int, int]  # (out_features, in_features) of the original weight
    dtype: torch.dtype  # dtype of the original weight, restored by dequantize()
    bits: int
    block_size: int
    method: str  # one of METHODS

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        n, k = self.shape
        expected = {
            "codes": (self.codes.dtype == torch.uint8 and tuple(self.codes.shape) == (n, packed_row_bytes(k, self.bits))),
            "scales": tuple(self.scales.shape) == (n, k // self.block_size),
            "codebook": self.codebook.shape[-1] == 1 << self.bits
            and (self.codebook.ndim == 1 or tuple(self.codebook.shape[:2]) == (n, k // self.block_size)),
            "offsets": self.offsets is None or tuple(self.offsets.shape) == tuple(self.scales.shape),
            "method": self.method in METHODS,
        }
        bad = [name for name, ok in expected.items() if not ok]
        if bad or k % self.block_size:
            raise ValueError(f"inconsistent QuantizedWeight for shape {self.shape}: {', '.join(bad) or 'block size'}")

    @property
    def codebook_scope(self) -> str:
        return "layer" if self.codebook.ndim == 1 else "block"

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def storage_bits(self) -> int:
        """Every bit the format stores: packed codes (with row padding), scales, offsets, codebooks."""
        parts = [self.codes, self.codebook, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() * 8 for t in parts)

    @property
    def bits_per_weight(self) -> float:
        return self.storage_bits() / self.numel

    def dequantize(self) -> torch.Tensor:
        """The weight this format represents, in the original dtype."""
        w = dequantize_lut(self.codes, self.codebook, self.scales, self.offsets, self.bits, self.block_size, self.shape[1])
        return w.to(self.dtype)

    def to(self, device) -> "QuantizedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(
            move(self.codes), move(self.codebook), move(self.scales), move(self.offsets),
            self.shape, self.dtype, self.bits, self.block_size, self.method,
        )
