"""Small C kernels compiled on first use by the system's C compiler (as torch.compile's C++ is).

One library per source file, built into a per-user cache under a name keyed by the source, the
compiler, the flags and the machine, so an edit, another compiler or another CPU architecture
builds afresh and nothing stale is ever loaded. Builds are atomic (a temporary name, then a
rename), and a damaged file in the cache is rebuilt. Where nothing builds (no compiler, no write
access), :func:`load` returns None and the caller runs its PyTorch path. Used by kernels.lut_cpu
and cim_sim.output_pass.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from hilt.atomic import replacing
from hilt.errors import HiltError


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "hilt"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(cc: str, flags: list[str], source: Path, target: Path) -> bool:
    """Compile to a temporary name beside ``target``, then rename: concurrent builders (Ray workers)
    never load a half-written library."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with replacing(target, ".so", unique=True) as tmp:
            done = subprocess.run([cc, *flags, str(source), "-o", str(tmp)], capture_output=True, timeout=120)
            if done.returncode != 0:
                raise subprocess.CalledProcessError(done.returncode, cc)
        return True
    except (OSError, subprocess.SubprocessError, HiltError):  # no write access, a compiler that does not run
        return False


def _open(path: Path, symbols: tuple[str, ...]):
    """The library at ``path``, or None for a file that does not load or lacks a symbol."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    return lib if all(hasattr(lib, name) for name in symbols) else None


def load(source: Path, flag_sets: list[list[str]], symbols: tuple[str, ...]):
    """The library built from ``source`` with the first of ``flag_sets`` that builds (e.g. with
    OpenMP, then without), or None. Not cached here: callers keep the result (functools.cache)."""
    cc = compiler()
    if cc is None:
        return None
    text = source.read_bytes()
    for flags in flag_sets:
        key = hashlib.sha256(text + "\0".join([cc, *flags, platform.machine()]).encode()).hexdigest()[:16]
        path = cache_dir() / f"{source.stem}-{key}.so"
        lib = _open(path, symbols) if path.exists() else None
        if lib is None and build(cc, flags, source, path):  # not built yet, or a damaged file: built afresh
            lib = _open(path, symbols)
        if lib is not None:
            return lib
    return None
