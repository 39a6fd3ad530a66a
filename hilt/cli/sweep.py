from __future__ import annotations

import argparse
import os

from hilt.cli.common import OUTPUT, POSITIVE, UsageError, command
from hilt.cli.output import write_json_option


def cmd_sweep(args) -> int:
    from hilt.tasks import sweep

    if args.resume and args.overwrite:
        raise UsageError("--resume continues DIR/results.jsonl and --overwrite replaces it: give one")
    use_ray = bool(os.environ.get("RAY_ADDRESS")) if args.ray is None else args.ray
    if args.workers is not None and not use_ray:
        raise UsageError("--workers sets how many Ray tasks run at once: give --ray too (or set RAY_ADDRESS)")
    result = sweep.run_sweep(args.grid, args.out, resume=args.resume, overwrite=args.overwrite, use_ray=use_ray,
                             workers=args.workers, plots=args.plots, progress=True)
    write_json_option(args, result)
    return 0


def register(sub) -> None:
    sw = command(sub, "sweep", "CIM accuracy (language models: perplexity or embedding cosine) over a grid (models x "
                 "presets x AnalogConfig fields x chips x drift compensation x times, in a TOML file), locally or on a Ray cluster; one tidy row per cell in "
                 "DIR/results.jsonl and DIR/results.csv, plots per axis",
                 "hilt sweep hilt/tasks/grids/example.toml --out sweep/\n"
                 "  hilt sweep hilt/tasks/grids/example.toml --out sweep/ --resume        # after an interruption\n"
                 "  RAY_ADDRESS=auto hilt sweep hilt/tasks/grids/example.toml --out sweep/  # on a running Ray cluster",
                 [OUTPUT])
    sw.add_argument("grid", metavar="GRID.toml", help="the grid (format: docs/sweep.md)")
    sw.add_argument("--out", required=True, metavar="DIR", help="output folder")
    sw.add_argument("--resume", action="store_true", help="continue an interrupted sweep: keep DIR's rows, run the "
                    "cells that are missing")
    sw.add_argument("--overwrite", action="store_true", help="replace the results already in DIR")
    sw.add_argument("--ray", action=argparse.BooleanOptionalAction, default=None,
                    help="run the groups as Ray tasks (default: when RAY_ADDRESS is set; needs hilt[ray])")
    sw.add_argument("--workers", type=POSITIVE, metavar="N", help="with --ray: N tasks at once, each with the "
                    "cluster's CPUs / N (default: one CPU per task)")
    sw.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                    help="draw DIR/accuracy_by_AXIS.png (default: yes)")
    sw.set_defaults(func=cmd_sweep)
