"""The one in-memory type for every quantized weight format.

The same object is written to disk (quant.checkpoint), run by QuantLinear,
taken by the kernels (as ``.packed``) and lowered by the ONNX export. k-means with 2 levels is
the 1-bit format; integer formats are uniform codebooks; asymmetric integers
add a per-block offset.

    W[n, k] = codebook[code[n, k]] * scales[n, k // block_size] (+ offsets[n, k // block_size])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hilt.errors import HiltError
from hilt.kernels.lut_matmul import PackedWeight, dequantize_lut
from hilt.kernels.packing import packed_row_bytes
from hilt.quant.formats import METHODS, get_format  # noqa: F401  (METHODS: the names, as before)


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
    method: str  # a name of hilt.quant.formats.FORMATS

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        get_format(self.method)  # an unknown method is refused here
        rows = self.packed.out_features  # making the PackedWeight checks the parts against in_features
        if rows != self.shape[0]:
            raise HiltError(f"codes have {rows} rows, the weight's shape is {self.shape}")

    @classmethod
    def empty(cls, shape: tuple[int, int], method: str, bits: int, block_size: int, codebook: str = "layer",
              dtype: torch.dtype = torch.float32, device=None) -> "QuantizedWeight":
        """Parts of the right shapes and dtypes, values unset: what a loader fills in place."""
        n, k = shape
        if block_size < 1 or k % block_size:
            raise HiltError(f"in_features {k} is not a multiple of block size {block_size}")
        blocks, levels = k // block_size, 1 << bits
        book_shape = (levels,) if codebook == "layer" else (n, blocks, levels)
        return cls(
            torch.empty(n, packed_row_bytes(k, bits), dtype=torch.uint8, device=device),
            torch.empty(book_shape, dtype=torch.float16, device=device),
            torch.empty(n, blocks, dtype=torch.bfloat16, device=device),
            torch.empty(n, blocks, dtype=torch.bfloat16, device=device) if get_format(method).offsets else None,
            shape, dtype, bits, block_size, method,
        )

    @property
    def packed(self) -> PackedWeight:
        """The kernel's argument (kernels.lut_matmul)."""
        return PackedWeight(self.codes, self.codebook, self.scales, self.offsets, self.bits, self.block_size,
                            self.shape[1])

    @property
    def codebook_scope(self) -> str:
        return "layer" if self.codebook.ndim == 1 else "block"

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def storage_bits(self) -> int:
        """Every bit the format stores: packed codes (with row padding), scales, offsets, codebooks."""
        return self.packed.nbytes * 8

    @property
    def bits_per_weight(self) -> float:
        return self.storage_bits() / self.numel

    def dequantize(self) -> torch.Tensor:
        """The weight this format represents, in the original dtype."""
        return dequantize_lut(self.packed).to(self.dtype)

    def to(self, device) -> "QuantizedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(
            move(self.codes), move(self.codebook), move(self.scales), move(self.offsets),
            self.shape, self.dtype, self.bits, self.block_size, self.method,
        )
