"""How fast `hilt quantize` is, and how much memory it takes (issue: Foundation, Performance).

1. Speed: quantize every linear weight of SmolLM2-135M to 4-bit k-means with
   one codebook per layer (the real `quantize_checkpoint`, end to end), and
   compare the codebook fit, tensor by tensor, with the published reference
   procedure: k-means++ then Lloyd with dense point-to-centroid distances
   until at most 1e-4 of the assignments change (cap 1000). Both fit the same
   block-normalised values; errors are compared as k-means cost (SSE).
2. Memory: generate a synthetic safetensors checkpoint of ``--memory-gb`` GB
   (4096 x 4096 float32 tensors), quantize it in a child process and report
   that process's peak resident memory.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hilt.quant import QuantConfig, open_source, quantize_checkpoint
from hilt.quant.targets import select_targets
from hilt.quant.kmeans import SortedValues, kmeans_optimal
from hilt.quant.quantize import normalise_blocks
from hilt.progress import LOG


def reference_kmeans(x: torch.Tensor, k: int, tol: float = 1e-4, max_iter: int = 1000, generator=None):
    """The published procedure, written as its reference code does it: dense distances each step."""
    x = x.reshape(-1).float()
    n = x.numel()
    first = torch.randint(n, (1,), generator=generator)
    centers = x[first]
    d2 = (x - centers) ** 2
    for _ in range(1, k):  # k-means++: sample proportional to squared distance
        cdf = d2.double().cumsum(0)
        pick = torch.searchsorted(cdf, torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1])
        centers = torch.cat([centers, x[pick.clamp_max(n - 1)]])
        d2 = torch.minimum(d2, (x - centers[-1]) ** 2)
    assign = torch.full((n,), -1, dtype=torch.int64)
    it = 0
    for it in range(1, max_iter + 1):
        new = ((x[:, None] - centers[None, :]) ** 2).argmin(1)
        changed = int((new != assign).sum())
        assign = new
        sums = torch.zeros(k, dtype=torch.float64).index_add_(0, assign, x.double())
        counts = torch.bincount(assign, minlength=k).double()
        centers = torch.where(counts > 0, sums / counts.clamp_min(1), centers.double()).float()
        if changed <= tol * n:
            break
    return centers.double().sort().values, it


def speed(src: Path, reference_tensors: int) -> dict:
    config = QuantConfig("kmeans", 4, 64)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        header = quantize_checkpoint(src, Path(tmp) / "q", config).header
        end_to_end = time.perf_counter() - start
    LOG.info(f"hilt quantize, all {header['totals']['quantized_tensors']} linear weights of SmolLM2-135M "
             f"to 4-bit k-means: {end_to_end:.1f} s")
    rows = []
    with open_source(src) as source:
        names = select_targets(source)
        # an even spread over the depth of the model, all projection kinds
        picked = names[:: max(1, len(names) // reference_tensors)][:reference_tensors]
        for name in picked:
            u = normalise_blocks(source.get(name), config)[2].reshape(-1)
            t0 = time.perf_counter()
            ours = kmeans_optimal(u, 16)
            t_ours = time.perf_counter() - t0
            t0 = time.perf_counter()
            ref_c, ref_iters = reference_kmeans(u, 16, generator=torch.Generator().manual_seed(0))
            t_ref = time.perf_counter() - t0
            ref_cost = SortedValues(u).cost(ref_c)
            rows.append({"name": name, "values": u.numel(), "ours_seconds": t_ours, "reference_seconds": t_ref,
                         "reference_iterations": ref_iters, "ours_cost": ours.cost, "reference_cost": ref_cost,
                         "ours_certified_gap": ours.gap_bound})
            LOG.info(f"  {name:<24} ours {t_ours * 1e3:7.1f} ms  reference {t_ref * 1e3:8.1f} ms ({ref_iters} it)  "
                     f"cost ratio ours/ref {ours.cost / ref_cost:.6f}")
    t_ours = sum(r["ours_seconds"] for r in rows)
    t_ref = sum(r["reference_seconds"] for r in rows)
    cost_ratio = sum(r["ours_cost"] for r in rows) / sum(r["reference_cost"] for r in rows)
    worse = sum(r["ours_cost"] > r["reference_cost"] * (1 + 1e-9) for r in rows)
    LOG.info(f"codebook fit on {len(rows)} tensors: ours {t_ours:.2f} s vs reference {t_ref:.2f} s "
             f"= {t_ref / t_ours:.1f}x faster; total SSE ours/reference {cost_ratio:.6f}; ours worse on {worse} tensors")
    return {"end_to_end_seconds": end_to_end, "quantized_tensors": header["totals"]["quantized_tensors"],
            "fit_speedup": t_ref / t_ours, "fit_seconds_ours": t_ours, "fit_seconds_reference": t_ref,
            "sse_ratio_ours_over_reference": cost_ratio, "tensors_where_ours_is_worse": worse, "tensors": rows}


# The child reports its own VmHWM (peak RSS of its address space since exec).
# getrusage's ru_maxrss is no good here: Linux carries the parent's peak over
# fork and exec into it, and this parent has just held the whole checkpoint.
_PEAK_OF_QUANTIZE = """
import sys
from hilt.cli import main
rc = main(["quantize", sys.argv[1], sys.argv[2], "--bits", "4", "--quiet"])
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(int(hwm.split()[1]) * 1024)
sys.exit(rc)
"""


def memory(gb: float) -> dict:
    from safetensors.torch import save_file

    side = 4096
    count = max(1, round(gb * 1e9 / (side * side * 4)))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "big.safetensors"
        g = torch.Generator().manual_seed(0)
        tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(side, side, generator=g) * 0.02
                   for i in range(count)}
        save_file(tensors, str(src))
        del tensors
        size = src.stat().st_size
        LOG.info(f"memory: quantizing a generated {size / 2**30:.2f} GiB safetensors checkpoint "
                 f"({count} tensors of {side}x{side} float32) in a child process...")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _PEAK_OF_QUANTIZE, str(src), str(Path(tmp) / "q")],
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr)
    peak = int(proc.stdout.split()[-1])
    LOG.info(f"memory: peak RSS {peak / 2**30:.2f} GiB for a {size / 2**30:.2f} GiB checkpoint ({seconds:.0f} s)")
    return {"checkpoint_bytes": size, "peak_rss_bytes": peak, "seconds": seconds, "tensors": count}


def run(quick: bool = False, reference_tensors: int | None = None, memory_gb: float | None = None) -> dict:
    """Both measurements on SmolLM2-135M (`hilt bench quantize`)."""
    from hilt.models.llama import smollm2_path

    return {
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "speed": speed(smollm2_path(), reference_tensors or (4 if quick else 21)),
        "memory": memory(memory_gb or (1.0 if quick else 4.0)),
    }
