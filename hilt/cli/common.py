"""What every command module shares when it declares its flags: the parser class, argument types,
parent parsers and the command constructors (the outputs: hilt.cli.output)."""

from __future__ import annotations

import argparse
import logging
import math
import re

from hilt.errors import HiltError

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
LOG = logging.getLogger("hilt")


class UsageError(HiltError):
    """Flags that contradict each other: reported like a bad flag (exit 2)."""


# ------------------------------------------------------------------ parsing


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`hilt quantize: error: --bits: expected an integer 1..8,
    got 'abc'`, exit 2) instead of the usage block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a value such as -1e-5 or -.5 is a (bad) number, not an unknown flag: the flag's own type then refuses
        # it by name; argparse's own pattern knows neither exponents nor a leading point
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message):
        message = re.sub(r"^argument (?:\S+/)?([^\s/]+): ", r"\1: ", message)  # -q/--quiet: the long name
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # named after the command they were given to, not just `hilt`
            self.exit(EXIT_USAGE, f"{getattr(parsed, '_prog', self.prog)}: error: unrecognized arguments: "
                                  f"{' '.join(extra)}\n")
        return parsed

    def add_argument(self, *args, **kwargs):
        if isinstance(kwargs.get("choices"), Names) and "metavar" not in kwargs:
            # a metavar keeps add_argument from formatting (so reading) the choices for every `hilt` run
            action = super().add_argument(*args, metavar="NAME", **kwargs)
            action.metavar = None  # help shows {a,b,c}
            return action
        return super().add_argument(*args, **kwargs)

    def _check_value(self, action, value):  # argparse's hook; a bad choice reads like a bad number
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, f"expected one of {', '.join(map(str, action.choices))}, "
                                                 f"got {value!r}")


def integer(lo: int | None = None, hi: int | None = None):
    what = ("an integer" if lo is None else f"an integer {lo}..{hi}" if hi is not None
            else "a positive integer" if lo == 1 else f"an integer >= {lo}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def name_list(names, what: str, plural: str):
    """A comma-separated list of names from ``names`` (a tuple, or a callable giving one, for names whose
    module imports torch: read only when the flag is given), checked while parsing; the text normalised."""

    def parse(text: str) -> str:
        known = names() if callable(names) else names
        chosen = [t.strip() for t in text.split(",")]
        bad = [t for t in chosen if t not in known]
        if bad or not text.strip():
            raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not {what}; the {plural} are "
                                             f"{', '.join(known)}")
        return ",".join(chosen)
    return parse


def number(positive: bool = False, non_negative: bool = False):
    what = "a positive number" if positive else "a number >= 0" if non_negative else "a number"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (positive and value <= 0) or (non_negative and value < 0):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


POSITIVE, NON_NEGATIVE, POSITIVE_NUMBER = integer(1), integer(0), number(positive=True)
NOISE_LEVEL = number(non_negative=True)


def float_pair(text: str) -> tuple[float, float]:
    """MIN,MAX of noise levels: finite, 0 <= MIN <= MAX."""
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        lo = hi = math.nan
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi):
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 0 <= MIN <= MAX, such as 0.1,0.6, got {text!r}")
    return lo, hi


class Names:
    """Choices named by a library constant (a dict's keys or a tuple's items). The module is
    imported when argparse first needs them (a value to check, a command's --help), so that
    `hilt --help` imports no torch."""

    def __init__(self, module: str, constant: str):
        self.module, self.constant, self._names = module, constant, None

    def _load(self) -> tuple:
        if self._names is None:
            import importlib

            self._names = tuple(getattr(importlib.import_module(self.module), self.constant))
        return self._names

    def __iter__(self):
        return iter(self._load())

    def __contains__(self, value) -> bool:
        return value in self._load()

    def __len__(self) -> int:
        return len(self._load())


# Spelled out, not read from hilt.quant.formats, so that `hilt quantize --help` imports no torch;
# tests/test_package.py checks that they are the registry's methods.
QUANT_METHODS = ("kmeans", "int", "int-asym", "binary")
CIM_PRESETS = Names("hilt.cim_sim.config", "PRESETS")
LM_CHIPS = Names("hilt.cim_sim.config", "LM_CHIPS")
HWA_METHODS = Names("hilt.tasks.hwa", "HWA_METHODS")
DRIFT_COMPENSATION = Names("hilt.cim_sim.model", "GDC_MODES")
ENERGY_CHIPS = Names("hilt.cim_sim.energy", "CHIPS")
WORKLOADS = Names("hilt.models.classifiers", "WORKLOADS")
TRAINING_METHODS = Names("hilt.cim_sim.training", "METHODS")
NOISE_MODELS = Names("hilt.cim_sim.training", "NOISE_MODELS")
WEIGHTINGS = Names("hilt.cim_sim.training", "WEIGHTINGS")
DENSE_DTYPES = ("bfloat16", "float16", "float32")


def model_spec(text: str) -> str:
    """A built-in workload name or a factory, PKG.MODULE:FACTORY (checked when loaded)."""
    if ":" in text or text in WORKLOADS:
        return text
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(WORKLOADS)} or PKG.MODULE:FACTORY, got {text!r}")


class Renamed(argparse.Action):
    """A flag that was renamed: says to what, rather than 'unrecognized arguments'."""

    def __init__(self, option_strings, dest, new: str, why: str = "", **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new, self.why = new, why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: renamed to {self.new}{self.why}")


class Version(argparse.Action):
    """--version, looked up in the package metadata only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from hilt import __version__

        print(f"hilt {__version__}")
        parser.exit()


# Flags that several commands share come from these parents, so they read the same everywhere.
# SUPPRESS: a flag absent after the command name keeps what `hilt -v CMD` set before it.
COMMON = argparse.ArgumentParser(add_help=False)
COMMON.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                     help="more detail: the libraries' own log lines too (-vv: their debug lines)")
COMMON.add_argument("-q", "--quiet", action="count", default=argparse.SUPPRESS,
                     help="no progress or informational lines, only results and errors (-qq: no warnings)")
COMMON.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
OUTPUT = argparse.ArgumentParser(add_help=False)
OUTPUT.add_argument("--json", metavar="FILE", help="write the results as JSON (written whole); '-': to stdout, "
                     "everything else then goes to stderr")
PLOT = argparse.ArgumentParser(add_help=False)
PLOT.add_argument("--plot", metavar="FILE", help="draw the results as a PNG image")
SEED = argparse.ArgumentParser(add_help=False)
SEED.add_argument("--seed", type=NON_NEGATIVE, default=0, help="seed of the random draws (default 0)")


def command(sub, name: str, help_text: str, example: str | None = None, parents=(), plot: str = ""):
    """A subcommand; ``plot``: what its --plot draws (said in its own help only)."""
    extra = {"epilog": f"example:\n  {example}", "formatter_class": argparse.RawDescriptionHelpFormatter} \
        if example else {}
    p = sub.add_parser(name, help=help_text, description=help_text + (f"\n\n--plot: {plot}" if plot else ""),
                       parents=[COMMON, *parents], **extra)
    p.set_defaults(_prog=p.prog)
    return p


def group(sub, name: str, help_text: str, dest: str):
    p = command(sub, name, help_text)
    return p.add_subparsers(dest=dest, required=True, metavar=dest.upper())


def resolve_bits(args, default: int) -> int:
    """--bits may be left out: a format of one width (binary: 1 bit) takes it, the others ``default``."""
    from hilt.quant.formats import get_format

    fixed = get_format(args.method).fixed_bits
    if fixed is not None:
        if args.bits not in (None, fixed):
            raise UsageError(f"--method {args.method} is {fixed} bit, but --bits {args.bits} was given "
                             "(leave --bits out)")
        return fixed
    return default if args.bits is None else args.bits


def config_overrides(items) -> dict:
    """--set FIELD=VALUE (AnalogConfig fields) -> {field: value}, values read as JSON where they parse."""
    import json

    out = {}
    for item in items or []:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise UsageError(f"--set {item}: expected FIELD=VALUE, e.g. --set weight_mapping=column")
        try:
            out[field] = json.loads(value)
        except ValueError:
            out[field] = value
    return out
