from __future__ import annotations

import contextlib

from hilt.cli.common import (
    DENSE_DTYPES, LOG, OUTPUT, POSITIVE, POSITIVE_NUMBER, QUANT_METHODS, SEED, UsageError, command, integer,
    number, resolve_bits,
)
from hilt.cli.output import write_json_option


def cmd_quantize(args) -> int:
    import torch

    from hilt.quant import QuantConfig, plan_checkpoint, quantize_checkpoint

    from hilt.models import lm

    if args.src in lm.BUILTIN:  # the built-in models by name, as elsewhere
        args.src = str(lm.lm_source(args.src).path)
    if args.asymmetric and args.method not in ("int", "int-asym"):
        raise UsageError(f"--asymmetric applies to --method int only, not --method {args.method}")
    if args.solver is not None and args.method != "kmeans":
        raise UsageError(f"--solver applies to --method kmeans only, not --method {args.method}")
    method = "int-asym" if args.asymmetric else args.method
    config = QuantConfig(method=method, bits=resolve_bits(args, 4), block_size=args.block_size,
                         codebook=args.codebook, solver=args.solver or "optimal", seed=args.seed)
    embeddings = args.embeddings
    if isinstance(embeddings, tuple):  # k-means: the block size is the run's
        embeddings = QuantConfig(method=embeddings[0], bits=embeddings[1], block_size=args.block_size)
    budget = _budget_plan(args)
    compensate = _compensation(args, config)
    formats = budget and budget["formats"]
    if args.dry_run:
        plan = plan_checkpoint(args.src, args.dst, config, only=args.only, ignore=args.ignore,
                               overwrite=args.overwrite, resume=args.resume, importance=args.importance,
                               formats=formats, embeddings=embeddings)
        rows = plan.rows()
        for r in rows:
            chosen = budget and next((c for c in budget["rows"] if c["name"] == r["name"]), None)
            if chosen:
                r.update(format=chosen["format"], predicted=chosen["predicted"])
            fmt = f"  {r['format']:<11} predicted {r['predicted']:.3g}" if "format" in r else ""
            print(f"would quantize {r['name']:<48} {str(tuple(r['shape'])):>14}  {r['bits_per_weight']:.3f} "
                  f"bits/weight{fmt}")
        if budget:
            print(_plan_line(budget["mixed"]))
        print(f"{len(rows)} tensors to quantize, {plan.kept} kept as they are; nothing written (--dry-run)")
        write_json_option(args, {"dry_run": True, "tensors": rows, **({"mixed": budget["mixed"]} if budget else {})})
        return 0

    if args.workers is not None and not args.ray:
        raise UsageError("--workers applies with --ray only")
    pool = contextlib.nullcontext()
    if args.ray:  # the Ray module is imported only here: a local run's path does not cross it
        from hilt.tasks.quantize_ray import RayPool

        pool = RayPool(args.workers)
    with pool as executor:
        written = quantize_checkpoint(args.src, args.dst, config, only=args.only, ignore=args.ignore,
                                      overwrite=args.overwrite, resume=args.resume, importance=args.importance,
                                      shard_bytes=int(args.shard_size * (1 << 20)), compensate=compensate,
                                      formats=formats, mixed=budget and budget["mixed"], embeddings=embeddings,
                                      dense_dtype=args.dense_dtype and getattr(torch, args.dense_dtype), progress=True,
                                      executor=executor)
    header, totals = written.header, written.header["totals"]
    what = "mixed formats under the budget" if budget else f"{config.method}, {config.bits} bits, block {config.block_size}"
    print(f"wrote {args.dst}: {totals['quantized_tensors']} of {totals['tensors']} tensors quantized "
          f"({what}), {totals['bits_per_weight']:.3f} bits/weight on quantized tensors, "
          f"mean rel. error {totals['rel_error_mean']:.4f}; {written.plan.source_bytes / 1e6:.1f} MB -> "
          f"{written.bytes / 1e6:.1f} MB")
    if budget:
        print(_plan_line(budget["mixed"]))
    if args.json:
        records = [{"name": name, "bits_per_weight": e["bits_per_weight"], "rel_error": e["rel_error"],
                    "shape": e["shape"]} for name, e in header["tensors"].items() if e["kind"] == "quantized"]
        result = {"dst": str(args.dst), "config": header["config"], "tensors": records,
                  "totals": {**totals, "bytes": written.bytes}, "seconds": written.seconds}
        if written.compensation_seconds:
            result["compensation"] = {**header["compensation"], "seconds": written.compensation_seconds}
        write_json_option(args, result)
    return 0


def embedding_format(text: str):
    """--embeddings: ``int8`` or ``8`` -> 8 (row-wise integers of that many bits); ``kmeans4`` -> ("kmeans", 4)."""
    import argparse
    import re

    match = re.fullmatch(r"(int|kmeans)?(\d)", text)
    method, bits = (match.group(1) or "int", int(match.group(2))) if match else (None, 0)
    if method is None or not (2 <= bits <= (8 if method == "int" else 4)):
        raise argparse.ArgumentTypeError(f"expected int2..int8 (or 2..8) or kmeans2..kmeans4, got {text!r}")
    return bits if method == "int" else (method, bits)


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
                       estimate=args.estimate or "blocks", progress=True)


def _plan_line(mixed: dict) -> str:
    return (f"budget {mixed['budget']} bits/weight: {mixed['bits_per_weight']:.4f} used, predicted output change "
            f"{mixed['predicted_tpv']:.4g} (no allocation within the budget is below {mixed['lower_bound']:.4g})")


def _compensation(args, config):
    """The Compensator factory for --compensate (None without it); the compensation flags are refused
    without --compensate."""
    # the defaults live in hilt/tasks/compensate.py and CompensationConfig; None here means "not given"
    given = {"--calibration": args.calibration, "--calibration-tokens": args.calibration_tokens,
             "--calibration-sentences": args.calibration_sentences, "--act-order": args.act_order or None,
             "--block-scales": args.block_scales}
    given = [flag for flag, value in given.items() if value is not None]
    if not args.compensate:
        if given:
            raise UsageError(f"{given[0]} applies with --compensate only")
        return None
    from hilt.tasks.compensate import compensator, model_kind
    from hilt.quant.compensate import CompensationConfig, check_compensable

    check_compensable(config)
    model_kind(args.src)  # an unsupported model fails before anything is read
    comp = CompensationConfig(act_order=args.act_order, **({"scales": args.block_scales} if args.block_scales else {}))
    options = {k: v for k, v in (("calibration", args.calibration), ("tokens", args.calibration_tokens),
                                 ("sentences", args.calibration_sentences)) if v is not None}

    def make(targets):
        LOG.info(f"compensating {len(targets)} tensors block by block: each block's calibration inputs pass "
                 "through it first (the first tensor of a block carries the block's time)")
        return compensator(args.src, config, comp, targets, **options)
    return make


def register(sub) -> None:
    q = command(sub, "quantize", "quantize a checkpoint (safetensors file or folder, GGUF)",
                "hilt quantize model.safetensors out-2bit --method kmeans --bits 2", [OUTPUT, SEED])
    q.add_argument("src", help="safetensors file, Hugging Face-style folder, GGUF file, or smollm2 / gemma3 by name")
    q.add_argument("dst", help="output folder: safetensors shards + hilt.json; from a Hugging Face folder also its "
                               "config (with a quantization_config transformers loads) and tokenizer")
    q.add_argument("--method", choices=QUANT_METHODS, default="kmeans",
                   help="kmeans codebook (default), integer grid (int, int-asym: min/max with an offset), "
                        "or sign x absmean (binary, 1 bit)")
    q.add_argument("--bits", type=integer(1, 8), help="bits per code, 1-8 (default 4; binary: 1)")
    q.add_argument("--block-size", type=POSITIVE, default=64, help="weights per scale along the input dim (default 64)")
    q.add_argument("--codebook", choices=["layer", "block"], default="layer", help="kmeans: one codebook per layer or per block")
    q.add_argument("--solver", choices=["optimal", "lloyd"],
                   help="kmeans: certified-optimal DP (default) or k-means++ + Lloyd (seeded by --seed)")
    q.add_argument("--asymmetric", action="store_true", help="int: min/max grid with a per-block offset (= int-asym)")
    q.add_argument("--importance", metavar="FILE",
                   help="kmeans: per-column importance from `hilt calibrate` (weights the k-means error)")
    q.add_argument("--compensate", action="store_true",
                   help="GPTQ-style error compensation through each layer's calibration inputs, layer by layer, "
                        "one block in memory (a Llama GGUF, a BERT folder, or a Hugging Face causal LM folder)")
    q.add_argument("--calibration", metavar="TEXT",
                   help="with --compensate: a text file (BERT: one sentence per line), or 'default' (Macbeth; "
                        "the evaluations use Hamlet)")
    q.add_argument("--calibration-tokens", type=POSITIVE, metavar="N",
                   help="with --compensate on a causal LM: calibration tokens, in windows of 512 (default 4096)")
    q.add_argument("--calibration-sentences", type=POSITIVE, metavar="N",
                   help="with --compensate on BERT: calibration sentences (default 256)")
    q.add_argument("--act-order", action="store_true",
                   help="with --compensate: round columns in order of decreasing input energy")
    q.add_argument("--block-scales", choices=["before", "during"],
                   help="with --compensate: block scales from the original weights (before) or from the "
                        "compensated ones as the sweep reaches each block (during, default)")
    q.add_argument("--budget", type=number(positive=True), metavar="BITS",
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
    q.add_argument("--embeddings", type=embedding_format, metavar="FORMAT",
                   help="also quantize embedding tables and output heads (tied ones once): int2..int8 (or the bits "
                        "alone) symmetric integers, one scale per row; kmeans2..kmeans4 k-means with the run's "
                        "--block-size (8 or int8 is the usual choice; docs/results/kernels.md measures each)")
    q.add_argument("--dense-dtype", choices=DENSE_DTYPES,
                   help="dtype of every floating tensor left unquantized (default: as stored; GGUF block types bfloat16)")
    q.add_argument("--shard-size", type=POSITIVE_NUMBER, default=256, metavar="MB",
                   help="output shard size (default 256 MB; memory holds one shard)")
    q.add_argument("--ray", action="store_true",
                   help="quantize the tensors as Ray tasks: on the cluster at RAY_ADDRESS, or a local one (same bytes)")
    q.add_argument("--workers", type=POSITIVE, metavar="N", help="with --ray: tensors at a time (default: every CPU)")
    q.set_defaults(func=cmd_quantize)
