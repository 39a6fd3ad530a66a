from __future__ import annotations

from hilt.cli.common import OUTPUT, command
from hilt.cli.output import write_json_option


def cmd_report(args) -> int:
    from hilt.bench import report

    summary = report.run(out=args.out, quick=not args.full, progress=True)
    write_json_option(args, summary)
    return 0


def register(sub) -> None:
    r = command(sub, "report", "the end-to-end run on the embedded defaults (real models): quantization, LUT "
                "kernels, FP8 attention, CIM drift, DWP robustness, energy, ONNX; writes DIR/report.md",
                "hilt report --out report/", [OUTPUT])
    r.add_argument("--out", default="report", metavar="DIR", help="output folder (default ./report)")
    r.add_argument("--full", action="store_true", help="the full budgets, about 41 minutes on 2 cores (without it: "
                   "smaller budgets everywhere, under 15 minutes)")
    r.set_defaults(func=cmd_report)
