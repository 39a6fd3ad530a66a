from __future__ import annotations

from hilt.cli.common import OUTPUT, command
from hilt.cli.output import write_json_option


def cmd_report(args) -> int:
    from hilt.bench import report

    summary = report.run(out=args.out, quick=not args.full, progress=True)
    write_json_option(args, summary)
    return 0


def register(sub) -> None:
    r = command(sub, "report", "the end-to-end run on the embedded defaults (real models): hilt's claims checked "
                "by this run's numbers, then quantization, CPU decode, LUT kernels, FP8 attention, CIM (CNN and "
                "SmolLM2 over a year), DWP robustness, energy, ONNX; writes DIR/report.md",
                "hilt report --out report/", [OUTPUT])
    r.add_argument("--out", default="report", metavar="DIR", help="output folder (default ./report)")
    r.add_argument("--full", action="store_true", help="the full budgets, about 50 minutes on 2 cores (without it: "
                   "smaller samples of the same real models, about 8 minutes on 2 cores)")
    r.set_defaults(func=cmd_report)
