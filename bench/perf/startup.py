"""`hilt bench startup`: how long the command line takes to start, against the interpreter's own start-up.

`hilt --help` and `hilt COMMAND --help` import neither torch nor Triton, so each should be within
0.3 s of `python -c pass` (the interpreter alone); `python -c "import torch"` is timed beside them
as the floor of any command that computes. All run in fresh processes, alternating, in the same
run; medians over ``repeats`` after a warm-up of each (which fills the OS file cache).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from hilt.progress import LOG

TARGET_S = 0.3  # allowed excess of a `--help` over `python -c pass`
CHECKED = ("hilt --help", "hilt quantize --help")


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def run(repeats: int = 7) -> dict:
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "import torch": [sys.executable, "-c", "import torch"],
        "hilt --help": [sys.executable, "-m", "hilt", "--help"],
        "hilt quantize --help": [sys.executable, "-m", "hilt", "quantize", "--help"],
        "hilt --version": [sys.executable, "-m", "hilt", "--version"],
    }
    for argv in commands.values():
        _wall(argv)
    times = {name: [] for name in commands}
    for _ in range(repeats):
        for name, argv in commands.items():
            times[name].append(_wall(argv))
    return summarize({name: statistics.median(t) for name, t in times.items()}, repeats)


def summarize(medians: dict[str, float], repeats: int) -> dict:
    """Each checked command's excess over the bare interpreter, and whether all are within the target."""
    excess = {name: medians[name] - medians["python -c pass"] for name in CHECKED}
    for name, t in medians.items():
        LOG.info(f"{name:<22} {t * 1e3:7.1f} ms (median of {repeats})")
    for name, e in excess.items():
        LOG.info(f"{name} - python -c pass: {e * 1e3:+.1f} ms (target <= {TARGET_S * 1e3:.0f} ms): "
                 f"{'met' if e <= TARGET_S else 'MISSED'}")
    return {"repeats": repeats, "median_s": medians, "excess_over_python_s": excess, "target_s": TARGET_S,
            "met": all(e <= TARGET_S for e in excess.values()), "python": sys.version.split()[0]}
