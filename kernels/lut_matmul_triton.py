"""The Triton kernel of kernels.lut_matmul (see that module for what it computes and how the
paths and tuning work). Imported only when a kernel runs: on CUDA tensors, or under Triton's
CPU interpreter when asked for (kernels.backends.triton_kernels)."""

import torch
import triton
import triton.language as tl

from hilt.errors import HiltError
from hilt.kernels.lut_matmul import PackedWeight, byte_table, check_input, choose_path, uses_byte_table
from hilt.kernels.triton_util import autotune, interpreting, to_dtype


@triton.jit
def _codes_tile(codes_ptr, offs_n, mask_n, offs_k, mask_k, k_start, row_bytes,
                BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNPACK: tl.constexpr):
    """(BLOCK_N, BLOCK_K) int32 codes of columns offs_k (= k_start + arange). Code k of a row sits
    at bits [k*BITS, (k+1)*BITS) of the row's little-endian bit stream."""
    if UNPACK and (8 % BITS == 0):
        # 1, 2, 4, 8 bits: one contiguous (vectorisable) load of the tile's bytes, codes split off in
        # registers (the reshape may cost a trip through shared memory: tuning decides)
        offs_b = k_start // (8 // BITS) + tl.arange(0, BLOCK_K // (8 // BITS))
        packed = tl.load(codes_ptr + offs_n[:, None] * row_bytes + offs_b[None, :],
                         mask=mask_n[:, None] & (offs_b < row_bytes)[None, :], other=0).to(tl.int32)
        shifts = tl.arange(0, 8 // BITS) * BITS
        code = tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (BLOCK_N, BLOCK_K))
    else:  # per code, from its byte and, for 3, 5, 6, 7 bits, the next when it straddles
        bit = offs_k * BITS
        byte = bit // 8
        row = codes_ptr + offs_n[:, None] * row_bytes + byte[None, :]
        mask_w = mask_n[:, None] & mask_k[None, :]
        word = tl.load(row, mask=mask_w, other=0).to(tl.int32)
        if (8 % BITS) != 0:
            nxt = tl.load(row + 1, mask=mask_w & (byte[None, :] + 1 < row_bytes), other=0).to(tl.int32)
            word = word | (nxt << 8)
        code = (word >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
    return code


@triton.jit
def _weights_tile(code, book_ptr, scales_ptr, offsets_ptr, offs_n, mask_n, offs_k, mask_k, k_start, n_blocks,
                  BITS: tl.constexpr, BLOCK: tl.constexpr, PER_BLOCK_BOOK: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 (BLOCK_N, BLOCK_K) weights: codebook level times block scale (plus offset); zero past K."""
    mask_w = mask_n[:, None] & mask_k[None, :]
    if PER_BLOCK_BOOK:
        block_idx = offs_n[:, None] * n_blocks + (offs_k // BLOCK)[None, :]
        level = tl.load(book_ptr + block_idx * (1 << BITS) + code, mask=mask_w, other=0.0).to(tl.float32)
    elif BITS == 1:  # two levels: arithmetic, no lookup
        low = tl.load(book_ptr).to(tl.float32)
        level = low + code.to(tl.float32) * (tl.load(book_ptr + 1).to(tl.float32) - low)
    else:
        level = tl.load(book_ptr + code).to(tl.float32)  # a code is always a valid index: L1-resident table
    if ((BLOCK & (BLOCK - 1)) == 0) and (BLOCK_K % BLOCK == 0):
        # whole blocks in the tile: one scale per (row, block), applied to the block's columns
        offs_blk = k_start // BLOCK + tl.arange(0, BLOCK_K // BLOCK)
        idx = offs_n[:, None] * n_blocks + offs_blk[None, :]
        mask_s = mask_n[:, None] & (offs_blk < n_blocks)[None, :]
        scale = tl.load(scales_ptr + idx, mask=mask_s, other=0.0).to(tl.float32)
        w = tl.reshape(level, (BLOCK_N, BLOCK_K // BLOCK, BLOCK)) * scale[:, :, None]
        if HAS_OFFSETS:
            w += tl.load(offsets_ptr + idx, mask=mask_s, other=0.0).to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    else:  # blocks that do not tile BLOCK_K: a scale per element
        block_idx = offs_n[:, None] * n_blocks + (offs_k // BLOCK)[None, :]
        w = level * tl.load(scales_ptr + block_idx, mask=mask_w, other=0.0).to(tl.float32)
        if HAS_OFFSETS:
            w += tl.load(offsets_ptr + block_idx, mask=mask_w, other=0.0).to(tl.float32)
    return w


@triton.jit
def _tile_by_codes(x_ptr, codes_ptr, book_ptr, scales_ptr, offsets_ptr, offs_m, mask_m, offs_n, mask_n,
                   k_begin, k_per_split, K, row_bytes, n_blocks, stride_xm,
                   BITS: tl.constexpr, BLOCK: tl.constexpr, PER_BLOCK_BOOK: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                   DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_DOT: tl.constexpr, UNPACK: tl.constexpr):
    """float32 (BLOCK_M, BLOCK_N) sums over this split's K range, any format: (BLOCK_N, BLOCK_K)
    weight tiles from the codes, then tensor cores or a multiply-and-add on CUDA cores."""
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # products summed per column position; across K once, after the loop (no shuffles per tile)
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_begin + k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        code = _codes_tile(codes_ptr, offs_n, mask_n, offs_k, mask_k, k_begin + k0, row_bytes,
                           BITS, BLOCK_N, BLOCK_K, UNPACK)
        w = _weights_tile(code, book_ptr, scales_ptr, offsets_ptr, offs_n, mask_n, offs_k, mask_k, k_begin + k0,
                          n_blocks, BITS, BLOCK, PER_BLOCK_BOOK, HAS_OFFSETS, BLOCK_N, BLOCK_K)
        if USE_DOT:
            if DOT_FP32:  # float32 inputs keep full precision (no TF32)
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
    return acc


@triton.jit
def _row_by_bytes(x_row, codes_ptr, table_ptr, scales_ptr, offsets_ptr, offs_n, mask_n,
                  k_begin, k_per_split, row_bytes, n_blocks,
                  BITS: tl.constexpr, BLOCK: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 (1, BLOCK_N) sums for one row of x, 1/2/4-bit codes with one codebook: each code
    byte indexes the byte table (:func:`byte_table`), which holds the levels of all its codes, so
    one lookup yields 8 // BITS weights and no code is shifted out. Tiles are (BLOCK_N, blocks,
    bytes per block, codes per byte): the block scale applies along the second axis."""
    blocks = tl.arange(0, BLOCK_K // BLOCK)
    in_block = tl.arange(0, BLOCK // (8 // BITS))
    per_byte = tl.arange(0, 8 // BITS)
    acc = tl.zeros((BLOCK_N, BLOCK_K // BLOCK, BLOCK // (8 // BITS), 8 // BITS), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        blk = (k_begin + k0) // BLOCK + blocks
        mask_blk = blk < n_blocks  # K is whole blocks
        byte = (blk * (BLOCK // (8 // BITS)))[:, None] + in_block[None, :]
        mask_nb = mask_n[:, None] & mask_blk[None, :]
        packed = tl.load(codes_ptr + offs_n[:, None, None] * row_bytes + byte[None, :, :],
                         mask=mask_nb[:, :, None], other=0).to(tl.int32)
        level = tl.load(table_ptr + packed[:, :, :, None] * (8 // BITS) + per_byte[None, None, None, :])
        col = (blk * BLOCK)[:, None, None] + (in_block * (8 // BITS))[None, :, None] + per_byte[None, None, :]
        x = tl.load(x_row + col, mask=mask_blk[:, None, None], other=0.0).to(tl.float32)
        idx = offs_n[:, None] * n_blocks + blk[None, :]
        scale = tl.load(scales_ptr + idx, mask=mask_nb, other=0.0).to(tl.float32)
        w = level * scale[:, :, None, None]
        if HAS_OFFSETS:
            w += tl.load(offsets_ptr + idx, mask=mask_nb, other=0.0).to(tl.float32)[:, :, None, None]
        acc += w * x[None, :, :, :]
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)[None, :]


# n_blocks is not specialised: its divisibility by 16 varies between real layers (9, 24, 172
# blocks of 64 in SmolLM2 and Llama-7B) and would compile a kernel variant for each; m_bucket
# only keys the tuning.
@triton.jit(do_not_specialize=["n_blocks", "m_bucket"])
def lut_matmul_kernel(
    x_ptr, codes_ptr, book_ptr, table_ptr, scales_ptr, offsets_ptr, bias_ptr, out_ptr,
    M, N, K, row_bytes, n_blocks, SPLIT, m_bucket,
    stride_xm, stride_om, stride_os,
    BITS: tl.constexpr, BLOCK: tl.constexpr, PER_BLOCK_BOOK: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, EMULATE: tl.constexpr, BYTE_TABLE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, CODES: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of out over the K range of split ``pid_s``. With SPLIT == 1,
    out is the result in its own dtype (bias added, rounded here); otherwise out is the float32
    (SPLIT, M, N) buffer of partial sums, the bias in split 0's. ``m_bucket`` only keys tuning."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K  # a split past K adds nothing
    k_begin = pid_s * k_per_split
    if BYTE_TABLE and (CODES == "table"):  # BYTE_TABLE: one row of x, a format the table serves
        acc = _row_by_bytes(x_ptr + pid_m * stride_xm, codes_ptr, table_ptr, scales_ptr, offsets_ptr, offs_n, mask_n,
                            k_begin, k_per_split, row_bytes, n_blocks, BITS, BLOCK, HAS_OFFSETS, BLOCK_N, BLOCK_K)
    else:
        acc = _tile_by_codes(x_ptr, codes_ptr, book_ptr, scales_ptr, offsets_ptr, offs_m, mask_m, offs_n, mask_n,
                             k_begin, k_per_split, K, row_bytes, n_blocks, stride_xm, BITS, BLOCK, PER_BLOCK_BOOK,
                             HAS_OFFSETS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, CODES != "code")
    if HAS_BIAS:  # once: in split 0's sum
        b = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += tl.where(pid_s == 0, b, 0.0)[None, :]
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, to_dtype(acc, out_ptr.dtype.element_ty, EMULATE), mask=mask_m[:, None] & mask_n[None, :])


# How a tile reads its codes, tuned like the tile sizes (which wins depends on the GPU):
#   "code":   each code from its own byte (1-byte loads; no data movement between threads)
#   "unpack": the tile's bytes in one contiguous load, codes split off in registers (1, 2, 4, 8 bits)
#   "table":  one row of x only: each byte looks up all its codes' levels in :func:`byte_table`
CODE_READS = ("code", "unpack", "table")


def _split_k_configs():
    """Tiles the split-K path may take: a multiply-and-add on CUDA cores with BLOCK_M the power
    of two >= M (its accumulator lives in registers), or tensor cores on 16 padded rows; each
    with every way to read the codes that applies."""
    configs = []
    for bm in (1, 2, 4, 8, 16):
        for bn, bk, warps in ((16, 64, 4), (16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4),
                              (64, 256, 8), (128, 128, 8)):
            for codes in CODE_READS if bm == 1 else CODE_READS[:2]:
                # products per thread: reading codes one by one spills registers on sm_90 beyond 32
                # (hilt bench kernels --sass), the other reads beyond 128
                fits = bm * bn * bk <= (32 if codes == "code" else 128) * 32 * warps
                if fits and (bm > 1 or bn * bk >= 4096):
                    configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "USE_DOT": False,
                                                  "CODES": codes}, num_warps=warps, num_stages=3))
    for bn, bk, warps in ((32, 128, 4), (64, 64, 4), (64, 128, 4), (128, 64, 8)):
        for codes in CODE_READS[:2]:
            configs.append(triton.Config({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "USE_DOT": True, "CODES": codes},
                                         num_warps=warps, num_stages=3))
    return configs


SPLIT_K_CONFIGS = _split_k_configs()


GEMM_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "USE_DOT": True, "CODES": codes},
                  num_warps=warps, num_stages=stages)
    for bm, bn, bk, warps, stages in ((64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
                                      (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 64, 128, 4, 3))
    for codes in CODE_READS[:2]
]


def split_k_fits(config: triton.Config, m: int) -> bool:
    """Whether a split-K configuration serves M rows: the multiply-and-reduce ones with BLOCK_M
    the power of two >= M (16 from M = 16 on: more rows take more programs), the tensor-core
    ones (16 rows) from M = 3 on."""
    kw = config.kwargs
    if kw["USE_DOT"]:
        return m >= 3
    return kw["BLOCK_M"] == triton.next_power_of_2(min(m, 16))


def default_config(path: str, m: int) -> triton.Config:
    """The configuration used without tuning (under the interpreter, where there is no GPU to
    time, and by the correctness check): 32 x 128 tiles on the split-K path, CUDA cores while
    BLOCK_M x 32 x 128 fits the registers, tensor cores beyond; 64 x 64 x 64 on the GEMM path."""
    if path == "gemm":
        return next(c for c in GEMM_CONFIGS if c.kwargs["CODES"] == "unpack")
    codes = "table" if m == 1 else "unpack"  # each falls back to the next when the format has no use for it
    return next(c for c in SPLIT_K_CONFIGS if split_k_fits(c, m) and c.kwargs["CODES"] == codes
                and (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) == (32, 128))


def _prune_split_k(configs, named_args, **kwargs):
    return [c for c in _prune_code_reads(configs, named_args, **kwargs) if split_k_fits(c, named_args["M"])]


def reads_codes_distinctly(config: triton.Config, bits: int, byte_table: bool) -> bool:
    """False where the configuration's way of reading codes would run the same code as another
    one: "unpack" is "code" for 3, 5, 6, 7 bits, and "table" is "unpack" unless the byte table
    serves the call (``byte_table``)."""
    codes = config.kwargs["CODES"]
    return not ((codes == "unpack" and 8 % bits != 0) or (codes == "table" and not byte_table))


def _prune_code_reads(configs, named_args, **kwargs):
    return [c for c in configs if reads_codes_distinctly(c, kwargs["BITS"], kwargs["BYTE_TABLE"])]


_TUNING_KEY = ["m_bucket", "N", "K", "SPLIT", "BITS", "BLOCK", "PER_BLOCK_BOOK", "HAS_OFFSETS", "HAS_BIAS"]


# Tuned on the GPU at the first call of each key; the winners are cached on disk per GPU target
# (kernels.triton_util), so a second run does not re-tune.
TUNED_KERNELS = {
    "gemv": autotune(SPLIT_K_CONFIGS, _TUNING_KEY, prune_configs_by={"early_config_prune": _prune_split_k})(
        lut_matmul_kernel),
    "gemm": autotune(GEMM_CONFIGS, _TUNING_KEY, prune_configs_by={"early_config_prune": _prune_code_reads})(
        lut_matmul_kernel),
}


def split_count(n: int, k: int) -> int:
    """Programs along K for the split-K path: enough that one row of x still fills the GPU
    (about 256 programs with 32-row tiles), none shorter than 256 of K."""
    return max(1, min(triton.cdiv(k, 256), 256 // triton.cdiv(n, 32)))


def kernel_args(x2, w: PackedWeight, bias, target, path, split_k, table=None, emulate=False):
    """(positional arguments, constexpr flags) of ``lut_matmul_kernel`` for a 2-D x and the
    output or partial-sum buffer ``target``, less the tile configuration. Builds the byte table
    when the one-row path uses it and ``table`` is None."""
    m, n, k = x2.shape[0], w.out_features, x2.shape[1]
    by_bytes = path == "gemv" and m == 1 and uses_byte_table(w)
    if by_bytes and table is None:
        table = byte_table(w.codebook, w.bits)
    elif by_bytes and (tuple(table.shape) != (256, 8 // w.bits) or table.dtype != torch.float32):
        raise HiltError(f"table must be float32 (256, {8 // w.bits}) (byte_table), got {table.dtype} "
                        f"{tuple(table.shape)}")
    scales = w.scales.contiguous()
    args = (x2, w.codes.contiguous(), w.codebook.contiguous(), table if by_bytes else w.codebook, scales,
            scales if w.offsets is None else w.offsets.contiguous(), scales if bias is None else bias.contiguous(),
            target, m, n, k, w.codes.shape[1], w.n_blocks, split_k, triton.next_power_of_2(m),
            x2.stride(0), target.stride(-2), target.stride(0) if split_k > 1 else 0)
    flags = {"BITS": w.bits, "BLOCK": w.block_size, "PER_BLOCK_BOOK": w.per_block_codebook, "BYTE_TABLE": by_bytes,
             "HAS_OFFSETS": w.offsets is not None, "HAS_BIAS": bias is not None,
             # Triton's interpreter computes tl.dot on bfloat16 wrongly (checked: values of 1e10
             # for unit inputs), so there the dot runs in float32; GPUs use bf16 tensor cores.
             "DOT_FP32": x2.dtype == torch.float32 or (x2.dtype == torch.bfloat16 and emulate),
             "EMULATE": emulate}
    return args, flags


def lut_matmul_triton(x, w: PackedWeight, bias=None, path=None, split_k=None, config=None, out=None, partial=None,
                      table=None):
    """The Triton kernel (any device Triton runs on, including the CPU interpreter).

    ``path``: "gemv" (split-K, M <= 16) or "gemm" (default: :func:`choose_path`).
    ``split_k``: programs along K on the split-K path (default: :func:`split_count`; the
    GEMM path runs one). ``config``: a ``triton.Config`` of BLOCK_M, BLOCK_N, BLOCK_K,
    USE_DOT (default: autotuned on a GPU, :func:`default_config` under the interpreter).
    ``out``: optional (M, N) tensor in x's dtype for the result (M: x's rows); ``partial``:
    optional float32 (split_k, M, N) buffer for the per-split sums. Tests fill both with NaN
    to catch unwritten elements. ``table``: the codebook's :func:`byte_table` for one-row
    inputs (built here when needed and not given).
    """
    check_input(x, w)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise HiltError(f"input dtype {x.dtype} is not supported (float16, bfloat16, float32)")
    n, k = w.out_features, w.in_features
    if bias is not None and tuple(bias.shape) != (n,):
        raise HiltError(f"bias has shape {tuple(bias.shape)}, expected ({n},)")
    for name, t in (*w.tensors().items(), ("bias", bias), ("table", table), ("out", out), ("partial", partial)):
        if t is not None and t.device != x.device:
            raise HiltError(f"{name} is on {t.device}, the input on {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    path = path or choose_path(m)
    if path not in ("gemv", "gemm"):
        raise HiltError(f"unknown kernel path {path!r}; choose gemv or gemm")
    if path == "gemm":
        split_k = 1
    elif split_k is None:
        split_k = split_count(n, k)
    elif split_k < 1:
        raise HiltError(f"split_k must be at least 1, got {split_k}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or (m and n and out.stride(-1) != 1):
        raise HiltError(f"out must be {x.dtype} {(m, n)} with rows contiguous, got {out.dtype} {tuple(out.shape)} "
                        f"strides {out.stride()}")
    if split_k > 1:
        if partial is None:
            partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        elif tuple(partial.shape) != (split_k, m, n) or partial.dtype != torch.float32 or not partial.is_contiguous():
            raise HiltError(f"partial buffer must be contiguous float32 {(split_k, m, n)}, got {partial.dtype} "
                            f"{tuple(partial.shape)}")
    target = out if split_k == 1 else partial
    emulate = interpreting()
    if m and n:
        if config is None and emulate:
            config = default_config(path, m)
        elif config is not None and path == "gemv" and not split_k_fits(config, m):
            raise HiltError(f"configuration {config} does not serve {m} rows on the split-K path")
        args, flags = kernel_args(x2, w, bias, target, path, split_k, table, emulate)

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), split_k)

        if config is None:
            TUNED_KERNELS[path][grid](*args, **flags)
        else:
            lut_matmul_kernel[grid](*args, **flags, **config.all_kwargs())
    if split_k > 1:
        out.copy_(partial.sum(0))  # fixed order: deterministic
    return out.reshape(*lead, n)

