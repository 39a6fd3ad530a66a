"""What the Triton kernels share: autotuning with its results cached, the interpreter test, and
a float32 cast that rounds alike on a GPU and in the interpreter."""

import inspect
import os
import warnings

import triton
import triton.language as tl


# Triton 3.9 warns at each compile that its default (fused multiply-adds allowed) changes in 3.10.
# These kernels are checked with fusion on; the warning is silenced here rather than through the
# environment, which importing must not change.
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset", category=UserWarning)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def to_dtype(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """float32 x to ``dtype``, nearest-even (the interpreter truncates float32 -> bfloat16)."""
    if EMULATE and dtype == tl.bfloat16:  # constexprs: decided at compile time
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)  # -65536 == ~0xFFFF
    return x.to(dtype)


def _tuning_bench(fn, quantiles):
    """Shorter than do_bench's defaults (25 ms warm-up, 100 ms runs): tuning times every
    configuration of every new shape, and these kernels take microseconds."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def autotune(configs, key, **options):
    """``triton.autotune`` with the timings cached on disk (Triton >= 3.4; older ones tune in
    every process): in Triton's cache directory ($TRITON_CACHE_DIR, default ~/.triton/cache)
    under a key made of the GPU target (architecture), the Triton version, the kernel source,
    the configurations and the tuning key, so a second run on the same kind of GPU does not
    re-tune."""
    supported = inspect.signature(triton.autotune).parameters
    extra = {name: value for name, value in (("cache_results", True), ("do_bench", _tuning_bench)) if name in supported}
    return triton.autotune(configs, key=key, **options, **extra)
