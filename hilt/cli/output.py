"""What commands write besides their results: the `hilt` logger's lines, --json and --plot."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from hilt.cli.common import LOG
from hilt.errors import HiltError
from hilt.progress import Handler


def configure_logging(verbosity: int, stream) -> None:
    """The `hilt` logger: INFO and DEBUG to ``stream`` as plain lines, warnings and errors to stderr."""
    for old in [h for h in LOG.handlers if getattr(h, "hilt_cli", False)]:
        LOG.removeHandler(old)  # main() may run more than once in a process (tests)
    lines = Handler(stream)
    lines.addFilter(lambda record: record.levelno < logging.WARNING)
    warnings = Handler(sys.stderr)
    warnings.setLevel(logging.WARNING)
    warnings.setFormatter(WarningFormat())
    for h in (lines, warnings):
        h.hilt_cli = True
        LOG.addHandler(h)
    LOG.setLevel(min(logging.ERROR, max(logging.DEBUG, logging.INFO - 10 * verbosity)))
    LOG.propagate = False
    if verbosity > 0:  # other libraries (torch, onnx, ...) otherwise only show their warnings
        logging.basicConfig(level=logging.INFO if verbosity == 1 else logging.DEBUG, format="%(name)s: %(message)s")


class WarningFormat(logging.Formatter):
    def format(self, record):
        return f"hilt: {record.levelname.lower()}: {record.getMessage()}"


def write_json_option(args, obj) -> None:
    """--json FILE (atomic, as every JSON file hilt writes), or --json - (stdout)."""
    if not getattr(args, "json", None):
        return
    if args.json == "-":
        args.stdout.write(json.dumps(obj, indent=1) + "\n")
        args.stdout.flush()
    else:
        from hilt.atomic import write_json

        write_json(args.json, obj)


def check_output_folders(args) -> None:
    """--json FILE and --plot FILE need an existing folder: said before any work, not after it."""
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if isinstance(path, (str, Path)) and str(path) != "-" and not Path(path).parent.is_dir():
            raise HiltError(f"--{flag} {path}: folder {Path(path).parent} does not exist")


def write_outputs(args, result, plot=None, render=None) -> None:
    """--json and, where the command has them, --plot FILE drawn by ``plot(result, path)`` and --markdown
    FILE written by ``render(result)``."""
    write_json_option(args, result)
    if plot is not None and args.plot:
        try:
            plot(result, args.plot)
        except OSError as e:
            raise HiltError(f"--plot {args.plot}: cannot write ({e.strerror or e})") from None
        LOG.info(f"wrote {args.plot}")
    if render is not None and args.markdown:
        from hilt.atomic import write_text

        write_text(args.markdown, render(result))
        LOG.info(f"wrote {args.markdown}")
