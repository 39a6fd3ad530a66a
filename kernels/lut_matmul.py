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

Dispatch: :func:`lut_matmul` runs CUDA tensors through Triton and CPU tensors
through the reference. On the CPU the Triton code itself runs under
``TRITON_INTERPRET=1`` (set before importing kernels.lut_matmul_triton, whose
:func:`lut_matmul_triton` runs it): that is how
the tests check it.
"""

import torch

from hilt.errors import HiltError
from hilt.kernels.packing import packed_row_bytes, unpack_codes


def dequantize_lut(
    codes: torch.Tensor,
    codebook: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    block_size: int,
    in_features: int,
) -> torch.Tensor:
    """Reference dequantization to float32 of shape (N, in_features)."""
    n_rows = codes.shape[0]
    if in_features % block_size:
        raise HiltError(f"in_features {in_features} is not a multiple of block size {block_size}")
    n_blocks = in_features // block_size
    if tuple(scales.shape) != (n_rows, n_blocks):
        raise HiltError(f"scales have shape {tuple(scales.shape)}, expected {(n_rows, n_blocks)}")
    idx = unpack_codes(codes, bits, in_features)
    book = codebook.float()
    if book.ndim == 1:  # one codebook per layer: every block's own, as a view
        book = book.expand(n_rows, n_blocks, -1)
    # gather: a third of the time of book[idx] on the CPU
    values = torch.gather(book, 2, idx.view(n_rows, n_blocks, block_size))
    w = values * scales.float().unsqueeze(-1)
    if offsets is not None:
        w = w + offsets.float().unsqueeze(-1)
    return w.view(n_rows, in_features)


def lut_matmul_reference(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias=None):
    """The definition: dequantize to float32, matmul in float32, cast back to x's dtype."""
    if x.shape[-1] != in_features:
        raise HiltError(f"input has {x.shape[-1]} features, the weight expects {in_features}")
    w = dequantize_lut(codes, codebook, scales, offsets, bits, block_size, in_features)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


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


def uses_byte_table(codebook: torch.Tensor, bits: int, block_size: int) -> bool:
    """Whether the one-row path reads codes through a byte table for this format: 1, 2 or 4
    bits, one codebook, blocks of 8-64 (a power of two, so whole blocks tile BLOCK_K)."""
    return bits in (1, 2, 4) and codebook.ndim == 1 and block_size in (8, 16, 32, 64)


def check_args(x, codes, codebook, scales, offsets, bits, block_size, in_features):
    if not 1 <= bits <= 8:
        raise HiltError(f"bits must be between 1 and 8, got {bits}")
    if x.shape[-1] != in_features:
        raise HiltError(f"input has {x.shape[-1]} features, the weight expects {in_features}")
    if block_size < 1 or in_features % block_size:
        raise HiltError(f"in_features {in_features} is not a multiple of block size {block_size}")
    n = codes.shape[0]
    if codes.dtype != torch.uint8 or codes.shape[1] != packed_row_bytes(in_features, bits):
        raise HiltError(f"codes must be uint8 ({n}, {packed_row_bytes(in_features, bits)}), got "
                        f"{codes.dtype} {tuple(codes.shape)}")
    if tuple(scales.shape) != (n, in_features // block_size):
        raise HiltError(f"scales have shape {tuple(scales.shape)}, expected {(n, in_features // block_size)}")
    if codebook.shape[-1] != 1 << bits:
        raise HiltError(f"codebook has {codebook.shape[-1]} levels, {bits} bits need {1 << bits}")
    if offsets is not None and offsets.shape != scales.shape:
        raise HiltError(f"offsets have shape {tuple(offsets.shape)}, expected {tuple(scales.shape)}")


def lut_matmul(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias=None, path=None,
               table=None):
    """Public entry: CUDA tensors -> Triton kernel (``path`` overrides the choice; ``table``: the
    codebook's :func:`byte_table` if the caller keeps one), CPU -> reference."""
    if x.is_cuda:
        from hilt.kernels.lut_matmul_triton import lut_matmul_triton

        return lut_matmul_triton(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias, path,
                                 table=table)
    check_args(x, codes, codebook, scales, offsets, bits, block_size, in_features)
    return lut_matmul_reference(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias)

