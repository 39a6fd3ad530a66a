"""The quantization formats, one entry each, so that a method is described in one place.

Every format stores codes on blocks of ``block_size`` along the input dimension with one bf16 scale
per block (docs/references.md §1):

    W[n, k] = levels[code[n, k]] * scale[n, k // block_size] (+ offset[n, k // block_size])

An entry says what differs between methods: the levels (a fixed grid, or fitted to the weights by
k-means), how a block's scale (and offset) is chosen, the bit widths it accepts, and which GGUF block
types hold it exactly. The quantizer, the checkpoint writer and loader, QAT, error compensation, the
exports and the CLI's choices read these attributes instead of testing the method's name, so a new
method is one more entry here. The names are what checkpoints store: they never change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from hilt.errors import HiltError

MIN_BITS, MAX_BITS = 1, 8  # what the packed codes hold (kernels.packing)
STORED_BITS = 16  # a scale, an offset and a codebook level are each stored in 16 bits (bf16 / fp16)


@dataclass(frozen=True)
class Format:
    name: str
    levels_are: str  # in words, for messages: "a learned codebook"
    scale_rule: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]
    grid: Callable[[int], torch.Tensor] | None = None  # the fixed levels at a bit width; None: fitted by k-means
    offsets: bool = False  # a per-block offset is stored beside the scale
    min_bits: int = MIN_BITS
    max_bits: int = MAX_BITS
    below_min: str | None = None  # the format that stands in at fewer bits than min_bits
    gguf: Mapping[int, str] = field(default_factory=dict)  # bits -> the GGUF block type holding it exactly

    @property
    def fitted(self) -> bool:
        """The levels are fitted to each tensor (so importance weights, given codebooks and per-block
        codebooks apply) rather than fixed by the bit width."""
        return self.grid is None

    @property
    def fixed_bits(self) -> int | None:
        """The one bit width the format has, or None when it takes several."""
        return self.min_bits if self.min_bits == self.max_bits else None

    def levels(self, bits: int) -> torch.Tensor | None:
        """The 2**bits levels of a fixed grid, float64 ascending; None for a fitted codebook."""
        return None if self.grid is None else self.grid(bits)

    def block_scales(self, blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scales, offsets or None) in float32 of ``blocks`` (n, blocks, block_size), float32."""
        return self.scale_rule(blocks, bits)

    def validate(self, bits: int, codebook: str = "layer") -> None:
        """Refuse, naming the argument (the same names as the command's flags), a bit width or codebook scope this
        format cannot have."""
        if self.fixed_bits is not None and bits != self.fixed_bits:
            raise HiltError(f"method {self.name} is {self.fixed_bits} bit, got bits {bits}")
        if bits < self.min_bits:
            instead = f"; use method {self.below_min} for {bits} bit" if self.below_min else ""
            raise HiltError(f"method {self.name} needs at least {self.min_bits} bits{instead}")
        if bits > self.max_bits:
            raise HiltError(f"method {self.name} takes at most {self.max_bits} bits, got bits {bits}")
        if codebook == "block" and not self.fitted:
            raise HiltError(f"codebook 'block' applies to method {fitted_methods()} only")

    def overhead_bits(self, blocks: int, bits: int, codebook: str = "layer") -> int:
        """Bits stored beside the codes of a tensor of ``blocks`` blocks: scales, offsets, codebook(s)."""
        per_block = STORED_BITS * (2 if self.offsets else 1)
        books = blocks if codebook == "block" else 1
        return blocks * per_block + books * STORED_BITS * (1 << bits)


def _absmax_above_2_bits(blocks, bits):
    # absmax would flush most values to zero at 1-2 bits, where absmean keeps them apart
    return (blocks.abs().mean(-1) if bits <= 2 else blocks.abs().amax(-1)), None


def _absmean(blocks, bits):
    return blocks.abs().mean(-1), None


def _absmax_step(blocks, bits):
    return blocks.abs().amax(-1) / ((1 << (bits - 1)) - 1), None


def _min_max_step(blocks, bits):
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    return (hi - lo) / ((1 << bits) - 1), lo


def _symmetric_grid(bits):
    half = 1 << (bits - 1)
    return torch.arange(-half, half, dtype=torch.float64)


def _unsigned_grid(bits):
    return torch.arange(1 << bits, dtype=torch.float64)


def _sign_grid(bits):
    return torch.tensor([-1.0, 1.0], dtype=torch.float64)


FORMATS: dict[str, Format] = {f.name: f for f in (
    # 2**bits centroids over the block-normalised weights, one codebook per layer (published) or per
    # block; bits=1 is the published 1-bit format
    Format("kmeans", "a learned codebook", _absmax_above_2_bits),
    # the published baseline: levels -2**(b-1) .. 2**(b-1)-1 times absmax / (2**(b-1) - 1); at 1 bit
    # the grid {-1, 0} would waste a level, so binary stands in
    Format("int", "a symmetric integer grid", _absmax_step, grid=_symmetric_grid, min_bits=2, below_min="binary",
           gguf={4: "Q4_0", 8: "Q8_0"}),
    # levels 0 .. 2**b-1 times (max - min) / (2**b - 1), plus the block minimum as offset
    Format("int-asym", "an integer grid with a block offset", _min_max_step, grid=_unsigned_grid, offsets=True,
           gguf={4: "Q4_1"}),
    # sign x absmean, the 1-bit baseline
    Format("binary", "a sign codebook", _absmean, grid=_sign_grid, min_bits=1, max_bits=1),
)}
METHODS = tuple(FORMATS)


def get_format(method: str) -> Format:
    """The entry of ``method``; an unknown name is refused with the list of known ones."""
    try:
        return FORMATS[method]
    except (KeyError, TypeError):
        raise HiltError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}") from None


def fitted_methods() -> str:
    """The methods whose codebook is fitted, for messages: "kmeans"."""
    return " or ".join(f.name for f in FORMATS.values() if f.fitted)


def method_for_bits(method: str, bits: int) -> str:
    """The method that quantizes ``bits`` for ``method``: its stand-in below its fewest bits
    (symmetric int at 1 bit is binary), else itself."""
    fmt = get_format(method)
    return fmt.below_min if fmt.below_min and bits < fmt.min_bits else method
