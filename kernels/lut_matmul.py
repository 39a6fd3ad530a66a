"""y = x @ dequant(W).T for weights stored as packed codes + codebook + block scales.

This module defines what the lookup-table matmul computes: the PyTorch
reference below. Every weight format of the toolkit (k-means with a codebook
per layer or per block, symmetric and asymmetric integers, 1-bit) reduces to

    W[n, k] = codebook[code[n, k]] * scale[n, k // B] (+ offset[n, k // B])

with ``codebook`` of shape (2**bits,) for one codebook per layer, or
(N, K // B, 2**bits) for one codebook per block.

Dispatch: :func:`lut_matmul` is the one public entry. The Triton GEMV/GEMM
kernels for CUDA tensors arrive with the kernels issue; until then every
device runs the reference, which is exact.
"""

import torch

from kernels.errors import HiltError
from kernels.packing import unpack_codes


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
    if book.ndim == 1:
        values = book[idx]
    else:  # one codebook per block: gather each block's own levels
        idx = idx.view(n_rows, n_blocks, block_size)
        values = torch.gather(book, 2, idx)
    w = values.view(n_rows, n_blocks, block_size) * scales.float().unsqueeze(-1)
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


def lut_matmul(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias=None):
    """Public entry: dispatches on device (see module docstring)."""
    return lut_matmul_reference(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias)
