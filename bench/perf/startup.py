"""`hilt bench startup`: how long `hilt --help` takes against `python -c "import torch"`.

The command line must start fast: `hilt --help` imports neither torch nor Triton, so its wall time
should be within 0.3 s of importing torch alone (the floor of any command that computes). Both are
timed in fresh processes, alternating, in the same run; medians over ``repeats`` after a warm-up
of each (which fills the OS file cache).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from hilt.progress import LOG

TARGET_S = 0.3  # allowed excess of `hilt --help` over `import torch`


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def run(repeats: int = 7) -> dict:
    commands = {
        "import torch": [sys.executable, "-c", "import torch"],
        "hilt --help": [sys.executable, "-m", "hilt", "--help"],
        "hilt --version": [sys.executable, "-m", "hilt", "--version"],
    }
    for argv in commands.values():
        _wall(argv)
    times = {name: [] for name in commands}
    for _ in range(repeats):
        for name, argv in commands.items():
            times[name].append(_wall(argv))
    medians = {name: statistics.median(t) for name, t in times.items()}
    excess = medians["hilt --help"] - medians["import torch"]
    for name, t in medians.items():
        LOG.info(f"{name:<15} {t * 1e3:7.1f} ms (median of {repeats})")
    LOG.info(f"hilt --help - import torch: {excess * 1e3:+.1f} ms (target <= {TARGET_S * 1e3:.0f} ms): "
             f"{'met' if excess <= TARGET_S else 'MISSED'}")
    return {"repeats": repeats, "median_s": medians, "help_minus_torch_s": excess, "target_s": TARGET_S,
            "met": excess <= TARGET_S, "python": sys.version.split()[0]}
