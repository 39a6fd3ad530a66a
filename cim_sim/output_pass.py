"""The analog arrays' output pass as a C kernel (output_pass.c): the forward's hottest loop after the
integer products, about twice as fast as torch.compile's version of the same function.

The kernel is compiled on first use by the system's C compiler (as torch.compile's C++ is) into a
per-user cache, once per source and compiler; where no compiler builds it, :func:`output_pass`
returns None and the caller runs the compiled PyTorch function instead, which gives the same floats.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from hilt.cim_sim.devices import NORMAL_TABLES
from hilt.kernels import cbuild

SOURCE = Path(__file__).with_name("output_pass.c")
# -ffp-contract=off: no fused multiply-adds, so every product and sum rounds as in the reference
FLAGS = ["-O2", "-ffp-contract=off", "-fPIC", "-shared"]


@functools.cache
def library():
    """The loaded kernel library, or None where it cannot be built (no compiler, no write access)."""
    # with OpenMP the rows run on torch's threads (the same libgomp); without (a compiler lacking
    # it), on one
    lib = cbuild.load(SOURCE, [FLAGS + ["-fopenmp"], FLAGS], ("hilt_output_pass", "hilt_output_pass_isa"))
    if lib is not None:
        lib.hilt_output_pass.restype = None
        pointer, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.hilt_output_pass.argtypes = [pointer] * 2 + [i64] * 2 + [pointer] * 3 + [f32] * 2 + [i32] * 2 + \
            [i64] * 3 + [pointer] * 2 + [i32]  # as hilt_output_pass in output_pass.c
        lib.hilt_output_pass_isa.restype = ctypes.c_int
        return lib
    return None


@functools.cache
def isa() -> int:
    """The kernel's widest vector path on this CPU: 2 AVX-512, 1 AVX2, 0 neither; -1 without the kernel."""
    lib = library()
    return -1 if lib is None else lib.hilt_output_pass_isa()


def output_pass(part, column_scale, keys, noise_scale, levels, noise: bool, adc: bool, path: int | None = None,
                out: torch.Tensor | None = None, peak: torch.Tensor | None = None):
    """What ``analog._output_stage_eager`` computes, by the C kernel: ``part`` the integer product's
    planes (chips, rows, 2n) int32 with ``column_scale`` (chips, 1, n), or float products (chips,
    rows, n) with None, any strides but contiguous columns -> (ADC output or noisy product (chips,
    rows, n), per-row peak or None).
    None when the kernel is not available, or has no vector path on this CPU (one column at a time it
    is slower than torch.compile's vectorized loop). ``path``: a given path of the kernel's (tests).
    ``out``, ``peak``: contiguous float32 tensors of those shapes to write into (else new ones)."""
    lib = library()
    if path is None:
        path = isa()
        if path < 1:
            return None
    integer = column_scale is not None
    tensors = (part, keys) if not integer else (part, keys, column_scale)
    if lib is None or part.dtype != (torch.int32 if integer else torch.float32) or \
            (integer and column_scale.dtype != torch.float32) or any(t.device.type != "cpu" for t in tensors):
        return None  # what the kernel does not take, the compiled pass does
    chips, rows = part.shape[:2]
    n = part.shape[2] // 2 if integer else part.shape[2]
    if part.stride(2) != 1:
        part = part.contiguous()
    scale = column_scale.expand(chips, 1, n).contiguous() if integer else None
    keys = keys.to(torch.int32).contiguous()
    out = torch.empty(chips, rows, n, dtype=torch.float32) if out is None else out
    peak = (torch.empty(chips, rows, dtype=torch.float32) if peak is None else peak) if adc else None
    table = NORMAL_TABLES[torch.float32]
    lib.hilt_output_pass(part.data_ptr() if integer else None, None if integer else part.data_ptr(),
                         part.stride(0), part.stride(1), None if scale is None else scale.data_ptr(),
                         keys.data_ptr(), table.data_ptr(), float(noise_scale), float(levels), int(noise), int(adc),
                         chips, rows, n, out.data_ptr(), None if peak is None else peak.data_ptr(), path)
    return out, peak
