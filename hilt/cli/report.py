from __future__ import annotations

from hilt.cli.common import OUTPUT, command
from hilt.cli.output import write_json


def cmd_report(args) -> int:
    from hilt.bench import report

    summary = report.run(out=args.out, quick=not args.full, progress=True)
    write_json(args, summary)
    return 0


def register(sub) -> None:
    r = command(sub, "report", "the end-to-end run on the embedded defaults (real models): quantization, LUT "
                "kernels, FP8 attention, CIM drift, DWP robustness, energy, ONNX; writes DIR/report.md",
                "hilt report --out report/", [OUTPUT])
    r.add_argument("--out", default="report", metavar="DIR", help="output folder (default ./report)")
    budget = r.add_mutually_exclusive_group()
    budget.add_argument("--quick", action="store_true", help="smaller budgets everywhere, about 10 minutes on 2 "
                        "cores (the default)")
    budget.add_argument("--full", action="store_true", help="the full budgets (about 45 minutes on 2 cores)")
    r.set_defaults(func=cmd_report)
