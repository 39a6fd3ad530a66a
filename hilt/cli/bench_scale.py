from __future__ import annotations

from hilt.cli.common import OUTPUT, command
from hilt.cli.output import write_json_option


def cmd_bench_scale(args) -> int:
    from hilt.bench.perf import scale

    runs = args.runs.split(",") if args.runs else None
    unknown = sorted(set(runs or ()) - set(scale.RUNS))
    if unknown:
        from hilt.cli.common import UsageError

        raise UsageError(f"--runs: unknown run {unknown[0]!r}; choose from {', '.join(scale.RUNS)}")
    result = scale.run(quick=args.quick, shape=args.shape, keep=args.keep, work=args.work, runs=runs,
                       extra=["--ray"] if args.ray else [])
    for r in result["runs"]:
        print(f"{r['run']:<19} {r['wall_s']:8.1f} s wall {r['cpu_s']:8.1f} s CPU  peak RSS "
              f"{r['peak_rss_bytes'] / 2**30:5.2f} GiB  {r['linear_weights_per_s'] / 1e6:6.1f} M weights/s  "
              f"{r['wall_over_read_ceiling']:5.1f}x the disk read")
    write_json_option(args, result)
    return 0


def register(bsub) -> None:
    b = command(bsub, "scale", "hilt quantize on a synthetic Llama-shaped folder (1B or 8B shape): wall, CPU, peak "
                "RSS, the writer's time split and weights/s against the disk read rate",
                "hilt bench scale --shape 1b --json scale.json", [OUTPUT])
    b.add_argument("--quick", action="store_true", help="a tiny shape (seconds)")
    b.add_argument("--shape", choices=["1b", "8b"], help="default 1b (8b: about 16 GB of disk while it runs)")
    b.add_argument("--keep", action="store_true", help="keep the synthetic folder (in --work)")
    b.add_argument("--work", metavar="DIR", help="where the synthetic folder and outputs go (default: a temporary one)")
    b.add_argument("--runs", metavar="LIST", help="comma-separated subset of int4,kmeans4,kmeans3,"
                   "kmeans4-compensated (default all; 8b: all but the compensated one)")
    b.add_argument("--ray", action="store_true", help="quantize with --ray (a local Ray cluster, or RAY_ADDRESS)")
    b.set_defaults(func=cmd_bench_scale)
