"""`hilt bench sweep-ray`: how a sweep scales on Ray, on this machine.

One grid (the CNN on PCM and RRAM at four ADC resolutions: 8 groups of 2 cells) run here without
Ray, then as Ray tasks with 1 worker (a task at a time, with every CPU) and with 2 workers (two
tasks at a time, half the CPUs each), each Ray run on a fresh local Ray instance. Each timed run
follows an untimed run of the same grid with another seed (the same shapes), so that the worker
processes have started, imported hilt and compiled the simulator's fused kernels: the timings are
the sweep's own work. The result files of the timed runs must be the same bytes.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

from hilt.errors import HiltError
from hilt.progress import LOG

GRID = """
seed = {seed}
chips = {chips}
images = {images}

[axes]
model = "cnn"
preset = ["pcm", "rram"]
adc_bits = [6, 7, 8, 9]
time = ["1d", "1y"]
"""
FULL = {"chips": 2, "images": 1000}
QUICK = {"chips": 2, "images": 200}


def run(workers=(1, 2), quick: bool = False) -> dict:
    from hilt.tasks.grid import cells_of, parse_grid
    from hilt.tasks.sweep import RESULTS_CSV, RESULTS_JSONL, import_ray, run_sweep

    ray = import_ray()
    if ray.is_initialized():
        raise HiltError("hilt bench sweep-ray starts its own local Ray instances: run it outside a Ray job")
    budget = QUICK if quick else FULL
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        grid, warm = Path(tmp) / "grid.toml", Path(tmp) / "warm-up.toml"
        grid.write_text(GRID.format(seed=0, **budget))
        warm.write_text(GRID.format(seed=1, **budget))
        cells, groups = cells_of(parse_grid(grid))
        runs, outputs = [], []
        for n in (None, *workers):
            name = "local" if n is None else f"ray, {n} worker{'s' * (n > 1)}"
            if n is not None:
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.ERROR)
            try:
                options = {"use_ray": n is not None, "workers": n, "plots": False}
                start = time.perf_counter()
                run_sweep(warm, Path(tmp) / f"warm-up-{n}", **options)
                warm_up = time.perf_counter() - start
                load = os.getloadavg()[0]
                start = time.perf_counter()
                run_sweep(grid, Path(tmp) / f"run-{n}", **options)
                seconds = time.perf_counter() - start
            finally:
                if n is not None:
                    ray.shutdown()
            runs.append({"run": name, "workers": n, "seconds": round(seconds, 2),
                         "warm_up_seconds": round(warm_up, 2), "load_average_1min_at_start": round(load, 2)})
            outputs.append([(Path(tmp) / f"run-{n}" / f).read_bytes() for f in (RESULTS_JSONL, RESULTS_CSV)])
            LOG.info(f"{name}: {seconds:.1f} s (its warm-up run: {warm_up:.1f} s; load average {load:.2f})")
    by_workers = {r["workers"]: r["seconds"] for r in runs}
    result = {"grid": GRID.format(seed=0, **budget).strip(), "cells": len(cells), "groups": len(groups),
              "cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in os.getloadavg()], "runs": runs,
              "identical_files": all(o == outputs[0] for o in outputs)}
    if 1 in by_workers and 2 in by_workers:
        result["ratio_2_to_1_workers"] = round(by_workers[2] / by_workers[1], 3)
        LOG.info(f"2 workers / 1 worker: {result['ratio_2_to_1_workers']:.2f} of the wall time; result files "
            f"{'identical' if result['identical_files'] else 'DIFFERENT'}")
    return result
