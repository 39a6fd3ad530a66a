"""The `hilt` command: parses arguments, calls the packages, prints.

Every user mistake arrives as a HiltError and is printed as one line on stderr with a non-zero
exit (the traceback only with --debug); a bad flag is one line too, with exit 2. Results go to
stdout; informational lines go through the `hilt` logger (-v, -q) to stdout as well, except
under `--json -`, where stdout carries the JSON alone and everything else goes to stderr.
Nothing heavy is imported here: each command imports what it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from pathlib import Path

from hilt.errors import HiltError
from hilt.progress import Handler, Progress

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
LOG = logging.getLogger("hilt")


class UsageError(HiltError):
    """Flags that contradict each other: reported like a bad flag (exit 2)."""


# ------------------------------------------------------------------ parsing


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`hilt quantize: error: --bits: expected an integer 1..8,
    got 'abc'`, exit 2) instead of the usage block."""

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
        if isinstance(kwargs.get("choices"), _Names) and "metavar" not in kwargs:
            # a metavar keeps add_argument from formatting (so reading) the choices for every `hilt` run
            action = super().add_argument(*args, metavar="NAME", **kwargs)
            action.metavar = None  # help shows {a,b,c}
            return action
        return super().add_argument(*args, **kwargs)

    def _check_value(self, action, value):  # argparse's hook; a bad choice reads like a bad number
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, f"expected one of {', '.join(map(str, action.choices))}, "
                                                 f"got {value!r}")


def _int(lo: int | None = None, hi: int | None = None):
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


def _number(positive: bool = False):
    what = "a positive number" if positive else "a number"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (positive and value <= 0):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


_POSITIVE, _NON_NEGATIVE, _ANY_INT, _POSITIVE_NUMBER = _int(1), _int(0), _int(), _number(positive=True)


def _float_pair(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX such as 0.1,0.6, got {text!r}") from None
    return lo, hi


class _Names:
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


QUANT_METHODS = _Names("hilt.quant.qweight", "METHODS")
CIM_PRESETS = _Names("hilt.cim_sim.analog", "PRESETS")
DRIFT_COMPENSATION = _Names("hilt.cim_sim.model", "GDC_MODES")
ENERGY_CHIPS = _Names("hilt.cim_sim.energy", "CHIPS")
WORKLOADS = _Names("hilt.models.classifiers", "WORKLOADS")
TRAINING_METHODS = _Names("hilt.cim_sim.training", "METHODS")
NOISE_MODELS = _Names("hilt.cim_sim.training", "NOISE_MODELS")
WEIGHTINGS = _Names("hilt.cim_sim.training", "WEIGHTINGS")
DENSE_DTYPES = ("bfloat16", "float16", "float32")


def _model_spec(text: str) -> str:
    """A built-in workload name or a factory, PKG.MODULE:FACTORY (checked when loaded)."""
    if ":" in text or text in WORKLOADS:
        return text
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(WORKLOADS)} or PKG.MODULE:FACTORY, got {text!r}")


class _Renamed(argparse.Action):
    """A flag that was renamed: says to what, rather than 'unrecognized arguments'."""

    def __init__(self, option_strings, dest, new: str, why: str = "", **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new, self.why = new, why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: renamed to {self.new}{self.why}")


class _Version(argparse.Action):
    """--version, looked up in the package metadata only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from hilt import __version__

        print(f"hilt {__version__}")
        parser.exit()


# Flags that several commands share come from these parents, so they read the same everywhere.
# SUPPRESS: a flag absent after the command name keeps what `hilt -v CMD` set before it.
_COMMON = argparse.ArgumentParser(add_help=False)
_COMMON.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                     help="more detail: the libraries' own log lines too (-vv: their debug lines)")
_COMMON.add_argument("-q", "--quiet", action="count", default=argparse.SUPPRESS,
                     help="no progress or informational lines, only results and errors (-qq: no warnings)")
_COMMON.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
_OUTPUT = argparse.ArgumentParser(add_help=False)
_OUTPUT.add_argument("--json", metavar="FILE", help="write the results as JSON (written whole); '-': to stdout, "
                     "everything else then goes to stderr")
_PLOT = argparse.ArgumentParser(add_help=False)
_PLOT.add_argument("--plot", metavar="FILE", help="draw the results as a PNG image")
_SEED = argparse.ArgumentParser(add_help=False)
_SEED.add_argument("--seed", type=_ANY_INT, default=0, help="seed of the random draws (default 0)")


def _command(sub, name: str, help_text: str, example: str | None = None, parents=(), plot: str = ""):
    """A subcommand; ``plot``: what its --plot draws (said in its own help only)."""
    extra = {"epilog": f"example:\n  {example}", "formatter_class": argparse.RawDescriptionHelpFormatter} \
        if example else {}
    p = sub.add_parser(name, help=help_text, description=help_text + (f"\n\n--plot: {plot}" if plot else ""),
                       parents=[_COMMON, *parents], **extra)
    p.set_defaults(_prog=p.prog)
    return p


def _group(sub, name: str, help_text: str, dest: str):
    p = _command(sub, name, help_text)
    return p.add_subparsers(dest=dest, required=True, metavar=dest.upper())


# ------------------------------------------------------------------ output


def _configure_logging(verbosity: int, stream) -> None:
    """The `hilt` logger: INFO and DEBUG to ``stream`` as plain lines, warnings and errors to stderr."""
    for old in [h for h in LOG.handlers if getattr(h, "hilt_cli", False)]:
        LOG.removeHandler(old)  # main() may run more than once in a process (tests)
    lines = Handler(stream)
    lines.addFilter(lambda record: record.levelno < logging.WARNING)
    warnings = Handler(sys.stderr)
    warnings.setLevel(logging.WARNING)
    warnings.setFormatter(_WarningFormat())
    for h in (lines, warnings):
        h.hilt_cli = True
        LOG.addHandler(h)
    LOG.setLevel(min(logging.ERROR, max(logging.DEBUG, logging.INFO - 10 * verbosity)))
    LOG.propagate = False
    if verbosity > 0:  # other libraries (torch, onnx, ...) otherwise only show their warnings
        logging.basicConfig(level=logging.INFO if verbosity == 1 else logging.DEBUG, format="%(name)s: %(message)s")


class _WarningFormat(logging.Formatter):
    def format(self, record):
        return f"hilt: {record.levelname.lower()}: {record.getMessage()}"


def _write_json(args, obj) -> None:
    """--json FILE (atomic, as every JSON file hilt writes), or --json - (stdout)."""
    if not getattr(args, "json", None):
        return
    if args.json == "-":
        args.stdout.write(json.dumps(obj, indent=1) + "\n")
        args.stdout.flush()
    else:
        from hilt.quant.checkpoint import write_json

        write_json(args.json, obj)


def _check_output_folders(args) -> None:
    """--json FILE and --plot FILE need an existing folder: said before any work, not after it."""
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if isinstance(path, (str, Path)) and str(path) != "-" and not Path(path).parent.is_dir():
            raise HiltError(f"--{flag} {path}: folder {Path(path).parent} does not exist")


def _write_outputs(args, result, plot=None) -> None:
    """--json and, where the command has one, --plot FILE drawn by ``plot(result, path)``."""
    _write_json(args, result)
    if plot is not None and args.plot:
        try:
            plot(result, args.plot)
        except OSError as e:
            raise HiltError(f"--plot {args.plot}: cannot write ({e.strerror or e})") from None
        LOG.info(f"wrote {args.plot}")


def _resolve_bits(args, default: int) -> int:
    """--bits may be left out: --method binary is 1 bit, the others take ``default``."""
    if args.method == "binary":
        if args.bits not in (None, 1):
            raise UsageError(f"--method binary is 1 bit, but --bits {args.bits} was given (leave --bits out)")
        return 1
    return default if args.bits is None else args.bits


# ------------------------------------------------------------------ quantize


def cmd_quantize(args) -> int:
    import torch

    from hilt.quant import QuantConfig, open_source, quantize_checkpoint
    from hilt.quant.checkpoint import PROGRESS, check_unquantized, embedding_config, embedding_tables, select_targets
    from hilt.quant.quantize import check_quantizable, expected_bits_per_weight

    if args.asymmetric and args.method not in ("int", "int-asym"):
        raise UsageError(f"--asymmetric applies to --method int only, not --method {args.method}")
    if args.solver is not None and args.method != "kmeans":
        raise UsageError(f"--solver applies to --method kmeans only, not --method {args.method}")
    method = "int-asym" if args.asymmetric else args.method
    config = QuantConfig(method=method, bits=_resolve_bits(args, 4), block_size=args.block_size,
                         codebook=args.codebook, solver=args.solver or "optimal", seed=args.seed)
    plan = _budget_plan(args)
    compensate, compensators = _compensation(args, config)
    with open_source(args.src) as source:
        check_unquantized(source)
        targets = select_targets(source, args.only, args.ignore)
        tables = {}
        if args.embeddings is not None:
            tables = {n: embedding_config(args.embeddings, source.shape(n)) for n in embedding_tables(source, args.ignore)}
        targets += [n for n in tables if n not in targets]
        source_bytes = source.nbytes()
        if args.dry_run:
            rows = []
            for name in targets:
                cfg = tables.get(name) or (plan["formats"][name] if plan else config)
                check_quantizable(name, source.shape(name), cfg)
                rows.append({"name": name, "shape": list(source.shape(name)),
                             "bits_per_weight": round(expected_bits_per_weight(source.shape(name), cfg), 4)})
                chosen = plan and next((r for r in plan["rows"] if r["name"] == name), None)
                if chosen:
                    rows[-1].update(format=chosen["format"], predicted=chosen["predicted"])
            kept = len(source.names()) - len(targets)
    if args.dry_run:
        for r in rows:
            fmt = f"  {r['format']:<11} predicted {r['predicted']:.3g}" if "format" in r else ""
            print(f"would quantize {r['name']:<48} {str(tuple(r['shape'])):>14}  {r['bits_per_weight']:.3f} "
                  f"bits/weight{fmt}")
        if plan:
            print(_plan_line(plan["mixed"]))
        print(f"{len(rows)} tensors to quantize, {kept} kept as they are; nothing written (--dry-run)")
        _write_json(args, {"dry_run": True, "tensors": rows, **({"mixed": plan["mixed"]} if plan else {})})
        return 0

    done_before = 0
    if args.resume:  # what the interrupted run quantized counts toward [i/N]
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            state = json.loads((Path(str(args.dst) + ".partial") / PROGRESS).read_text())
            done_before = sum(e["kind"] == "quantized" for e in state["tensors"].values())
    records = []
    progress = Progress(len(targets), "quantize", "tensor", initial=done_before, echo=True)

    def on_tensor(entry):
        if entry["kind"] == "quantized":
            records.append({"name": entry["name"], "bits_per_weight": entry["bits_per_weight"],
                            "rel_error": entry["rel_error"], "shape": entry["shape"]})
            detail = f"{entry['bits_per_weight']:.3f} bits/weight, rel. error {entry['rel_error']:.4f}"
            if "output_rel_error" in entry:  # compensated: the error that counts is the layer output's
                detail += (f", output error {entry['output_rel_error']:.4f} "
                           f"(rounding alone {entry['output_rel_error_rounded']:.4f})")
            progress.done(entry["name"], detail)

    with progress:
        header = quantize_checkpoint(args.src, args.dst, config, only=args.only, ignore=args.ignore,
                                     overwrite=args.overwrite, resume=args.resume, importance=args.importance,
                                     shard_bytes=int(args.shard_size * (1 << 20)), compensate=compensate,
                                     formats=plan and plan["formats"], mixed=plan and plan["mixed"],
                                     embeddings=args.embeddings,
                                     dense_dtype=args.dense_dtype and getattr(torch, args.dense_dtype),
                                     on_tensor=on_tensor)
    totals = header["totals"]
    size = sum((Path(args.dst) / s).stat().st_size for s in header["shards"])
    what = "mixed formats under the budget" if plan else f"{config.method}, {config.bits} bits, block {config.block_size}"
    print(f"wrote {args.dst}: {totals['quantized_tensors']} of {totals['tensors']} tensors quantized "
          f"({what}), {totals['bits_per_weight']:.3f} bits/weight on quantized tensors, "
          f"mean rel. error {totals['rel_error_mean']:.4f}; {source_bytes / 1e6:.1f} MB -> {size / 1e6:.1f} MB")
    if plan:
        print(_plan_line(plan["mixed"]))
    if args.json:
        # resumed runs report tensors quantized earlier from the header
        done = {r["name"] for r in records}
        for name, e in header["tensors"].items():
            if e["kind"] == "quantized" and name not in done:
                records.append({"name": name, "bits_per_weight": e["bits_per_weight"],
                                "rel_error": e["rel_error"], "shape": e["shape"]})
        result = {"dst": str(args.dst), "config": header["config"], "tensors": records,
                  "totals": {**totals, "bytes": size}}
        if compensators:
            result["compensation"] = {**header["compensation"],
                                      "seconds": {k: round(v, 2) for k, v in compensators[0].seconds.items()}}
        _write_json(args, result)
    return 0


def _budget_plan(args) -> dict | None:
    """--budget: a format per tensor from the TPV sensitivity (None without --budget); the flags that
    set one uniform format, and those that only make sense with --budget, are refused."""
    if args.budget is None:
        for flag, value in (("--sensitivity", args.sensitivity), ("--candidates", args.candidates),
                            ("--estimate", args.estimate)):
            if value is not None:
                raise UsageError(f"{flag} applies with --budget only")
        return None
    for flag, given in (("--bits", args.bits is not None), ("--method", args.method != "kmeans"),
                        ("--asymmetric", args.asymmetric), ("--codebook", args.codebook != "layer"),
                        ("--importance", args.importance is not None), ("--compensate", args.compensate)):
        if given:
            raise UsageError(f"{flag} does not go with --budget: the formats come from --candidates "
                             "(default kmeans1-4,int2-8 at --block-size)")
    if args.resume:
        raise UsageError("--resume does not go with --budget; rerun the whole command")
    from hilt.tasks.sensitivity import budget_plan

    return budget_plan(args.src, args.budget, sensitivity=args.sensitivity, candidates=args.candidates,
                       block_size=args.block_size, only=args.only, ignore=args.ignore,
                       estimate=args.estimate or "blocks", progress=True, log=LOG.info)


def _plan_line(mixed: dict) -> str:
    return (f"budget {mixed['budget']} bits/weight: {mixed['bits_per_weight']:.4f} used, predicted output change "
            f"{mixed['predicted_tpv']:.4g} (no allocation within the budget is below {mixed['lower_bound']:.4g})")


def _compensation(args, config):
    """The Compensator factory for --compensate (None without it) and the list it puts the one it
    makes in; the compensation flags are refused without --compensate."""
    # the defaults live in hilt/tasks/compensate.py and CompensationConfig; None here means "not given"
    given = {"--calibration": args.calibration, "--calibration-tokens": args.calibration_tokens,
             "--calibration-sentences": args.calibration_sentences, "--act-order": args.act_order or None,
             "--block-scales": args.block_scales}
    given = [flag for flag, value in given.items() if value is not None]
    if not args.compensate:
        if given:
            raise UsageError(f"{given[0]} applies with --compensate only")
        return None, []
    from hilt.tasks.compensate import compensator, model_kind
    from hilt.quant.compensate import CompensationConfig, check_compensable

    check_compensable(config)
    model_kind(args.src)  # an unsupported model fails before anything is read
    comp = CompensationConfig(act_order=args.act_order, **({"scales": args.block_scales} if args.block_scales else {}))
    options = {k: v for k, v in (("calibration", args.calibration), ("tokens", args.calibration_tokens),
                                 ("sentences", args.calibration_sentences)) if v is not None}
    made = []

    def make(targets):
        LOG.info(f"compensating {len(targets)} tensors block by block: each block's calibration inputs pass "
                 "through it first (the first tensor of a block carries the block's time)")
        made.append(compensator(args.src, config, comp, targets, **options))
        return made[-1]
    return make, made


# ------------------------------------------------------------------- inspect


def cmd_inspect(args) -> int:
    from hilt.quant import read_header

    from hilt.quant.checkpoint import open_shard

    h = read_header(args.dst)
    dst = Path(args.dst)
    for shard in h["shards"]:  # opening checks each shard's length against its header
        with open_shard(dst / shard):
            pass
    size = sum((dst / s).stat().st_size for s in h["shards"])
    c = h["config"]
    t = h["totals"]
    writer = f"hilt {h['tool_version']}" if h["tool_version"] else "transformers' save_pretrained"
    print(f"{dst}: {h['format']} v{h['format_version']} (written by {writer})")
    print(f"source      {h['source']['path']} ({h['source']['format']})")
    if "mixed" in h:  # a format per tensor, chosen under a bits budget
        counts: dict[str, int] = {}
        for e in h["tensors"].values():
            if e["kind"] == "quantized":
                key = f"{e['method']}{e['bits']}@{e['block_size']}"
                counts[key] = counts.get(key, 0) + 1
        print(f"method      mixed per tensor (budget {h['mixed'].get('budget')} bits/weight): "
              + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    else:
        print(f"method      {c['method']}, {c['bits']} bits, block {c['block_size']}, codebook per {c['codebook']}")
    print(f"tensors     {t['tensors']} ({t['quantized_tensors']} quantized, {t['quantized_weights']:,} weights)")
    print(f"bits/weight {t['bits_per_weight']:.4f} on quantized tensors (codes + scales + codebooks)")
    if h.get("embeddings"):
        print(f"embeddings  int, {h['embeddings']} bits, one scale per row")
    print(f"size        {size / 1e6:.2f} MB in {len(h['shards'])} shard(s)")
    if (dst / "config.json").is_file():
        print("loads with  transformers' AutoModel*.from_pretrained (after `import hilt`)")
    if args.tensors:
        for name, e in h["tensors"].items():
            if e["kind"] == "quantized":
                print(f"  {name:<48} {str(tuple(e['shape'])):>14} {e['bits_per_weight']:7.3f} b/w  err {e['rel_error']:.4f}")
            else:
                print(f"  {name:<48} {str(tuple(e['shape'])):>14} {e['dtype']} (kept)")
    _write_json(args, {**h, "bytes": size})
    return 0


# ---------------------------------------------------------------------- eval


def cmd_eval_ppl(args) -> int:
    from hilt.tasks import evaluate

    result = evaluate.perplexity_run(args.model, quantized=args.quantized, text=args.text, tokens=args.tokens,
                                     context=args.context, progress=True)
    label = result["quantized"] or f"{args.model}'s weights as stored"
    print(f"perplexity {result['perplexity']:.3f} over {result['tokens']} tokens "
          f"(context {result['context']}) of {result['text']} — {label}")
    _write_json(args, result)
    return 0


def cmd_eval_embed(args) -> int:
    from hilt.tasks import evaluate

    result = evaluate.embedding_run(args.model, quantized=args.quantized, sentences=args.sentences)
    label = args.quantized or f"{args.model}'s weights as stored"
    print(f"mean cosine similarity to fp32 embeddings {result['cosine_similarity']:.5f} "
          f"(min {result['cosine_similarity_min']:.5f}) over {result['sentences']} sentences — {label}")
    _write_json(args, result)
    return 0


# ------------------------------------------------------------------- others


def cmd_report(args) -> int:
    from hilt.bench import report

    summary = report.run(out=args.out, quick=not args.full, log=LOG.info, progress=True)
    _write_json(args, summary)
    return 0


def cmd_convert(args) -> int:
    import torch

    from hilt.models.hf import gguf_to_hf

    dst = gguf_to_hf(args.src, args.dst, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in dst.iterdir() if f.is_file())
    print(f"wrote {dst}: a Hugging Face model folder ({args.dtype}), {size / 1e6:.1f} MB")
    _write_json(args, {"src": str(args.src), "dst": str(dst), "dtype": args.dtype, "bytes": size})
    return 0


def cmd_calibrate(args) -> int:
    from hilt.tasks.calibrate import calibrate

    r = calibrate(args.model, args.out, work=args.work, tokens=args.tokens, sentences=args.sentences,
                  overwrite=args.overwrite)
    print(f"wrote {r['out']}: input importance of {r['layers']} linear layers from {r['calibration']}")
    _write_json(args, r)
    return 0


def cmd_sensitivity(args) -> int:
    from hilt.tasks import sensitivity

    cim = None
    if args.preset is None:
        for flag, value in (("--time", args.time), ("--chips", args.chips), ("--gdc", args.gdc)):
            if value is not None:
                raise UsageError(f"{flag} applies with --preset only")
    else:
        cim = {"preset_name": args.preset, "time_text": args.time or "1y", "chips": args.chips or 8,
               "gdc": args.gdc or "global"}
    r = sensitivity.sensitivity_run(args.model, checkpoint=args.checkpoint, candidates=args.candidates,
                                    block_size=args.block_size, probes=args.probes, calibration=args.calibration,
                                    tokens=args.tokens, sentences=args.sentences, images=args.images, seed=args.seed,
                                    progress=True, full=args.estimate == "full", cim=cim)
    key = "tpv_full" if args.estimate == "full" else "tpv"
    shown = r["candidates"][:4]
    print(f"{len(r['layers'])} layers of {r['model']}, {r['samples']} probe samples on {r['calibration']}; "
          f"TPV predicts the {r['predicts']}")
    print(f"{'layer':<46} {'Tr(H_eff)':>16}  " + "  ".join(f"{c:>11}" for c in shown))
    for row in r["layers"]:
        print(f"{row['name']:<46} {row['trace']:9.3g} ±{row['trace_se']:<6.2g} "
              + "  ".join(f"{row[key].get(c, float('nan')):11.3g}" for c in shown))
    _write_outputs(args, r, sensitivity.plot)
    return 0


def cmd_train(args) -> int:
    from hilt.tasks.train import train_run
    from hilt.cim_sim.training import NoisyTraining

    defaults = NoisyTraining()
    eta_min, eta_max = args.eta_range or (defaults.eta_min, defaults.eta_max)
    training = NoisyTraining(method=args.method, noise_model=args.noise_model,
                             eta=defaults.eta if args.eta is None else args.eta,
                             eta_min=eta_min, eta_max=eta_max,
                             copies=defaults.copies if args.copies is None else args.copies,
                             weighting=args.weighting)
    r = train_run(args.workload, training=training, epochs=args.epochs, seed=args.seed, out=args.out,
                  progress=True, overwrite=args.overwrite)
    print(f"{args.workload} ({args.method}): test accuracy {r['test_accuracy']:.4f} after {r['epochs']} epochs, "
          f"{r['train_seconds']:.0f} s" + (f"; wrote {args.out}" if args.out else ""))
    _write_json(args, r)
    return 0


def cmd_drift(args) -> int:
    from hilt.tasks import drift

    result = drift.drift_study(args.model, args.checkpoint, args.preset, args.times, args.repeats, args.gdc,
                               args.test_images, progress=True, log=LOG.info, data=args.data)
    _write_outputs(args, result, drift.plot_drift)
    return 0


def cmd_sweep(args) -> int:
    import os

    from hilt.tasks import sweep

    if args.resume and args.overwrite:
        raise UsageError("--resume continues DIR/results.jsonl and --overwrite replaces it: give one")
    use_ray = bool(os.environ.get("RAY_ADDRESS")) if args.ray is None else args.ray
    if args.workers is not None and not use_ray:
        raise UsageError("--workers sets how many Ray tasks run at once: give --ray too (or set RAY_ADDRESS)")
    result = sweep.run_sweep(args.grid, args.out, resume=args.resume, overwrite=args.overwrite, use_ray=use_ray,
                             workers=args.workers, plots=args.plots, progress=True, log=LOG.info)
    _write_json(args, result)
    return 0


def cmd_energy(args) -> int:
    from hilt.tasks import energy

    if args.sweep and args.adc_bits is not None:
        raise UsageError("--sweep: it picks the ADC resolution itself; leave --adc-bits out, or drop --sweep")
    result = energy.run(args.workload, args.checkpoint, args.chip, args.adc_bits, args.dac_bits, args.gpu_batch,
                        sweep=args.sweep, log=LOG.info)
    _write_outputs(args, result, energy.plot)
    return 0


def cmd_certify(args) -> int:
    from hilt.bench.studies import certify

    if args.method is None and (args.bits is not None or args.worst_case):
        raise UsageError("--bits and --worst-case describe a quantization format: give --method too")
    if args.chip is None and args.time is not None:
        raise UsageError("--time is the age of a chip: give --chip too")
    if args.method is not None and args.chip is not None:
        raise UsageError("give a quantization format (--method) or a CIM chip (--chip), not both")
    if not 0 < args.delta < 1:
        raise UsageError(f"--delta must be between 0 and 1, got {args.delta}")
    bits = _resolve_bits(args, 4) if args.method is not None else None
    result, cert = certify.certify_run(args.workload, args.checkpoint, args.method, bits, args.block_size,
                                       args.worst_case, args.chip, args.time or "1y", args.delta, args.gdc,
                                       args.test_images, progress=True)
    print(certify.render_run(result))
    _write_json(args, result)
    if args.plot:
        certify.plot_run(result, cert, args.plot)
        LOG.info(f"wrote {args.plot}")
    return 0


def cmd_bench_certify(args) -> int:
    from hilt.bench.studies import certify

    result = certify.study(quick=args.quick, log=LOG.info, progress=True, seed=args.seed)
    _write_outputs(args, result, certify.plot)
    if args.markdown:
        Path(args.markdown).write_text(certify.render(result))
        LOG.info(f"wrote {args.markdown}")
    if any(result["sound_violations"].values()):
        raise HiltError(f"an input certified by an exact or Lipschitz certificate flipped under an allowed "
                        f"perturbation: {result['sound_violations']} (the results are written)")
    return 0


def cmd_export_onnx(args) -> int:
    from hilt.tasks import export

    src = Path(args.src)
    if not src.exists():
        raise HiltError(f"{src}: no such file or folder")
    if src.is_dir():  # a quantized folder: hilt's own, or as transformers' save_pretrained wrote it again
        if args.cim_preset:
            raise HiltError(f"{src} is a quantized checkpoint; --cim-preset applies to workload checkpoints")
        result = export.export_quantized(src, args.out, overwrite=args.overwrite, packed_ops=not args.standard_ops,
                                         log=LOG.info)
    elif src.suffix == ".safetensors" and src.is_file():
        from hilt.tasks.train import load_workload

        if args.standard_ops:
            raise HiltError(f"{src} is a workload checkpoint; --standard-ops applies to quantized checkpoints")
        _, meta = load_workload(src)
        result = export.export_cim(meta["workload"], src, args.out, args.cim_preset or "pcm", args.time,
                                   seed=args.seed, gdc=args.gdc, overwrite=args.overwrite, log=LOG.info)
    else:
        raise HiltError(f"{src}: expected a hilt quantized checkpoint folder (from `hilt quantize`) or a workload "
                        f"checkpoint .safetensors (from `hilt train`)")
    _write_json(args, result)
    return 0


def cmd_export_gguf(args) -> int:
    from hilt.quant.gguf_export import export_gguf

    r = export_gguf(args.src, args.out, overwrite=args.overwrite)
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(r["types"].items()))
    print(f"wrote {r['out']}: {r['tensors']} tensors ({kinds}), {r['bytes'] / 1e6:.1f} MB; metadata and tokenizer "
          f"from {r['source']}")
    _write_json(args, r)
    return 0


def cmd_fp8_scales(args) -> int:
    from hilt.bench.studies import fp8_scales

    _write_json(args, fp8_scales.run(args.model, log=LOG.info))
    return 0


def cmd_fp8_transient(args) -> int:
    from hilt.bench.studies import fp8_transient

    result = fp8_transient.study(quick=args.quick, seed=args.seed, log=LOG.info)
    _write_outputs(args, result, fp8_transient.plot)
    return 0


def cmd_fp8_attention(args) -> int:
    from hilt.bench.studies import fp8_accuracy

    _write_json(args, fp8_accuracy.run(tokens=args.tokens, log=LOG.info))
    return 0


def cmd_bench_attention(args) -> int:
    from hilt.bench.perf import attention_speed

    result = attention_speed.run()
    _write_json(args, result)
    if result["mismatches"]:  # saved above with the timings of the other configurations
        bad = ", ".join(f"T={m['seq']}{' causal' if m['causal'] else ''} (cosine {m['cosine_vs_bf16']:.4f})"
                        for m in result["mismatches"])
        raise HiltError(f"FP8 attention differs from bf16 SDPA (cosine < {attention_speed.MIN_COSINE}) at {bad}")
    return 0


def cmd_bench_cim(args) -> int:
    from hilt.bench.perf import cim_speed

    _write_json(args, cim_speed.speed(log=LOG.info))
    return 0


def cmd_bench_sweep(args) -> int:
    from hilt.bench.studies import cim_peers

    result = cim_peers.sweep(quick=args.quick, workloads=args.workload and [args.workload], log=LOG.info)
    _write_outputs(args, result, cim_peers.plot)
    return 0


def cmd_bench_sweep_ray(args) -> int:
    from hilt.bench.perf import sweep_scaling

    result = sweep_scaling.run(quick=args.quick, log=LOG.info)
    _write_json(args, result)
    if not result["identical_files"]:  # saved above with the timings
        raise HiltError("the sweep's result files differ between the local and the Ray runs")
    return 0


def cmd_bench_startup(args) -> int:
    from hilt.bench.perf import startup

    _write_json(args, startup.run(repeats=args.repeats, log=LOG.info))
    return 0


def cmd_bench_robustness(args) -> int:
    from hilt.bench.studies import robustness

    result = robustness.study(quick=args.quick, log=LOG.info)
    _write_outputs(args, result, robustness.plot)
    if args.markdown:
        Path(args.markdown).write_text(robustness.render(result))
        LOG.info(f"wrote {args.markdown}")
    return 0


def cmd_qat(args) -> int:
    from hilt.tasks import qat_finetune

    if args.model != "smollm2":
        raise HiltError(f"QAT fine-tuning knows the packaged 'smollm2', not {args.model!r}")
    result = qat_finetune.finetune(args.dst, args.method, _resolve_bits(args, 2), args.block_size, args.steps,
                                   args.lr, args.batch, args.context, args.refit_every, args.save_every, args.seed,
                                   args.resume, args.overwrite, args.only, learn_codebook=args.learn_codebook,
                                   log=LOG.info, progress=True)
    _write_json(args, result)
    return 0


def cmd_bench_qat(args) -> int:
    from hilt.bench.studies import qat_scaling

    result = qat_scaling.study(quick=args.quick, seeds=args.seeds, lr=args.lr, learn_codebook=args.learn_codebook,
                               log=LOG.info)
    _write_outputs(args, result, qat_scaling.plot)
    return 0


def cmd_bench_ptq(args) -> int:
    from hilt.bench.studies import ptq

    _write_json(args, ptq.run(out=args.out, quick=args.quick, models=args.models, widths=args.bits, log=LOG.info))
    return 0


def cmd_bench_sensitivity(args) -> int:
    from hilt.bench.studies import sensitivity

    models = args.models or (["minilm", "cnn", "cim"] if args.quick else ["minilm", "cnn", "smollm2", "cim"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = sensitivity.run(out=out / "sensitivity_validation.json", quick=args.quick, models=models, log=LOG.info)
    if "cim" in r:
        c = r["cim"]
        print(f"cnn on {c['label']}: Spearman {c['spearman_kl']:.3f} (KL), {c['spearman_accuracy_drop']:.3f} "
              f"(accuracy drop) over {len(c['rows'])} layers each alone on {c['chips']} chips")
        for key, k in c["keep_digital"].items():
            last = k["curve"][-1]
            print(f"  keep digital {', '.join(k['digital']) or 'nothing':<14} ({key}): accuracy at {last['time']} "
                  f"{last['accuracy_mean']:.4f} ± {last['accuracy_std']:.4f}")
    for name, m in r["models"].items():
        for label, f in m["formats"].items():
            print(f"{name:<8} {label:<11} Spearman {f['spearman']:.3f} (blocks {f['spearman_blocks']:.3f}) over "
                  f"{f['layers']} layers; whole model predicted {f['whole_model_predicted']:.4g}, "
                  f"measured {f['whole_model_measured']:.4g}")
    _write_json(args, r)
    return 0


def cmd_bench_mixed(args) -> int:
    from hilt.bench.studies import mixed

    models = args.models or (["minilm"] if args.quick else ["minilm", "smollm2"])
    budgets = args.budgets or ([3.0] if args.quick else list(mixed.BUDGETS))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = mixed.run(out=out / "mixed.json", quick=args.quick, models=models, budgets=budgets, log=LOG.info)
    print(r["table"])
    _write_json(args, r)
    return 0


def cmd_bench_decode(args) -> int:
    from hilt.bench.perf import decode_speed

    r = decode_speed.run(quick=args.quick, work=args.work, threads=args.threads, log=LOG.info)
    print(r["table"])
    if args.out:
        from hilt.quant.checkpoint import write_json

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "decode.json", r)
        (out / "decode.md").write_text(r["table"] + "\n")
    _write_json(args, r)
    return 0


def cmd_bench_quantize(args) -> int:
    from hilt.bench.perf import quantize_speed

    _write_json(args, quantize_speed.run(quick=args.quick, log=LOG.info))
    return 0


def cmd_bench_kernels(args) -> int:
    import tempfile

    from hilt.bench.perf import lut_kernels

    flags = (("--check", args.check), ("--timings", args.timings), ("--all", args.all), ("--decode", args.decode),
             ("--quick", args.quick), ("--cuda-graphs", args.cuda_graphs), ("--sass", args.sass))
    argv = [flag for flag, on in flags if on]
    for option, value in (("--smollm2", args.smollm2), ("--plot", args.plot), ("--table", args.table)):
        argv += [option, value] if value else []
    if args.json != "-":
        return lut_kernels.main(argv + (["--json", args.json] if args.json else []))
    with tempfile.TemporaryDirectory() as tmp:  # it writes a file as it goes: pass it on whole at the end
        path = Path(tmp) / "kernels.json"
        try:
            return lut_kernels.main(argv + ["--json", str(path)])
        finally:
            if path.exists():
                args.stdout.write(path.read_text())
                args.stdout.flush()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hilt", description="hilt: low-precision inference, from checkpoint to hardware.",
                parents=[_COMMON])
    p.add_argument("--version", action=_Version, help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = _command(sub, "quantize", "quantize a checkpoint (safetensors file or folder, GGUF)",
                 "hilt quantize model.safetensors out-2bit --method kmeans --bits 2", [_OUTPUT, _SEED])
    q.add_argument("src", help="safetensors file, Hugging Face-style folder, or GGUF file")
    q.add_argument("dst", help="output folder: safetensors shards + hilt.json; from a Hugging Face folder also its "
                               "config (with a quantization_config transformers loads) and tokenizer")
    q.add_argument("--method", choices=QUANT_METHODS, default="kmeans",
                   help="kmeans codebook (default), integer grid (int, int-asym: min/max with an offset), "
                        "or sign x absmean (binary, 1 bit)")
    q.add_argument("--bits", type=_int(1, 8), help="bits per code, 1-8 (default 4; binary: 1)")
    q.add_argument("--block-size", type=_POSITIVE, default=64, help="weights per scale along the input dim (default 64)")
    q.add_argument("--codebook", choices=["layer", "block"], default="layer", help="kmeans: one codebook per layer or per block")
    q.add_argument("--solver", choices=["optimal", "lloyd"],
                   help="kmeans: certified-optimal DP (default) or k-means++ + Lloyd (seeded by --seed)")
    q.add_argument("--asymmetric", action="store_true", help="int: min/max grid with a per-block offset (= int-asym)")
    q.add_argument("--importance", metavar="FILE",
                   help="kmeans: per-column importance from `hilt calibrate` (weights the k-means error)")
    q.add_argument("--compensate", action="store_true",
                   help="GPTQ-style error compensation through each layer's calibration inputs (Llama GGUF or "
                        "BERT folder); layer by layer, one block in memory")
    q.add_argument("--calibration", metavar="TEXT",
                   help="with --compensate: a text file (BERT: one sentence per line), or 'default' (Macbeth; "
                        "the evaluations use Hamlet)")
    q.add_argument("--calibration-tokens", type=_POSITIVE, metavar="N",
                   help="with --compensate on a Llama: calibration tokens, in windows of 512 (default 4096)")
    q.add_argument("--calibration-sentences", type=_POSITIVE, metavar="N",
                   help="with --compensate on BERT: calibration sentences (default 256)")
    q.add_argument("--act-order", action="store_true",
                   help="with --compensate: round columns in order of decreasing input energy")
    q.add_argument("--block-scales", choices=["before", "during"],
                   help="with --compensate: block scales from the original weights (before) or from the "
                        "compensated ones as the sweep reaches each block (during, default)")
    q.add_argument("--budget", type=_number(positive=True), metavar="BITS",
                   help="mixed precision: a format per tensor with at most BITS bits/weight on average (codes, "
                        "scales and codebooks counted), the summed predicted TPV as small as it can be")
    q.add_argument("--sensitivity", metavar="FILE",
                   help="with --budget: a `hilt sensitivity --json` file of this model (default: measure it "
                        "now on the default calibration data)")
    q.add_argument("--candidates", metavar="LIST",
                   help="with --budget: the formats to choose from, e.g. kmeans2-4,int8@128 (default "
                        "kmeans1-4,int2-8 at --block-size)")
    q.add_argument("--estimate", choices=["full", "blocks"],
                   help="with --budget: the block-diagonal TPV (blocks, default: the better allocation in 5 of 8 "
                        "cases of `hilt bench mixed`) or eᵀ H e with each format's error itself (full)")
    q.add_argument("--only", metavar="RE", help="quantize only 2-D tensors whose name matches RE")
    q.add_argument("--ignore", metavar="RE", help="keep tensors whose name matches RE unquantized")
    q.add_argument("--dry-run", action="store_true", help="list what would be quantized; write nothing")
    q.add_argument("--resume", action="store_true", help="continue an interrupted run (DST.partial)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing DST (only once the new one is complete)")
    q.add_argument("--embeddings", type=_int(2, 8), metavar="BITS",
                   help="also quantize embedding tables and output heads (tied ones once): symmetric integers, one "
                        "scale per row (8 is the usual choice)")
    q.add_argument("--dense-dtype", choices=DENSE_DTYPES,
                   help="dtype of every floating tensor left unquantized (default: as stored; GGUF block types bfloat16)")
    q.add_argument("--shard-size", type=_POSITIVE_NUMBER, default=256, metavar="MB",
                   help="output shard size (default 256 MB; memory holds one shard)")
    q.set_defaults(func=cmd_quantize)

    cv = _command(sub, "convert", "a GGUF model as a Hugging Face model folder (config, weights, tokenizer) that "
                  "transformers and `hilt quantize` read; needs hilt[hf]", "hilt convert model.gguf model-hf", [_OUTPUT])
    cv.add_argument("src", help="GGUF file (an architecture transformers reads from GGUF, e.g. llama)")
    cv.add_argument("dst", help="output folder")
    cv.add_argument("--dtype", choices=DENSE_DTYPES, default="bfloat16",
                    help="dtype of the weights (default bfloat16; GGUF block types are dequantized to it)")
    cv.add_argument("--overwrite", action="store_true")
    cv.set_defaults(func=cmd_convert)

    i = _command(sub, "inspect", "show what is in a quantized checkpoint", "hilt inspect out-2bit --tensors", [_OUTPUT])
    i.add_argument("dst")
    i.add_argument("--tensors", action="store_true", help="one line per tensor")
    i.set_defaults(func=cmd_inspect)

    c = _command(sub, "calibrate", "per-column input importance of every linear layer, from real text",
                 "hilt calibrate smollm2 --out smollm2-importance.safetensors", [_OUTPUT])
    c.add_argument("model", nargs="?", default="smollm2", help="'smollm2', 'minilm', a GGUF path or a MiniLM folder")
    c.add_argument("--out", required=True, metavar="FILE", help="safetensors file to write")
    c.add_argument("--work", default="macbeth", help="Shakespeare work to calibrate on (default macbeth)")
    c.add_argument("--tokens", type=_POSITIVE, default=2048, help="tokens for a causal LM (default 2048)")
    c.add_argument("--sentences", type=_POSITIVE, default=256, help="sentences for an encoder (default 256)")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    se = _command(sub, "sensitivity", "per-layer TPV sensitivity: which layers a quantization format hurts, "
                  "predicted from calibration data without evaluating anything",
                  "hilt sensitivity minilm --json minilm-tpv.json --plot minilm-tpv.png", [_OUTPUT, _PLOT, _SEED],
                  plot="Tr(H_eff) per layer with its standard error, and the predicted change of a few formats")
    se.add_argument("model", nargs="?", default="smollm2",
                    help="smollm2, minilm, mlp, cnn, a Llama GGUF file or a BERT folder (default smollm2)")
    se.add_argument("--checkpoint", metavar="FILE", help="mlp/cnn: the workload checkpoint (default the trained one)")
    se.add_argument("--candidates", metavar="LIST",
                    help="formats METHOD BITS[@BLOCK], ranges allowed: default kmeans1-4,int2-8 (mlp/cnn: @row)")
    se.add_argument("--block-size", type=_POSITIVE, default=64, help="block size of a candidate without @ (default 64)")
    se.add_argument("--probes", type=_POSITIVE, default=2, help="probe backward passes per calibration batch (default 2)")
    se.add_argument("--estimate", choices=["full", "blocks"], default="full",
                    help="also compute eᵀ H_eff e with each format's error itself (full, default), or only the "
                         "block-diagonal TPV (blocks: less memory)")
    se.add_argument("--calibration", metavar="TEXT", help="a text file instead of Macbeth (BERT: one sentence per line)")
    se.add_argument("--tokens", type=_POSITIVE, default=2048, help="causal LM: calibration tokens (default 2048)")
    se.add_argument("--sentences", type=_POSITIVE, default=256, help="encoder: calibration sentences (default 256)")
    se.add_argument("--images", type=_POSITIVE, default=2048, help="mlp/cnn: training images (default 2048)")
    se.add_argument("--preset", choices=CIM_PRESETS,
                    help="mlp/cnn: instead of quantization formats, this CIM chip preset's errors (of the weights, "
                         "and of each whole analog layer at its output)")
    se.add_argument("--time", help="with --preset: time after programming (default 1y)")
    se.add_argument("--chips", type=_int(2), help="with --preset: chips drawn for the error statistics (default 8)")
    se.add_argument("--gdc", choices=DRIFT_COMPENSATION, help="with --preset: drift compensation (default global)")
    se.set_defaults(func=cmd_sensitivity)

    t = _command(sub, "train", "train a Fashion-MNIST workload (MLP or CNN) and save a safetensors checkpoint",
                 "hilt train --workload cnn --out cnn.safetensors", [_OUTPUT, _SEED])
    t.add_argument("--workload", required=True, choices=WORKLOADS)
    t.add_argument("--method", default="standard", choices=TRAINING_METHODS,
                   help="standard, noise (noise injection at --eta) or dwp (--copies noisy copies over --eta-range, "
                        "samples weighted by their disagreement)")
    t.add_argument("--noise-model", default="mismatch", choices=NOISE_MODELS, help="the noise trained under")
    t.add_argument("--eta", type=_number(), help="noise: the mismatch level (default 0.3)")
    t.add_argument("--eta-range", type=_float_pair, metavar="MIN,MAX", help="dwp: the copies' levels (default 0.1,0.6)")
    t.add_argument("--copies", type=_POSITIVE, help="dwp: noisy copies per step (default 4)")
    t.add_argument("--weighting", default="js", choices=WEIGHTINGS, help="dwp: disagreement measure (default js)")
    t.add_argument("--epochs", type=_POSITIVE, help="epochs (default: the workload's)")
    t.add_argument("--out", metavar="FILE", help="checkpoint to write (.safetensors)")
    t.add_argument("--overwrite", action="store_true")
    t.set_defaults(func=cmd_train)

    e = _command(sub, "energy", "energy per inference on a CIM chip against a GPU, per layer",
                 "hilt energy --workload cnn --sweep --plot energy.png", [_OUTPUT, _PLOT],
                 plot="energy per inference per layer, CIM against GPU, and where the CIM energy goes")
    e.add_argument("--workload", required=True, choices=WORKLOADS)
    e.add_argument("--checkpoint", metavar="FILE", help="default: hilt/models/trained/WORKLOAD-standard.safetensors")
    e.add_argument("--chip", default="rram-22nm", choices=ENERGY_CHIPS,
                   help="the CIM chip's energy constants (default rram-22nm)")
    e.add_argument("--preset", action=_Renamed, new="--chip", why=" (--preset names a CIM device preset)")
    e.add_argument("--adc-bits", type=_POSITIVE,
                   help="ADC resolution (default 9, or the lowest that keeps accuracy with --sweep)")
    e.add_argument("--dac-bits", type=_POSITIVE, default=7, help="DAC resolution (default 7)")
    e.add_argument("--gpu-batch", type=_POSITIVE, default=256, help="batch over which the GPU reads its weights once")
    e.add_argument("--sweep", action="store_true",
                   help="first find the lowest ADC resolution within 1 point of the 9-bit accuracy (pcm, 1 s)")
    e.set_defaults(func=cmd_energy)

    xsub = _group(sub, "export", "export to ONNX that onnxruntime runs", "format")
    xo = _command(xsub, "onnx", "a quantized MiniLM checkpoint, or a workload on CIM hardware frozen at a time after "
                  "programming, as ONNX (checked with onnx.checker and onnxruntime)",
                  "hilt export onnx minilm-4bit minilm-4bit.onnx\n"
                  "  hilt export onnx hilt/models/trained/cnn-standard.safetensors cnn-pcm-1y.onnx --time 1y",
                  [_OUTPUT, _SEED])
    xo.add_argument("src", help="quantized checkpoint folder, or workload checkpoint .safetensors")
    xo.add_argument("out", help="the .onnx file to write")
    xo.add_argument("--cim-preset", choices=CIM_PRESETS, help="workload checkpoints: the CIM preset (default pcm)")
    xo.add_argument("--time", default="1y", help="workload checkpoints: time after programming (default 1y)")
    xo.add_argument("--gdc", default="global", choices=DRIFT_COMPENSATION, help="drift compensation (default global)")
    xo.add_argument("--standard-ops", action="store_true",
                    help="quantized checkpoints: standard operators only (any ONNX runtime): integer weights are "
                         "rebuilt by a subgraph like k-means, instead of ONNX Runtime's MatMulNBits (packed in the session)")
    xo.add_argument("--overwrite", action="store_true")
    xo.set_defaults(func=cmd_export_onnx)

    xg = _command(xsub, "gguf", "a checkpoint of integer weights (4-bit and 8-bit int, 4-bit int-asym) as a GGUF "
                  "file llama.cpp reads (Q4_0, Q8_0, Q4_1), losslessly; metadata and tokenizer from its source GGUF",
                  "hilt export gguf smol-int4 smol-int4.gguf", [_OUTPUT])
    xg.add_argument("src", help="hilt checkpoint folder quantized from a GGUF file")
    xg.add_argument("out", help="the .gguf file to write")
    xg.add_argument("--overwrite", action="store_true")
    xg.set_defaults(func=cmd_export_gguf)

    f8sub = _group(sub, "fp8", "FP8 attention: logit bounds and scales from the weights", "what")
    fs = _command(f8sub, "scales", "per layer and head: the weight-only bound on |attention logit| "
                  "(spectral norm of W_Q,h^T W_K,g) against the largest observed on real text",
                  "hilt fp8 scales minilm --json minilm-fp8.json", [_OUTPUT])
    fs.add_argument("model", help="minilm, smollm2, or a checkpoint: a llama GGUF file or a BERT directory "
                                  "(config.json, tokenizer.json, model.safetensors)")
    fs.set_defaults(func=cmd_fp8_scales)
    ft = _command(f8sub, "transient", "overflow of FP8 attention logits after a load, a resume and a learning-rate "
                  "spike, per scale recipe (fine-tuning a character GPT on Shakespeare)",
                  "hilt fp8 transient --quick --json transient.json --plot transient.png", [_OUTPUT, _PLOT, _SEED],
                  plot="logits clipped per step, one panel per scenario")
    ft.add_argument("--quick", action="store_true", help="shorter pretraining and fine-tuning (a few minutes)")
    ft.set_defaults(func=cmd_fp8_transient)
    fa = _command(f8sub, "attention", "accuracy of FP8 attention on real models: SmolLM2 perplexity and MiniLM "
                  "embeddings against float32", "hilt fp8 attention --json fp8_attention.json", [_OUTPUT])
    fa.add_argument("--tokens", type=_POSITIVE, default=4096, help="tokens of Hamlet for the perplexity (default 4096)")
    fa.set_defaults(func=cmd_fp8_attention)

    qa = _command(sub, "qat", "quantization-aware fine-tuning of SmolLM2-135M, saved in the hilt quantize format "
                  "(resumable)", "hilt qat smollm2 smollm2-2bit-qat --bits 2 --steps 60", [_OUTPUT, _SEED])
    qa.add_argument("model", help="smollm2 (the packaged model)")
    qa.add_argument("dst", help="output folder (a hilt checkpoint, as `hilt quantize` writes)")
    qa.add_argument("--method", default="kmeans", choices=QUANT_METHODS)
    qa.add_argument("--bits", type=_int(1, 8), help="bits per code, 1-8 (default 2; binary: 1)")
    qa.add_argument("--block-size", type=_POSITIVE, default=64)
    qa.add_argument("--steps", type=_POSITIVE, default=60)
    qa.add_argument("--lr", type=_POSITIVE_NUMBER, default=1e-4)
    qa.add_argument("--batch", type=_POSITIVE, default=4, help="windows per step")
    qa.add_argument("--context", type=_int(2), default=256, help="tokens per window")
    qa.add_argument("--learn-codebook", action=argparse.BooleanOptionalAction, default=True,
                    help="k-means: train the codebook levels by the loss after their fit (default), or only refit them")
    qa.add_argument("--refit-every", type=_NON_NEGATIVE, default=0,
                    help="k-means codebook refit interval in steps (default 0: never; the published procedure "
                         "with --no-learn-codebook refits every few thousand)")
    qa.add_argument("--save-every", type=_POSITIVE, default=10, help="steps between resumable training states")
    qa.add_argument("--only", metavar="REGEX", help="quantize only the Linear weights whose name matches")
    qa.add_argument("--resume", action="store_true", help="continue from DST.qat-state/")
    qa.add_argument("--overwrite", action="store_true")
    qa.set_defaults(func=cmd_qat)

    d = _command(sub, "drift", "accuracy on simulated CIM hardware over time after programming",
                 "hilt drift --model cnn --preset pcm --times 1s,1h,1d,1mo,1y --repeats 5 --plot drift.png\n  "
                 "hilt drift --model mynets:resnet8 --checkpoint resnet8.safetensors --data test.npz --repeats 10",
                 [_OUTPUT, _PLOT], plot="accuracy against log time, bands over chips")
    d.add_argument("--model", default="cnn", type=_model_spec, metavar="NAME|PKG.MODULE:FACTORY",
                   help="a built-in workload (mlp, cnn; default cnn) or a function building your nn.Module")
    d.add_argument("--workload", dest="model", type=_model_spec, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    d.add_argument("--checkpoint", metavar="FILE", help="safetensors weights: from `hilt train` for a workload "
                   "(default: hilt/models/trained/WORKLOAD-standard.safetensors), your state dict for a factory")
    d.add_argument("--data", metavar="FILE", help="a .safetensors or .npz file of `inputs` and `labels` "
                   "(default: the Fashion-MNIST test split)")
    d.add_argument("--preset", default="pcm", choices=CIM_PRESETS, help="the CIM device preset (default pcm)")
    d.add_argument("--times", default="1s,1h,1d,1mo,1y", help="comma-separated times after programming")
    d.add_argument("--repeats", type=_POSITIVE, default=5, help="programmed chips (default 5)")
    d.add_argument("--gdc", default="global", choices=DRIFT_COMPENSATION,
                   help="drift compensation compared with none (default global)")
    d.add_argument("--test-images", type=_POSITIVE, default=10_000, help="test examples per evaluation (default 10000)")
    d.set_defaults(func=cmd_drift)

    sw = _command(sub, "sweep", "CIM accuracy over a grid (models x presets x AnalogConfig fields x chips x drift "
                  "compensation x times, in a TOML file), locally or on a Ray cluster; one tidy row per cell in "
                  "DIR/results.jsonl and DIR/results.csv, plots per axis",
                  "hilt sweep hilt/tasks/grids/example.toml --out sweep/\n"
                  "  hilt sweep hilt/tasks/grids/example.toml --out sweep/ --resume        # after an interruption\n"
                  "  RAY_ADDRESS=auto hilt sweep hilt/tasks/grids/example.toml --out sweep/  # on a running Ray cluster",
                  [_OUTPUT])
    sw.add_argument("grid", metavar="GRID.toml", help="the grid (format: docs/results/cim.md, Sweeps)")
    sw.add_argument("--out", required=True, metavar="DIR", help="output folder")
    sw.add_argument("--resume", action="store_true", help="continue an interrupted sweep: keep DIR's rows, run the "
                    "cells that are missing")
    sw.add_argument("--overwrite", action="store_true", help="replace the results already in DIR")
    sw.add_argument("--ray", action=argparse.BooleanOptionalAction, default=None,
                    help="run the groups as Ray tasks (default: when RAY_ADDRESS is set; needs hilt[ray])")
    sw.add_argument("--workers", type=_POSITIVE, metavar="N", help="with --ray: N tasks at once, each with the "
                    "cluster's CPUs / N (default: one CPU per task)")
    sw.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                    help="draw DIR/accuracy_by_AXIS.png (default: yes)")
    sw.set_defaults(func=cmd_sweep)

    ce = _command(sub, "certify", "per test image, the smallest weight change that flips its prediction (exact at the "
                  "last layer, first order before it, a sound bound for all layers at once), against a quantization "
                  "format or a CIM chip at a time after programming",
                  "hilt certify cnn --method int --bits 8\n  hilt certify cnn --chip pcm --time 1y --delta 0.01",
                  [_OUTPUT, _PLOT], plot="every layer's flip norms over the test images, and the setting's bounds")
    ce.add_argument("workload", choices=WORKLOADS)
    ce.add_argument("--checkpoint", metavar="FILE", help="from `hilt train` (default: hilt/models/trained/WORKLOAD-standard.safetensors)")
    ce.add_argument("--method", choices=QUANT_METHODS, help="a quantization format: its actual error ||W - Q(W)||_F "
                    "per layer bounds the perturbation")
    ce.add_argument("--bits", type=_int(1, 8), help="bits per code with --method (default 4; binary: 1)")
    ce.add_argument("--block-size", type=_POSITIVE, default=64, help="weights per scale (default 64; a layer whose "
                    "inputs it does not divide uses the largest size below it that does)")
    ce.add_argument("--worst-case", action="store_true", help="with --method: the largest error inside the format's "
                    "rounding cells instead of the actual one")
    ce.add_argument("--chip", choices=CIM_PRESETS, help="a CIM preset: a bound on ||dW||_F at --time that holds with "
                    "probability 1 - --delta under the device model")
    ce.add_argument("--time", help="with --chip: time after programming (default 1y)")
    ce.add_argument("--delta", type=_POSITIVE_NUMBER, default=0.01, help="with --chip: the probability the bound may "
                    "fail (default 0.01)")
    ce.add_argument("--gdc", default="global", choices=DRIFT_COMPENSATION, help="with --chip: drift compensation "
                    "(default global)")
    ce.add_argument("--test-images", "--n", dest="test_images", type=_POSITIVE, default=10_000,
                    help="test images (default all 10000)")
    ce.set_defaults(func=cmd_certify)

    esub = _group(sub, "eval", "evaluate a model, quantized or not", "metric")
    pp = _command(esub, "ppl", "perplexity of a causal LM on text: SmolLM2-135M (default), a Llama GGUF, or any "
                  "Hugging Face folder (through transformers; hilt's quantized folders included)",
                  "hilt eval ppl smollm2 --quantized out-2bit --tokens 2048\n  hilt eval ppl smol-hf-4bit", [_OUTPUT])
    pp.add_argument("model", nargs="?", default="smollm2",
                    help="'smollm2' (the packaged model), a GGUF path, or a Hugging Face causal-LM folder")
    pp.add_argument("--quantized", metavar="DST", help="hilt checkpoint made from MODEL by `hilt quantize`")
    pp.add_argument("--text", metavar="FILE", help="UTF-8 text file (default: Shakespeare's Hamlet)")
    pp.add_argument("--tokens", type=_int(2), default=2048, help="tokens to score (default 2048)")
    pp.add_argument("--context", type=_POSITIVE, default=512, help="window length (default 512)")
    pp.set_defaults(func=cmd_eval_ppl)
    em = _command(esub, "embed", "cosine similarity of sentence embeddings (masked mean, normalised) of a quantized "
                  "encoder against its fp32 model: MiniLM (default) or any Hugging Face encoder folder",
                  "hilt eval embed minilm --quantized minilm-2bit", [_OUTPUT])
    em.add_argument("model", nargs="?", default="minilm",
                    help="'minilm' (the packaged model), its folder, or a Hugging Face encoder folder")
    em.add_argument("--quantized", metavar="DST")
    em.add_argument("--sentences", type=_POSITIVE, default=256, help="sentences from Hamlet to embed (default 256)")
    em.set_defaults(func=cmd_eval_embed)

    bsub = _group(sub, "bench", "benchmarks (ratios against baselines measured in the same run)", "bench")
    bq = _command(bsub, "quantize", "quantization speed vs the published k-means procedure, and peak memory",
                  "hilt bench quantize --quick --json speed.json", [_OUTPUT])
    bq.add_argument("--quick", action="store_true", help="4 reference tensors and a 1 GB memory checkpoint")
    bq.set_defaults(func=cmd_bench_quantize)

    bk = _command(bsub, "kernels", "LUT matmul kernels: correctness vs reference; GPU timings vs bf16 cuBLAS",
                  "hilt bench kernels --check", [_OUTPUT, _PLOT],
                  plot="speedup against M per layer shape and bit width (of the timings, or of --table's file)")
    bk.add_argument("--check", action="store_true", help="the correctness check (on the CPU through Triton's "
                    "interpreter); without --check, --timings or --decode: the check, then timings on a GPU")
    bk.add_argument("--timings", action="store_true", help="GPU: the timings alone")
    bk.add_argument("--all", action="store_true", help="GPU: check, timings and SmolLM2 decode in one run")
    bk.add_argument("--decode", action="store_true", help="the SmolLM2 decode check alone (GPU: through the "
                    "kernel, CPU: through the reference)")
    bk.add_argument("--quick", action="store_true", help="fewer layer shapes (timings) and test shapes (check)")
    bk.add_argument("--cuda-graphs", action="store_true", help="GPU: also time both sides inside CUDA graphs "
                    "(no launch overhead; weights cycled so they come from memory, not L2)")
    bk.add_argument("--smollm2", metavar="GGUF", help="SmolLM2 GGUF for the decode check of --all or --decode "
                    "(default: the packaged one)")
    bk.add_argument("--table", metavar="JSON", help="print the markdown table of a results file (no new run)")
    bk.add_argument("--sass", action="store_true", help="no GPU needed: compile the tuning configurations for sm_90 "
                    "and report registers, spills and main-loop instructions per weight (with --quick: a few)")
    bk.set_defaults(func=cmd_bench_kernels)

    ba = _command(bsub, "attention", "FP8 attention kernel against bf16 flash SDPA (GPU only), sequences 1k-16k, "
                  "head dim 128", "hilt bench attention --json attention-gpu.json", [_OUTPUT])
    ba.set_defaults(func=cmd_bench_attention)

    bc = _command(bsub, "cim", "CIM simulator speed: each preset against the digital forward (batch 256), and "
                  "aihwkit's default configuration when it is installed",
                  "hilt bench cim --json cim_speed.json", [_OUTPUT])
    bc.set_defaults(func=cmd_bench_cim)
    bw = _command(bsub, "sweep", "a PCM drift sweep (10 chips x 6 times x 10,000 images) timed four ways: digital, "
                  "aihwkit's serial loop (when installed), hilt one chip at a time, hilt batched; accuracy beside "
                  "aihwkit's", "hilt bench sweep --quick --json cim_sweep.json --plot cim_sweep.png", [_OUTPUT, _PLOT],
                  plot="accuracy against time (mean ± std over chips) per workload, and the sweep's time per way")
    bw.add_argument("--quick", action="store_true", help="MLP only, 2 chips, 2 times, 500 images (seconds)")
    bw.add_argument("--workload", choices=WORKLOADS, help="one workload only (default: mlp and cnn; --quick: mlp)")
    bw.set_defaults(func=cmd_bench_sweep)
    bsr = _command(bsub, "sweep-ray", "`hilt sweep` on Ray: one grid (16 CNN cells) run locally, then as Ray tasks "
                   "with 1 and with 2 workers, each after an untimed warm-up run; wall times and their ratio, result "
                   "files compared", "hilt bench sweep-ray --json bench/results/sweep_scaling.json", [_OUTPUT])
    bsr.add_argument("--quick", action="store_true", help="200 images instead of 1000 (a few minutes on 2 cores)")
    bsr.set_defaults(func=cmd_bench_sweep_ray)
    bs = _command(bsub, "startup", "how long `hilt --help` takes against `python -c 'import torch'` (fresh processes)",
                  "hilt bench startup --json startup.json", [_OUTPUT])
    bs.add_argument("--repeats", type=int, default=7, help="timed runs of each (default 7), after one warm-up")
    bs.set_defaults(func=cmd_bench_startup)
    br = _command(bsub, "robustness", "standard vs noise-injection vs DWP training on the CNN: mismatch sweep, a year "
                  "of PCM drift, DWP ablation",
                  "hilt bench robustness --quick --json robustness.json --plot robustness.png", [_OUTPUT, _PLOT],
                  plot="accuracy against mismatch level and over a year of drift")
    br.add_argument("--quick", action="store_true", help="small budget (under 5 minutes on 2 cores)")
    br.add_argument("--markdown", metavar="FILE", help="the tables as Markdown")
    br.set_defaults(func=cmd_bench_robustness)
    bce = _command(bsub, "certify", "weight-perturbation certificates of the Fashion-MNIST MLP and CNN against int and "
                   "k-means at 2-8 bits and CIM chips over a year, with Monte-Carlo soundness checks",
                   "hilt bench certify --quick --json certify.json --plot certify.png", [_OUTPUT, _PLOT, _SEED],
                   plot="certified fraction against bits, and against time on a chip beside the measured accuracy")
    bce.add_argument("--quick", action="store_true", help="small budgets (under a minute; the full run took 28 "
                     "minutes on 2 cores shared with another job)")
    bce.add_argument("--markdown", metavar="FILE", help="the tables as Markdown")
    bce.set_defaults(func=cmd_bench_certify)

    bqat = _command(bsub, "qat", "QAT from scratch on Shakespeare: widths x bits {1,2,4,16} x {kmeans,int}, loss "
                    "against weight memory, gamma fits, memory-matched winners",
                    "hilt bench qat --quick --json qat_scaling.json --plot qat_scaling.png", [_OUTPUT, _PLOT],
                    plot="validation loss against weight memory")
    bqat.add_argument("--quick", action="store_true", help="two widths, shorter training (under 10 minutes on 2 cores)")
    bqat.add_argument("--seeds", type=_ANY_INT, nargs="+", help="default: 0 1 2 (--quick: 0)")
    bqat.add_argument("--learn-codebook", action=argparse.BooleanOptionalAction, default=True,
                      help="k-means codebooks trained by the loss after their fit (default), or refitted by k-means")
    bqat.add_argument("--lr", type=_POSITIVE_NUMBER, default=None, help="peak learning rate for every width (default: "
                      "per width, bench/studies/qat_scaling.py's LR_BY_WIDTH: 9e-3 at widths 64 and 96, 6e-3 at 128)")
    bqat.set_defaults(func=cmd_bench_qat)

    bp = _command(bsub, "ptq", "post-training quantization against its peers: round-to-nearest int, HQQ, k-means, "
                  "and error-compensated int and k-means at 4/3/2 bits on SmolLM2 and MiniLM",
                  "hilt bench ptq --out report/", [_OUTPUT])
    bp.add_argument("--out", default="report", metavar="DIR", help="folder for ptq.json, ptq.md, ptq.png")
    bp.add_argument("--quick", action="store_true", help="MiniLM at 3 bits only (about a minute)")
    bp.add_argument("--models", nargs="+", choices=["smollm2", "minilm"], help="default: both (--quick: minilm)")
    bp.add_argument("--bits", type=_int(2, 8), nargs="+", help="default: 4 3 2 (--quick: 3)")
    bp.set_defaults(func=cmd_bench_ptq)

    bsen = _command(bsub, "sensitivity", "does TPV predict what quantizing a layer costs? Each layer quantized on "
                    "its own against its prediction (rank correlation), and the whole model",
                    "hilt bench sensitivity --models minilm cnn --out report/", [_OUTPUT])
    bsen.add_argument("--out", default="report", metavar="DIR",
                      help="folder for sensitivity_validation.json and .png")
    bsen.add_argument("--quick", action="store_true", help="fewer samples and layers (minilm and cnn: about a minute)")
    bsen.add_argument("--models", nargs="+", choices=["minilm", "cnn", "smollm2", "cim"],
                      help="cim: the CNN on a PCM chip a year after programming, layer by layer, and which "
                           "layers to keep digital (default: all; --quick: minilm cnn cim)")
    bsen.set_defaults(func=cmd_bench_sensitivity)

    bdec = _command(bsub, "decode", "CPU decode of SmolLM2 through transformers' from_pretrained: hilt's int4 and "
                    "k-means 4-bit folders against the dense bf16 model and transformers' own GGUF loading, tokens/s "
                    "and load memory (needs hilt[hf])", "hilt bench decode --out bench/results", [_OUTPUT])
    bdec.add_argument("--quick", action="store_true", help="16 new tokens, 2 repeats (default 64, 3)")
    bdec.add_argument("--threads", type=_POSITIVE, default=2, help="torch threads (default 2)")
    bdec.add_argument("--work", metavar="DIR", help="where the converted and quantized folders go while it runs")
    bdec.add_argument("--out", metavar="DIR", help="write decode.json and decode.md there")
    bdec.set_defaults(func=cmd_bench_decode)

    bmix = _command(bsub, "mixed", "mixed precision under a bits budget: uniform, llama.cpp's rule, HAWQ and TPV "
                    "allocations at 2.5/3/3.5/4.25 bits/weight on SmolLM2 and MiniLM",
                    "hilt bench mixed --out report/", [_OUTPUT])
    bmix.add_argument("--out", default="report", metavar="DIR", help="folder for mixed.json, mixed.md, mixed.png")
    bmix.add_argument("--quick", action="store_true", help="MiniLM at 3 bits/weight on fewer sentences")
    bmix.add_argument("--models", nargs="+", choices=["smollm2", "minilm"], help="default: both (--quick: minilm)")
    bmix.add_argument("--budgets", type=_POSITIVE_NUMBER, nargs="+", metavar="BITS",
                      help="default: 2.5 3 3.5 4.25 (--quick: 3)")
    bmix.set_defaults(func=cmd_bench_mixed)

    r = _command(sub, "report", "the end-to-end run on the embedded defaults (real models): quantization, LUT "
                 "kernels, FP8 attention, CIM drift, DWP robustness, energy, ONNX; writes DIR/report.md",
                 "hilt report --out report/", [_OUTPUT])
    r.add_argument("--out", default="report", metavar="DIR", help="output folder (default ./report)")
    budget = r.add_mutually_exclusive_group()
    budget.add_argument("--quick", action="store_true", help="smaller budgets everywhere, about 10 minutes on 2 "
                        "cores (the default)")
    budget.add_argument("--full", action="store_true", help="the full budgets (about 45 minutes on 2 cores)")
    r.set_defaults(func=cmd_report)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    to_stdout = getattr(args, "json", None) == "-"
    args.stdout = sys.stdout  # --json - writes here; everything else then goes to stderr
    _configure_logging(getattr(args, "verbose", 0) - getattr(args, "quiet", 0), sys.stderr if to_stdout else sys.stdout)
    try:
        _check_output_folders(args)
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
        hint = " (run the same command with --resume to continue)" if args.command in ("quantize", "qat", "sweep") else ""
        print(f"hilt: interrupted{hint}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
