"""The `hilt` command: parses arguments, calls the packages, prints.

Every user mistake arrives as a HiltError and is printed as one line on stderr with a non-zero
exit (the traceback only with --debug); a bad flag is one line too, with exit 2. Results go to
stdout; informational lines go through the `hilt` logger (-v, -q) to stdout as well, except
under `--json -`, where stdout carries the JSON alone and everything else goes to stderr.
Nothing heavy is imported here: each command imports what it runs.

One module per command (or command group) holds its flags beside its handler; `common` holds the
parser class, argument types and parent parsers. Handlers import what they run, so `hilt --help` and
`hilt COMMAND --help` import no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from hilt.cli.common import COMMON, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, Parser, UsageError, Version
from hilt.cli.output import check_output_folders, configure_logging
from hilt.errors import HiltError

# in the order `hilt --help` lists them
COMMANDS = ("quantize", "convert", "inspect", "calibrate", "sensitivity", "train", "energy", "export", "fp8", "qat",
            "hwa", "drift", "sweep", "certify", "eval", "bench", "report")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="hilt", description="hilt: low-precision inference, from checkpoint to hardware.",
               parents=[COMMON])
    p.add_argument("--version", action=Version, help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for module in COMMANDS:
        importlib.import_module(f"hilt.cli.{module}").register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    to_stdout = getattr(args, "json", None) == "-"
    args.stdout = sys.stdout  # --json - writes here; everything else then goes to stderr
    configure_logging(getattr(args, "verbose", 0) - getattr(args, "quiet", 0), sys.stderr if to_stdout else sys.stdout)
    try:
        check_output_folders(args)
        with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
            return args.func(args)
    except UsageError as e:
        if debug:
            raise
        print(f"{getattr(args, '_prog', 'hilt')}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except HiltError as e:
        if debug:
            raise
        print(f"hilt: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `hilt inspect ... | head` closed the pipe: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not fail again
        return 0
    except KeyboardInterrupt:
        if debug:
            raise
        hint = " (run the same command with --resume to continue)" if args.command in ("quantize", "qat", "hwa", "sweep") else ""
        print(f"hilt: interrupted{hint}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
