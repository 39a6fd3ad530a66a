"""The lookup-table matmul on the CPU as a C kernel (lut_cpu.c), reading hilt's packed codes as stored
(at 1-2 bits, optionally interleaved in place for the pair tables: :class:`Prepared`).

Built on first use by the system's C compiler into the per-user cache (kernels.cbuild), with OpenMP
where the compiler has it (rows of W on torch's threads). The vector path, AVX-512 or AVX2, is chosen
at run time from the CPU and from the weight (a chunk of 16 or 8 lanes' codes must lie in one block);
the portable scalar path takes every format on every CPU. Where the CPU has AVX-512 BF16, bfloat16 x
takes a path of its own (:func:`bf16_path`: the codebook rounded to bfloat16, which the error bound
for bfloat16 x allows), and 1-2 bit weights interleaved in place take the pair tables (:func:`pair_path`:
sums of x looked up by code nibbles, 16 rows a lookup). ``HILT_LUT_ISA=scalar|avx2|avx512|avx512bf16``
(or ``isa=``) caps the path, as the tests do to check each one.

M <= 16 rows of x (decode): the kernel itself, weights dequantized in registers, nothing else
allocated but x reordered. More rows (prefill): bands of rows dequantized by the kernel (at most
``BAND_FLOATS`` values at a time, so memory stays bounded) and multiplied by torch's matmul, in
bfloat16 and column order for bfloat16 x where the CPU has AVX-512 BF16, else in float32 (x then put in
the kernel's column order). A layer called again and
again keeps a :class:`Prepared` weight (QuantLinear does), which spares each call the set-up.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path

import torch

from hilt.errors import HiltError
from hilt.kernels import cbuild
from hilt.kernels.lut_matmul import PackedWeight, check_input

SOURCE = Path(__file__).with_name("lut_cpu.c")
FLAGS = ["-O2", "-fPIC", "-shared"]
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}
SMALL_M = 16  # rows of x the kernel runs itself; beyond, dequantized bands and BLAS
INT8_ROWS = 4  # rows of bfloat16 x the int8 path takes (Q8_ROWS in lut_cpu.c)
BAND_FLOATS = 1 << 21  # weights per band in the prefill path (8 MB in float32)
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class LutWeight(ctypes.Structure):
    """As LutWeight in lut_cpu.c."""

    _fields_ = [("codes", ctypes.c_void_p), ("row_bytes", ctypes.c_int64), ("book", ctypes.c_void_p),
                ("book_dt", ctypes.c_int32), ("per_block", ctypes.c_int32), ("scales", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("scales_dt", ctypes.c_int32), ("offsets_dt", ctypes.c_int32),
                ("bits", ctypes.c_int32), ("interleaved", ctypes.c_int32), ("block", ctypes.c_int64),
                ("K", ctypes.c_int64), ("N", ctypes.c_int64), ("nb", ctypes.c_int64)]


@functools.cache
def library():
    """The loaded kernel, or None where it cannot be built (no compiler, no write access)."""
    lib = cbuild.load(SOURCE, [FLAGS + ["-fopenmp"], FLAGS],
                      ("hilt_lut_matmul", "hilt_lut_dequant", "hilt_lut_dequant_bf16",
                       "hilt_lut_isa", "hilt_lut_layout", "hilt_lut_struct_size", "hilt_lut_bf16_path",
                       "hilt_lut_pair_path", "hilt_lut_int8_path"))
    if lib is None:
        return None
    lib.hilt_lut_struct_size.restype = ctypes.c_int64
    if lib.hilt_lut_struct_size() != ctypes.sizeof(LutWeight):  # the two definitions drifted apart
        raise HiltError("kernels/lut_cpu.c's LutWeight and lut_cpu.py's differ in size; fix the mirror")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    weight = ctypes.POINTER(LutWeight)
    lib.hilt_lut_isa.restype = i32
    lib.hilt_lut_isa.argtypes = []
    lib.hilt_lut_layout.restype = i32
    lib.hilt_lut_layout.argtypes = [weight, i32, ctypes.POINTER(ctypes.c_int)]
    lib.hilt_lut_bf16_path.restype = i32
    lib.hilt_lut_bf16_path.argtypes = [weight, i32]
    lib.hilt_lut_pair_path.restype = i32
    lib.hilt_lut_pair_path.argtypes = [weight, i32]
    lib.hilt_lut_int8_path.restype = i32
    lib.hilt_lut_int8_path.argtypes = [weight, i32]
    lib.hilt_lut_matmul.restype = i32
    lib.hilt_lut_matmul.argtypes = [weight, p, i32, i64, p, p, i32, i32, i32]
    lib.hilt_lut_matmul_many.restype = i32
    lib.hilt_lut_matmul_many.argtypes = [weight, i32, p, i32, i64, p, p, i32, i32, i32]
    lib.hilt_lut_dequant.restype = i32
    lib.hilt_lut_dequant.argtypes = [weight, i64, i64, p, i32, i32]
    lib.hilt_lut_dequant_bf16.restype = i32
    lib.hilt_lut_dequant_bf16.argtypes = [weight, i64, i64, p, i32, i32]
    return lib


@functools.cache
def machine_isa() -> int:
    """The widest vector path of this CPU: 2 AVX-512, 1 AVX2, 0 neither; -1 without the kernel."""
    lib = library()
    return -1 if lib is None else lib.hilt_lut_isa()


def resolve_isa(isa: str | int | None = None) -> int:
    """The path to run: ``isa`` (a name of ISAS or its number), else HILT_LUT_ISA, else the widest;
    never wider than the CPU has."""
    if isa is None:
        isa = os.environ.get("HILT_LUT_ISA") or machine_isa()
    if isinstance(isa, str):
        if isa not in ISAS:
            raise HiltError(f"unknown CPU kernel path {isa!r}; one of {', '.join(ISAS)}")
        isa = ISAS[isa]
    return min(int(isa), machine_isa())


def available() -> bool:
    return library() is not None


def _as_kernel_dtype(t: torch.Tensor) -> torch.Tensor:
    t = t if t.dtype in _DTYPES else t.float()
    return t.contiguous()


def _weight_struct(w: PackedWeight) -> tuple[LutWeight, list[torch.Tensor]]:
    """The C view of ``w`` and the tensors it points into (kept alive by the caller for the call)."""
    codes = w.codes.contiguous()
    book, scales = _as_kernel_dtype(w.codebook), _as_kernel_dtype(w.scales)
    offsets = None if w.offsets is None else _as_kernel_dtype(w.offsets)
    s = LutWeight(codes.data_ptr(), codes.shape[1], book.data_ptr(), _DTYPES[book.dtype], int(w.per_block_codebook),
                  scales.data_ptr(), 0 if offsets is None else offsets.data_ptr(), _DTYPES[scales.dtype],
                  0 if offsets is None else _DTYPES[offsets.dtype], w.bits, 0, w.block_size, w.in_features,
                  w.out_features, w.n_blocks)
    return s, [codes, book, scales, offsets]


def layout(w: PackedWeight, isa=None) -> tuple[int, int]:
    """(lanes, codes per lane unit) of the path ``w`` takes: the column order of :func:`dequantize`."""
    lib = library()
    if lib is None:
        raise HiltError("the CPU LUT kernel is not built here (no working C compiler)")
    s, _keep = _weight_struct(w)
    cpb = ctypes.c_int()
    lanes = lib.hilt_lut_layout(ctypes.byref(s), resolve_isa(isa), ctypes.byref(cpb))
    return lanes, cpb.value


def bf16_path(w: PackedWeight, isa=None) -> bool:
    """Whether bfloat16 x at M <= SMALL_M takes the bfloat16 path (AVX-512 BF16: the codebook as
    bfloat16, one vpermw and one vdpbf16ps per 32 weights): one codebook per layer, 1-4 bits, blocks
    the chunks of 32 lanes tile, and with offsets only a codebook exact in bfloat16."""
    lib = library()
    if lib is None:
        return False
    s, _keep = _weight_struct(w)
    return bool(lib.hilt_lut_bf16_path(ctypes.byref(s), resolve_isa(isa)))


def pair_path(w: PackedWeight, isa=None) -> bool:
    """Whether ``w``, interleaved (:func:`interleave_`), takes the pair-table path for bfloat16 x
    (AVX-512 BF16: sums of x looked up by code pairs, 64 weights a vpermw at 2 bits, 128 at 1 bit,
    against the bfloat16 path's 32): 1-2 bits, one codebook per layer, no offsets, 16 rows or more."""
    lib = library()
    if lib is None:
        return False
    s, _keep = _weight_struct(w)
    return bool(lib.hilt_lut_pair_path(ctypes.byref(s), resolve_isa(isa)))


def int8_path(w: PackedWeight, isa=None) -> bool:
    """Whether bfloat16 x of at most INT8_ROWS rows takes the int8 path for ``w`` under ``isa``: x and the
    codebook rounded to int8, as llama.cpp's CPU matmuls do (2- and 4-bit codes, one codebook per layer, and
    symmetric 8-bit integers, whose levels are int8 already; AVX2)."""
    lib = library()
    if lib is None:
        return False
    s, _ = _weight_struct(w)
    return bool(lib.hilt_lut_int8_path(ctypes.byref(s), resolve_isa(isa)))


def int8_error_ratio(y: torch.Tensor, x: torch.Tensor, w: PackedWeight, ref: torch.Tensor) -> float:
    """Largest |y - ref| over the error the int8 path may make (at most 1 for a correct kernel; inf for a
    NaN or infinity in y): each level rounded to the codebook's int8 step errs by at most ``e``, each x by
    at most half its 64-column chunk's step ``t``, so per output sum_k |s_k| (e |x_k| + t_k / 2 (|l_k| + e)),
    with s the block scale and l the level of weight k; plus the bfloat16 output's rounding, 2^-8 |ref| (twice
    its half ulp), and 2^-20 |x| @ |W| for the float32 sums of the chunks. ``ref``: the float64 reference on x
    as given."""
    from hilt.kernels.lut_matmul import dequantize_lut

    if not torch.isfinite(y).all():
        return float("inf")
    book = w.codebook.double()
    step = book.abs().max() / 127
    e = (book - torch.round(book / step) * step).abs().max() if step > 0 else torch.zeros((), dtype=torch.float64)
    if w.bits == 8:  # symmetric integers: the levels are the int8 values themselves
        e = torch.zeros((), dtype=torch.float64)
    x2 = x.double().reshape(-1, w.in_features)
    scales = w.scales.double().abs().repeat_interleave(w.block_size, dim=1)[:, :w.in_features]  # |s_k| (N, K)
    w_abs = dequantize_lut(w).double().abs()
    t = (x2.abs().reshape(x2.shape[0], -1, 64).amax(-1) / 127).repeat_interleave(64, dim=1)  # chunk steps (M, K)
    bound = e * (x2.abs() @ scales.T) + (t / 2) @ (w_abs + e * scales).T
    bound = bound.reshape(ref.shape) + 2.0**-8 * ref.abs() + 2.0**-20 * (x2.abs() @ w_abs.T).reshape(ref.shape)
    return float(((y.double() - ref) / (bound + 1e-6)).abs().max()) if ref.numel() else 0.0


def _tiles(w: PackedWeight) -> tuple[int, int, int]:
    """(tiles of 16 rows, code words a row, blocks a row) of the interleaved order"""
    return w.out_features // 16, w.codes.shape[1] // 2, w.n_blocks


@torch.no_grad()
def interleave_(w: PackedWeight) -> None:
    """Put ``w``'s codes and scales in the pair-table path's order, in place (the same tensors, their
    bytes permuted): rows in tiles of 16; in a tile, each two-byte word of the rows side by side
    (word j of rows 0-15, then word j + 1), scales as (tile, block, row). Rows after the last whole tile
    stay as stored. :func:`deinterleave_` undoes it."""
    t, words, nb = _tiles(w)
    codes, scales = w.codes[:16 * t], w.scales[:16 * t]
    codes.view(t, words, 16, 2).copy_(codes.clone().view(t, 16, words, 2).transpose(1, 2))
    scales.view(t, nb, 16).copy_(scales.clone().view(t, 16, nb).transpose(1, 2))


@torch.no_grad()
def deinterleave_(w: PackedWeight) -> None:
    """The stored order again, in place (the inverse of :func:`interleave_`)."""
    t, words, nb = _tiles(w)
    codes, scales = w.codes[:16 * t], w.scales[:16 * t]
    codes.view(t, 16, words, 2).copy_(codes.clone().view(t, words, 16, 2).transpose(1, 2))
    scales.view(t, 16, nb).copy_(scales.clone().view(t, nb, 16).transpose(1, 2))


def _threads() -> int:
    return max(1, torch.get_num_threads())


def dequantize(w: PackedWeight, rows: tuple[int, int] | None = None, isa=None) -> torch.Tensor:
    """float32 rows of W, columns in the kernel's order for its path (natural order on the portable
    path); tests and the prefill path."""
    lib = library()
    s, _keep = _weight_struct(w)
    r0, r1 = rows or (0, w.out_features)
    out = torch.empty(r1 - r0, w.in_features, dtype=torch.float32)
    if lib.hilt_lut_dequant(ctypes.byref(s), r0, r1, out.data_ptr(), resolve_isa(isa), _threads()):
        raise MemoryError("the CPU LUT kernel could not allocate a row buffer")
    return out


class Prepared:
    """A weight readied for repeated calls (decode runs every layer once a token): its C view, the
    path and the library found once, so that a call costs the kernel and little else. Calling it is
    :func:`lut_matmul_cpu`. It points into ``w``'s tensors (no copy); remake it when they change.

    With ``interleave``, a weight the pair-table path takes (:func:`pair_path`) is put in that path's
    order in place, so that no second copy is held: ``w``'s codes and scales are then not in the stored
    order until :meth:`restore` (every other path reads the interleaved rows too)."""

    def __init__(self, lib, w: PackedWeight, isa=None, interleave: bool = False):
        self.lib, self.w, self.shape = lib, w, (w.out_features, w.in_features)
        self.struct, self._keep = _weight_struct(w)
        self.ref = ctypes.byref(self.struct)
        self.path = resolve_isa(isa)
        self.bf16_bands = self.path >= ISAS["avx512bf16"]  # prefill of bfloat16 x in bfloat16 (see _bands)
        own = self._keep[0] is w.codes and self._keep[2] is w.scales  # the C view is w's tensors, not copies
        writable = torch.is_inference_mode_enabled() or not torch.is_inference(w.codes)
        self.interleaved = bool(interleave and own and writable and lib.hilt_lut_pair_path(self.ref, self.path))
        if self.interleaved:
            interleave_(w)
            self.struct.interleaved = 1

    def restore(self) -> None:
        """Put the weight back in the stored order (calls then take the paths for that order)."""
        if self.interleaved:
            deinterleave_(self.w)
            self.struct.interleaved = 0
            self.interleaved = False

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # called for every layer at every decode step, so kept lean: each us here is 0.2 ms of a SmolLM2 token
        # (no reshape of x and the output made in its final shape from plain ints: 1-2 us each otherwise)
        n, k = self.shape
        *lead, kx = x.shape
        if kx != k:
            check_input(x, self.w)
        if bias is not None and tuple(bias.shape) != (n,):
            raise HiltError(f"bias has shape {tuple(bias.shape)}, expected {(n,)}")
        dtype = x.dtype
        if dtype is not torch.float32 and dtype is not torch.bfloat16:
            x = x.float()  # float16, float64: through float32, the result cast back below
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.numel() // k
        b = None if bias is None else bias.detach().float().contiguous()
        if m <= SMALL_M:
            out = torch.empty(*lead, n, dtype=x.dtype)
            code = _DTYPES[x.dtype]
            if m and self.lib.hilt_lut_matmul(self.ref, x.data_ptr(), code, m, None if b is None else b.data_ptr(),
                                              out.data_ptr(), code, self.path, torch.get_num_threads()):
                raise MemoryError("the CPU LUT kernel could not allocate its scratch copy of x")
        else:
            out = self._bands(x.view(m, k), b).view(*lead, n)
        return out if out.dtype == dtype else out.to(dtype)

    def _bands(self, x2: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """Prefill: bands of W dequantized by the kernel and multiplied by torch's matmul. bfloat16 x
        takes bfloat16 bands (the weights rounded to bfloat16, as on the decode path; torch's bfloat16
        matmul, AMX where the CPU has it), float32 x float32 bands; bands of at most BAND_FLOATS values.
        bfloat16 bands come in column order (the kernel reorders each row while it is in cache); float32
        bands in the kernel's, so x is put in that order once."""
        w, lib, path = self.w, self.lib, self.path
        n, k, m = w.out_features, w.in_features, x2.shape[0]
        if x2.dtype == torch.bfloat16 and self.bf16_bands:
            dtype, dequant, xp = torch.bfloat16, lib.hilt_lut_dequant_bf16, x2  # bands in column order
        else:
            dtype, dequant = torch.float32, lib.hilt_lut_dequant
            cpb = ctypes.c_int()
            lanes = lib.hilt_lut_layout(self.ref, path, ctypes.byref(cpb))
            # within each chunk of lanes * cpb columns, phase-major (lut_cpu.c)
            xp = x2.view(m, k // (lanes * cpb.value), lanes, cpb.value).transpose(2, 3).reshape(m, k).float()
        step = max(1, BAND_FLOATS // k)
        band = _scratch(min(step, n) * k, dtype).view(-1, k)
        parts = []
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            if dequant(self.ref, r0, r1, band.data_ptr(), path, _threads()):
                raise MemoryError("the CPU LUT kernel could not allocate a row buffer")
            parts.append(xp @ band[:r1 - r0].T)
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out if b is None else (out.float() + b).to(dtype)


class PreparedGroup:
    """Weights readied together for the same x (a layer's q, k and v; gate and up): one C call computes
    every output, so the cost outside the kernel (about 10 us of Python and ctypes a call) is paid once.
    Made from :class:`Prepared` members (whose C views it copies: remake it when one of them is remade);
    each output is what the member alone gives, bit for bit."""

    def __init__(self, members: list[Prepared]):
        first = members[0]
        if any(m.lib is not first.lib or m.path != first.path or m.shape[1] != first.shape[1] for m in members):
            raise HiltError("a group's weights must share the input size and the kernel path")
        self.lib, self.path, self.members = first.lib, first.path, members
        self.structs = (LutWeight * len(members))(*(m.struct for m in members))
        self.count, self.in_features = len(members), first.shape[1]

    def __call__(self, x: torch.Tensor, biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
        k = self.in_features
        *lead, kx = x.shape
        m = x.numel() // max(1, kx)
        if kx != k or m > SMALL_M or x.dtype not in (torch.float32, torch.bfloat16):  # bands, casts, or the error
            return [p(x, b) for p, b in zip(self.members, biases)]
        if not x.is_contiguous():
            x = x.contiguous()
        outs = [torch.empty(*lead, p.shape[0], dtype=x.dtype) for p in self.members]
        floats = [None if b is None else b.detach().float().contiguous() for b in biases]
        for p, b in zip(self.members, floats):
            if b is not None and tuple(b.shape) != (p.shape[0],):
                raise HiltError(f"bias has shape {tuple(b.shape)}, expected {(p.shape[0],)}")
        bias_ptrs = None if all(b is None for b in floats) else (ctypes.c_void_p * self.count)(
            *(None if b is None else b.data_ptr() for b in floats))
        code = _DTYPES[x.dtype]
        if m and self.lib.hilt_lut_matmul_many(self.structs, self.count, x.data_ptr(), code, m, bias_ptrs,
                                               (ctypes.c_void_p * self.count)(*(o.data_ptr() for o in outs)),
                                               code, self.path, torch.get_num_threads()):
            raise MemoryError("the CPU LUT kernel could not allocate its scratch copy of x")
        return outs


_local = threading.local()


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of this thread's for the prefill bands, reused from layer to layer: a fresh one each call
    would cost its page faults every time (an 8 MB band is thousands of pages)."""
    kept = getattr(_local, "bands", {})
    _local.bands = kept
    if dtype not in kept or kept[dtype].numel() < numel:
        kept[dtype] = torch.empty(numel, dtype=dtype)
    return kept[dtype][:numel]


def prepare(w: PackedWeight, isa=None, interleave: bool = False) -> Prepared | None:
    """``w`` readied for the kernel (:class:`Prepared`), or None where the kernel is not built."""
    lib = library()
    return None if lib is None else Prepared(lib, w, isa, interleave)


def lut_matmul_cpu(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, isa=None):
    """y = x @ dequant(w).T (+ bias) on CPU tensors by the C kernel, in x's dtype; None where the
    kernel is not built (the caller runs the reference)."""
    kernel = prepare(w, isa)
    return None if kernel is None else kernel(x, bias)
