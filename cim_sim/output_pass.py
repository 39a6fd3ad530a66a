"""The analog arrays' output pass as a C kernel (output_pass.c): the forward's hottest loop after the
integer products, about twice as fast as torch.compile's version of the same function.

The kernel is compiled on first use by the system's C compiler (as torch.compile's C++ is) into a
per-user cache, once per source and compiler; where no compiler builds it, :func:`output_pass`
returns None and the caller runs the compiled PyTorch function instead, which gives the same floats.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from hilt.cim_sim.devices import _TABLES

SOURCE = Path(__file__).with_name("output_pass.c")
# -ffp-contract=off: no fused multiply-adds, so every product and sum rounds as in the reference
FLAGS = ["-O2", "-ffp-contract=off", "-fPIC", "-shared"]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "hilt"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, flags: list[str], target: Path) -> bool:
    """Compile to a temporary name beside ``target``, then rename: concurrent builders (Ray workers)
    never load a half-written library."""
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, timeout=120)
        if done.returncode != 0:
            return False
        os.replace(tmp, target)
        return True
    except (OSError, subprocess.SubprocessError):  # no write access, a compiler that does not run
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path):
    """The library at ``path``, or None for a file that does not load or lacks the kernel."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    return lib if all(hasattr(lib, name) for name in ("hilt_output_pass", "hilt_output_pass_isa")) else None


@functools.cache
def library():
    """The loaded kernel library, or None where it cannot be built (no compiler, no write access)."""
    cc = _compiler()
    if cc is None:
        return None
    source = SOURCE.read_bytes()
    # with OpenMP the rows run on torch's threads (the same libgomp); without (a compiler lacking
    # it), on one
    for flags in (FLAGS + ["-fopenmp"], FLAGS):
        key = hashlib.sha256(source + "\0".join([cc, *flags, platform.machine()]).encode()).hexdigest()[:16]
        path = cache_dir() / f"output_pass-{key}.so"
        lib = _load(path) if path.exists() else None
        if lib is None and _build(cc, flags, path):  # not built yet, or a damaged file in the cache: built afresh
            lib = _load(path)
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


def output_pass(part, column_scale, keys, noise_scale, levels, noise: bool, adc: bool, path: int | None = None):
    """What ``analog._output_stage_eager`` computes, by the C kernel: ``part`` the integer product's
    planes (chips, rows, 2n) int32 with ``column_scale`` (chips, 1, n), or float products (chips,
    rows, n) with None, any strides but contiguous columns -> (ADC output or noisy product (chips,
    rows, n), per-row peak or None).
    None when the kernel is not available, or has no vector path on this CPU (one column at a time it
    is slower than torch.compile's vectorized loop). ``path``: a given path of the kernel's (tests)."""
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
    out = torch.empty(chips, rows, n, dtype=torch.float32)
    peak = torch.empty(chips, rows, dtype=torch.float32) if adc else None
    table = _TABLES[torch.float32]
    lib.hilt_output_pass(part.data_ptr() if integer else None, None if integer else part.data_ptr(),
                         part.stride(0), part.stride(1), None if scale is None else scale.data_ptr(),
                         keys.data_ptr(), table.data_ptr(), float(noise_scale), float(levels), int(noise), int(adc),
                         chips, rows, n, out.data_ptr(), None if peak is None else peak.data_ptr(), path)
    return out, peak
