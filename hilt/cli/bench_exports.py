from __future__ import annotations

from hilt.cli.common import OUTPUT, command
from hilt.cli.output import write_json_option


def cmd_bench_exports(args) -> int:
    from hilt.bench.studies import exports

    result = exports.run(out=args.out, quick=args.quick, work=args.work)
    for row in result["rows"]:
        print(exports.summary(row))
    write_json_option(args, result)
    return 0


def register(bsub) -> None:
    b = command(bsub, "exports", "SmolLM2 exported by hilt and read by the programs that run it: llama.cpp on every "
                "GGUF type (perplexity, tokens and greedy text against hilt, decode rate, memory), a dense export, "
                "and the compressed-tensors folder through transformers; needs scripts/build_llama_cpp.sh",
                "hilt bench exports --quick", [OUTPUT])
    b.add_argument("--quick", action="store_true", help="int4 with two blocks quantized, short texts (seconds)")
    b.add_argument("--out", metavar="DIR", default="bench/results",
                   help="where the results JSON goes (default bench/results; '' for none)")
    b.add_argument("--work", metavar="DIR", help="folder for the checkpoints and GGUF files (default: a temporary one)")
    b.set_defaults(func=cmd_bench_exports)
