from __future__ import annotations

from hilt.cli import bench_cim, bench_exports, bench_quant, bench_scale
from hilt.cli.common import OUTPUT, POSITIVE, command, group
from hilt.cli.output import write_json_option
from hilt.errors import HiltError


def cmd_bench_attention(args) -> int:
    from hilt.bench.perf import attention_speed

    result = attention_speed.run()
    write_json_option(args, result)
    if result["mismatches"]:  # saved above with the timings of the other configurations
        bad = ", ".join(f"T={m['seq']}{' causal' if m['causal'] else ''} (cosine {m['cosine_vs_bf16']:.4f})"
                        for m in result["mismatches"])
        raise HiltError(f"FP8 attention differs from bf16 SDPA (cosine < {attention_speed.MIN_COSINE}) at {bad}")
    return 0


def cmd_bench_startup(args) -> int:
    from hilt.bench.perf import startup

    write_json_option(args, startup.run(repeats=args.repeats))
    return 0


def register(sub) -> None:
    bsub = group(sub, "bench", "benchmarks (ratios against baselines measured in the same run)", "bench")
    ba = command(bsub, "attention", "FP8 attention kernel against bf16 flash SDPA (GPU only), sequences 1k-16k, "
                 "head dim 128", "hilt bench attention --json attention-gpu.json", [OUTPUT])
    ba.set_defaults(func=cmd_bench_attention)
    bs = command(bsub, "startup", "how long `hilt --help` and `hilt quantize --help` take against `python -c pass` (fresh processes)",
                 "hilt bench startup --json startup.json", [OUTPUT])
    bs.add_argument("--repeats", type=POSITIVE, default=7, help="timed runs of each (default 7), after one warm-up")
    bs.set_defaults(func=cmd_bench_startup)
    bench_quant.register(bsub)
    bench_scale.register(bsub)
    bench_cim.register(bsub)
    bench_exports.register(bsub)
