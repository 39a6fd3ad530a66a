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

* ``gemv`` (M <= 16, decode): a multiply-and-reduce on CUDA cores, with the
  K dimension split across programs (split-K) so a single row of x still fills
  the GPU; partial sums are added in a fixed order (deterministic).
* ``gemm`` (prefill): dequantized tiles in x's dtype fed to ``tl.dot`` (tensor
  cores), float32 accumulation.

Dispatch: :func:`lut_matmul` runs CUDA tensors through Triton and CPU tensors
through the reference. On the CPU the Triton code itself runs under
``TRITON_INTERPRET=1`` (call :func:`lut_matmul_triton` directly): that is how
the tests check it.
"""

import os

import torch
import triton
import triton.language as tl

from kernels.errors import HiltError
from kernels.packing import packed_row_bytes, unpack_codes


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


def choose_path(m: int) -> str:
    """The kernel path for M rows of input: split-K GEMV for decode, tensor-core GEMM beyond."""
    return "gemv" if m <= 16 else "gemm"


@triton.jit
def _lut_matmul_kernel(
    x_ptr, codes_ptr, book_ptr, scales_ptr, offsets_ptr, out_ptr,
    M, N, K, row_bytes, n_blocks, k_per_split,
    stride_xm, stride_om, stride_os,
    BITS: tl.constexpr, BLOCK: tl.constexpr, PER_BLOCK_BOOK: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_s * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_begin + k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_n[:, None] & mask_k[None, :]
        # code k of a row sits at bits [k*BITS, (k+1)*BITS) of the row's little-endian bit stream
        bit = offs_k * BITS
        byte = bit // 8
        row = codes_ptr + offs_n[:, None] * row_bytes + byte[None, :]
        word = tl.load(row, mask=mask_w, other=0).to(tl.int32)
        if (8 % BITS) != 0:  # 3, 5, 6, 7 bits: a code may straddle two bytes
            nxt = tl.load(row + 1, mask=mask_w & (byte[None, :] + 1 < row_bytes), other=0).to(tl.int32)
            word = word | (nxt << 8)
        code = (word >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
        block_idx = offs_n[:, None] * n_blocks + (offs_k // BLOCK)[None, :]
        scale = tl.load(scales_ptr + block_idx, mask=mask_w, other=0.0).to(tl.float32)
        if PER_BLOCK_BOOK:
            level = tl.load(book_ptr + block_idx * (1 << BITS) + code, mask=mask_w, other=0.0)
        else:
            level = tl.load(book_ptr + code)  # a code is always a valid index
        w = level.to(tl.float32) * scale
        if HAS_OFFSETS:
            w += tl.load(offsets_ptr + block_idx, mask=mask_w, other=0.0).to(tl.float32)
        if USE_DOT:
            if DOT_FP32:  # float32 inputs keep full precision (no TF32)
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


def _check(x, codes, codebook, scales, offsets, bits, block_size, in_features):
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


def lut_matmul_triton(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias=None,
                      path=None, split_k=None, partial=None):
    """The Triton kernel (any device Triton runs on, including the CPU interpreter).

    ``path``: "gemv" or "gemm" (default: :func:`choose_path`). ``split_k``:
    programs along K for the GEMV path (default: enough to fill the GPU).
    ``partial``: optional float32 (split_k, M, N) buffer for the per-split sums
    (tests pass one filled with NaN to catch unwritten elements).
    """
    _check(x, codes, codebook, scales, offsets, bits, block_size, in_features)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise HiltError(f"input dtype {x.dtype} is not supported (float16, bfloat16, float32)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    m, n, k = x2.shape[0], codes.shape[0], in_features
    path = path or choose_path(m)
    if path not in ("gemv", "gemm"):
        raise HiltError(f"unknown kernel path {path!r}; choose gemv or gemm")
    if path == "gemv":
        block_m, block_n, block_k = max(1, triton.next_power_of_2(min(m, 16))), 32, 128
        if split_k is None:  # aim for a few hundred programs: one row of x must still fill the GPU
            split_k = max(1, min(triton.cdiv(k, block_k), 256 // max(1, triton.cdiv(n, block_n))))
        use_dot = False
    else:
        block_m, block_n, block_k = 64, 64, 64
        split_k, use_dot = split_k or 1, True
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if partial is None:
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    elif tuple(partial.shape) != (split_k, m, n):
        raise HiltError(f"partial buffer must be {(split_k, m, n)}, got {tuple(partial.shape)}")
    book = codebook.contiguous()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    if m and n:
        _lut_matmul_kernel[grid](
            x2, codes.contiguous(), book, scales.contiguous(),
            scales if offsets is None else offsets.contiguous(), partial,
            m, n, k, codes.shape[1], k // block_size, k_per_split,
            x2.stride(0), partial.stride(1), partial.stride(0),
            BITS=bits, BLOCK=block_size, PER_BLOCK_BOOK=book.ndim > 1, HAS_OFFSETS=offsets is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
            # Triton's interpreter computes tl.dot on bfloat16 wrongly (checked: values of 1e10
            # for unit inputs), so there the dot runs in float32; GPUs use bf16 tensor cores.
            DOT_FP32=x.dtype == torch.float32
            or (x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"),
        )
    y = partial.sum(0) if split_k > 1 else partial[0]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, n)


def lut_matmul(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias=None, path=None):
    """Public entry: CUDA tensors -> Triton kernel (``path`` overrides the choice), CPU -> reference."""
    if x.is_cuda:
        return lut_matmul_triton(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias, path)
    _check(x, codes, codebook, scales, offsets, bits, block_size, in_features)
    return lut_matmul_reference(x, codes, codebook, scales, offsets, bits, block_size, in_features, bias)
