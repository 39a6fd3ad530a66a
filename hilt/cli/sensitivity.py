from __future__ import annotations

from hilt.cli.common import (
    CIM_PRESETS, DRIFT_COMPENSATION, OUTPUT, PLOT, POSITIVE, SEED, UsageError, command, integer,
)
from hilt.cli.output import write_outputs


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
    write_outputs(args, r, sensitivity.plot)
    return 0


def register(sub) -> None:
    se = command(sub, "sensitivity", "per-layer TPV sensitivity: which layers a quantization format hurts, "
                 "predicted from calibration data without evaluating anything",
                 "hilt sensitivity minilm --json minilm-tpv.json --plot minilm-tpv.png", [OUTPUT, PLOT, SEED],
                 plot="Tr(H_eff) per layer with its standard error, and the predicted change of a few formats")
    se.add_argument("model", nargs="?", default="smollm2",
                    help="smollm2, gemma3, minilm, mlp, cnn, a GGUF file, a causal-LM or BERT folder (default smollm2)")
    se.add_argument("--checkpoint", metavar="FILE", help="mlp/cnn: the workload checkpoint (default the trained one)")
    se.add_argument("--candidates", metavar="LIST",
                    help="formats METHOD BITS[@BLOCK], ranges allowed: default kmeans1-4,int2-8 (mlp/cnn: @row)")
    se.add_argument("--block-size", type=POSITIVE, default=64, help="block size of a candidate without @ (default 64)")
    se.add_argument("--probes", type=POSITIVE, default=2, help="probe backward passes per calibration batch (default 2)")
    se.add_argument("--estimate", choices=["full", "blocks"], default="full",
                    help="also compute eᵀ H_eff e with each format's error itself (full, default), or only the "
                         "block-diagonal TPV (blocks: less memory)")
    se.add_argument("--calibration", metavar="TEXT", help="a text file instead of Macbeth (BERT: one sentence per line)")
    se.add_argument("--tokens", type=POSITIVE, default=2048, help="causal LM: calibration tokens (default 2048)")
    se.add_argument("--sentences", type=POSITIVE, default=256, help="encoder: calibration sentences (default 256)")
    se.add_argument("--images", type=POSITIVE, default=2048, help="mlp/cnn: training images (default 2048)")
    se.add_argument("--preset", choices=CIM_PRESETS,
                    help="mlp/cnn: instead of quantization formats, this CIM chip preset's errors (of the weights, "
                         "and of each whole analog layer at its output)")
    se.add_argument("--time", help="with --preset: time after programming (default 1y)")
    se.add_argument("--chips", type=integer(2), help="with --preset: chips drawn for the error statistics (default 8)")
    se.add_argument("--gdc", choices=DRIFT_COMPENSATION, help="with --preset: drift compensation (default global)")
    se.set_defaults(func=cmd_sensitivity)
