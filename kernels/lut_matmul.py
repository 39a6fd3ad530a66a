"""y = x @ dequant(W).T for weights stored as packed codes + codebook + block scales.

This module defines what the lookup-table matmul computes: the PyTorch
reference below. Every weight format of the toolkit (k-means with a codebook
per layer or per block, symmetric and asymmetric integers, 1-bit) reduces to

    W[n, k] = codebook[code[n, k]] * scale[n, k // B] (+ offset[n, k // B])

with ``codebook`` of shape (2**bits,) for one codebook per layer, or
(N, K // B, 2**bits) for one codebook per block.

The Triton kernel reads the packed codes directly (a row of codes is one
little-endian bit stream, see kernels.packing), looks each code up in the
codebook, applies the block scale and multiplies, accumulating in float32; the
16-bit weight matrix is never built in memory. Two paths, chosen by M (the
rows of x) and overridable with ``path=``:

* ``gemv`` (M <= 16, decode): the K dimension split across programs (split-K,
  :func:`split_count`) so a single row of x still fills the GPU; each tile is a
  multiply-and-reduce on CUDA cores or, from M = 3 on, a tensor-core product on 16
  padded rows, whichever the tuning finds faster. Partial sums are added in a fixed
  order (deterministic); with one split the kernel writes the result directly.
* ``gemm`` (prefill): dequantized tiles in x's dtype fed to ``tl.dot`` (tensor
  cores), float32 accumulation, the result (bias added, rounded to x's dtype)
  written by the kernel.

On a GPU the tile sizes, warps, stages and the way codes are read (``CODE_READS``:
each code from its byte; a contiguous load of the tile's bytes unpacked in registers;
for one row of x and one codebook per layer, a byte table of 256 x 8/bits levels, one
lookup per code byte, kept by QuantLinear) are autotuned per shape (M to its power
of two, N, K, bits, format) from ``SPLIT_K_CONFIGS`` / ``GEMM_CONFIGS`` at the first
call and cached on disk per GPU target (see kernels.triton_util); ``config=`` fixes
one. The weights are read in their on-disk layout (no repacking).

Dispatch: :func:`lut_matmul` runs CUDA tensors through Triton and CPU tensors through the C
kernel of kernels.lut_cpu (every format; the reference where no compiler builds it). QuantLinear
keeps the C kernel readied per layer, and for bfloat16 inputs to row-wise int8 weights runs
PyTorch's int8 kernel instead (kernels.int_cpu: measured faster, at the cost of a second copy of
the weight; docs/results/kernels.md). On the CPU the Triton code itself runs under
Triton's interpreter (``kernels.backends.triton_kernels("lut_matmul_triton",
interpret=True).lut_matmul_triton``): that is how the tests check it.
"""

from dataclasses import dataclass

import torch

from hilt.errors import HiltError
from hilt.kernels.packing import packed_row_bytes, unpack_codes


@dataclass(frozen=True, eq=False)  # eq: tensors have no single truth value
class PackedWeight:
    """The kernel's weight argument: packed codes, codebook, block scales (and offsets), as in the
    formula above. Checked when made, so one that exists is consistent: the kernel reads it
    unchecked. ``QuantizedWeight.packed`` (hilt.quant) gives a quantized weight's."""

    codes: torch.Tensor  # uint8 (N, packed_row_bytes(in_features, bits)), see kernels.packing
    codebook: torch.Tensor  # (2**bits,) per layer, or (N, n_blocks, 2**bits) per block
    scales: torch.Tensor  # (N, n_blocks)
    offsets: torch.Tensor | None  # like scales, or None
    bits: int
    block_size: int
    in_features: int

    def __post_init__(self):
        if not 1 <= self.bits <= 8:
            raise HiltError(f"bits must be between 1 and 8, got {self.bits}")
        if self.in_features < 1:
            raise HiltError(f"in_features must be at least 1, got {self.in_features}")
        if self.block_size < 1 or self.in_features % self.block_size:
            raise HiltError(f"in_features {self.in_features} is not a multiple of block size {self.block_size}")
        n, row_bytes, blocks = self.out_features, packed_row_bytes(self.in_features, self.bits), self.n_blocks
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (n, row_bytes):
            raise HiltError(f"codes must be uint8 ({n}, {row_bytes}), got {self.codes.dtype} "
                            f"{tuple(self.codes.shape)}")
        if tuple(self.scales.shape) != (n, blocks):
            raise HiltError(f"scales have shape {tuple(self.scales.shape)}, expected {(n, blocks)}")
        if self.codebook.shape[-1] != 1 << self.bits:
            raise HiltError(f"codebook has {self.codebook.shape[-1]} levels, {self.bits} bits need {1 << self.bits}")
        if self.per_block_codebook and tuple(self.codebook.shape) != (n, blocks, 1 << self.bits):
            raise HiltError(f"codebook has shape {tuple(self.codebook.shape)}, expected {(1 << self.bits,)} or "
                            f"{(n, blocks, 1 << self.bits)}")
        if self.offsets is not None and self.offsets.shape != self.scales.shape:
            raise HiltError(f"offsets have shape {tuple(self.offsets.shape)}, expected {tuple(self.scales.shape)}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def n_blocks(self) -> int:
        return self.in_features // self.block_size

    @property
    def per_block_codebook(self) -> bool:
        return self.codebook.ndim > 1

    def rows(self, start: int, stop: int) -> "PackedWeight":
        """Output rows [start, stop) (views)."""
        band = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return PackedWeight(band(self.codes), band(self.codebook) if self.per_block_codebook else self.codebook,
                            band(self.scales), band(self.offsets), self.bits, self.block_size, self.in_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (offsets only when there are some)."""
        parts = {"codes": self.codes, "codebook": self.codebook, "scales": self.scales, "offsets": self.offsets}
        return {k: v for k, v in parts.items() if v is not None}

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor: what one pass over the weight reads."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def dequantize_lut(w: PackedWeight) -> torch.Tensor:
    """Reference dequantization to float32 of shape (N, in_features)."""
    n_rows, n_blocks = w.out_features, w.n_blocks
    idx = unpack_codes(w.codes, w.bits, w.in_features)
    book = w.codebook.float()
    if book.ndim == 1:  # one codebook per layer: every block's own, as a view
        book = book.expand(n_rows, n_blocks, -1)
    # gather: a third of the time of book[idx] on the CPU
    values = torch.gather(book, 2, idx.view(n_rows, n_blocks, w.block_size))
    deq = values * w.scales.float().unsqueeze(-1)
    if w.offsets is not None:
        deq = deq + w.offsets.float().unsqueeze(-1)
    return deq.view(n_rows, w.in_features)


def check_input(x: torch.Tensor, w: PackedWeight) -> None:
    if x.shape[-1] != w.in_features:
        raise HiltError(f"input has {x.shape[-1]} features, the weight expects {w.in_features}")


def lut_matmul_reference(x, w: PackedWeight, bias=None):
    """The definition: dequantize to float32, matmul in float32, cast back to x's dtype."""
    check_input(x, w)
    y = x.float() @ dequantize_lut(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# Rounding unit of x's dtype. float32 as float16: tensor cores take it as TF32 (10-bit mantissa).
_ROUNDING = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-10}


def error_ratio(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, w_abs: torch.Tensor) -> float:
    """Largest |y - ref| over the error the kernel may make: output rounding plus, on tensor cores and
    on the CPU kernel's bfloat16 path, weights rounded to x's dtype (a relative 2^-8 for bfloat16, half
    its eps), ``eps * (|x| @ |W|.T + |ref|) + 1e-6`` (``w_abs``: |W|, ``ref``:
    :func:`lut_matmul_reference` in float64). At most 1 for a correct kernel; inf when y has a NaN
    or infinity."""
    if not torch.isfinite(y).all():
        return float("inf")
    magnitude = x.double().abs().reshape(-1, x.shape[-1]) @ w_abs.double().T
    bound = _ROUNDING[x.dtype] * (magnitude.reshape(ref.shape) + ref.abs()) + 1e-6
    return float(((y.double() - ref) / bound).abs().max()) if ref.numel() else 0.0


def choose_path(m: int) -> str:
    """The kernel path for M rows of input: split-K GEMV for decode, tensor-core GEMM beyond."""
    return "gemv" if m <= 16 else "gemm"


def byte_table(codebook: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 (256, 8 // bits): row b holds the levels of the codes packed in byte b, lowest
    bits first (the packing order). What the one-row path of the kernel looks codes up in; built
    once per layer by QuantLinear."""
    if bits not in (1, 2, 4) or codebook.ndim != 1:
        raise HiltError(f"a byte table needs 1, 2 or 4 bits and one codebook per layer, got {bits} bits and "
                        f"codebook shape {tuple(codebook.shape)}")
    per_byte = 8 // bits
    byte = torch.arange(256, device=codebook.device)
    shift = torch.arange(per_byte, device=codebook.device) * bits
    return codebook.float()[(byte[:, None] >> shift[None, :]) & ((1 << bits) - 1)].contiguous()


def uses_byte_table(w: PackedWeight) -> bool:
    """Whether the one-row path reads codes through a byte table for this format: 1, 2 or 4
    bits, one codebook, blocks of 8-64 (a power of two, so whole blocks tile BLOCK_K)."""
    return w.bits in (1, 2, 4) and not w.per_block_codebook and w.block_size in (8, 16, 32, 64)


_warned_no_compiler = False


def lut_matmul(x, w: PackedWeight, bias=None, path=None, table=None):
    """Public entry: CUDA tensors -> Triton kernel (``path`` overrides the choice; ``table``: the
    codebook's :func:`byte_table` if the caller keeps one). CPU tensors -> the C kernel
    (kernels.lut_cpu) for every format; a caller that runs the same weight again and again keeps
    ``lut_cpu.prepare(w)`` instead (QuantLinear does). Where no C compiler builds the kernel, the
    reference, with one warning per process."""
    global _warned_no_compiler
    if x.is_cuda:
        from hilt.kernels.backends import triton_kernels

        return triton_kernels("lut_matmul_triton").lut_matmul_triton(x, w, bias, path, table=table)
    from hilt.kernels.lut_cpu import lut_matmul_cpu

    y = lut_matmul_cpu(x, w, bias)
    if y is not None:
        return y
    if not _warned_no_compiler:
        import warnings

        _warned_no_compiler = True
        warnings.warn("hilt: no C compiler built the CPU lookup-table kernel (set CC, or install cc); "
                      "quantized layers run the slow PyTorch reference", RuntimeWarning, stacklevel=2)
    return lut_matmul_reference(x, w, bias)
