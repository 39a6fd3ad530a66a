"""Speed benchmarks (LUT kernels, FP8 attention, quantization, the CIM simulator) and the GPU check."""

import time


def wall_times(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one untimed warm-up call (compilation,
    caches, first-touch allocations)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times
