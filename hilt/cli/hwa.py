from __future__ import annotations

from hilt.cli.common import (
    HWA_METHODS, LM_CHIPS, NOISE_LEVEL, OUTPUT, POSITIVE, POSITIVE_NUMBER, SEED, WEIGHTINGS, command, config_overrides,
    UsageError, float_pair, integer,
)
from hilt.cli.output import write_json_option


def cmd_hwa(args) -> int:
    from hilt.tasks import hwa

    from hilt.tasks.drift_lm import lm_deployment

    overrides = config_overrides(args.set)
    if args.method == "afm":
        if args.preset_as_is:
            raise UsageError("--preset-as-is: the afm chip has one configuration (its fields by --set)")
    else:
        overrides = lm_deployment(overrides, args.preset_as_is)
    result = hwa.tune(args.model, args.out, args.method, args.preset, overrides, args.eta,
                      *args.eta_range, args.copies, args.weighting, args.steps, args.lr, args.batch,
                      args.context, args.save_every, args.seed, args.resume, args.overwrite, progress=True,
                      times=args.times, teacher=args.teacher, periphery=args.periphery, synthetic=args.synthetic,
                      clip_sigma=args.clip_sigma, weight_noise=args.weight_noise, out_noise=args.out_noise,
                      learn_ranges=not args.fixed_ranges, range_lr=args.range_lr, clip=not args.no_clip)
    write_json_option(args, result)
    return 0


def register(sub) -> None:
    h = command(sub, "hwa", "fine-tune a language model for a CIM chip: distilled from its digital self through "
                "noisy device reads (noise injection or DWP), resumable; writes a GGUF (Llama) or a model folder (BERT)",
                "hilt hwa smollm2 smollm2-pcm.gguf --method noise --steps 60\n  "
                "hilt drift --model smollm2-pcm.gguf --preset pcm --times 1s,1y\n  "
                "hilt hwa smollm2 smollm2-afm.gguf --method afm --synthetic 32768 --no-clip --range-lr 1e-2 --steps 200\n  "
                "hilt drift --model smollm2-afm.gguf --preset afm --chips 8",
                [OUTPUT, SEED])
    h.add_argument("model", help="smollm2, gemma3, a .gguf, a causal-LM folder (written out as a folder), minilm or a BERT folder")
    h.add_argument("out", help="the tuned model: a .gguf file for a causal LM, a folder for an encoder")
    h.add_argument("--method", default="noise", choices=HWA_METHODS,
                   help="noise: one device read per step at --eta; dwp: --copies reads at levels over "
                        "--eta-range, samples weighted by their disagreement; afm: the Analog Foundation Models "
                        "recipe for their chip (8-bit converters, learned input ranges, weight noise, clipping) "
                        "(default noise)")
    h.add_argument("--preset", choices=LM_CHIPS, help="the chip tuned for (default pcm; --method afm: afm)")
    h.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="a field of the chip over the preset (repeatable): weight_mapping=column maps the noise "
                        "per column; clip_std=K clips every column to K std after each step; devices_per_weight=N reads "
                        "the mean of N devices per side; --method afm: AfmConfig fields, e.g. dac_bits=8")
    h.add_argument("--preset-as-is", action="store_true",
                   help="tune for the preset's own mapping (aihwkit's) instead of a language model's deployment "
                        "(column mapping, smoothing 0.5)")
    h.add_argument("--synthetic", type=integer(2), metavar="TOKENS",
                   help="train on this many tokens the model writes itself (from its document start, top-50 "
                        "sampling) instead of Shakespeare; causal LMs")
    h.add_argument("--clip-sigma", type=POSITIVE_NUMBER, help="afm: clip every row to this many standard "
                   "deviations after each step (default 2.5, theirs)")
    h.add_argument("--no-clip", action="store_true",
                   help="afm: no clipping (a model with large outlier weights, such as SmolLM2, loses them to a clip)")
    h.add_argument("--weight-noise", type=NOISE_LEVEL, help="afm: Gaussian weight noise per row each forward, std "
                   "over the row's abs-max (default 0.03)")
    h.add_argument("--out-noise", type=NOISE_LEVEL, help="afm: Gaussian output noise each forward, std over the "
                   "input range times the layer's abs-max (default 0)")
    h.add_argument("--fixed-ranges", action="store_true",
                   help="afm: keep the input ranges calibrated at the start instead of learning them")
    h.add_argument("--range-lr", type=POSITIVE_NUMBER,
                   help="afm: the learning rate of the input ranges (default --lr, theirs; AdamW moves a range by about "
                        "this much a step)")
    h.add_argument("--times", default="1s,1y", metavar="FROM,TO",
                   help="the device reads' times after programming, drawn log-uniformly between the two (default "
                        "1s,1y; e.g. 1d,1y to tune for the late part of a deployment)")
    h.add_argument("--teacher", metavar="MODEL",
                   help="the model distilled from, with the same tokenizer (default MODEL itself); e.g. the "
                        "original when MODEL is a tuned one to continue")
    h.add_argument("--periphery", action="store_true",
                   help="the reads also pass the chip's DAC, output noise and ADC, array by array (with the "
                        "configuration's tile_size, smoothing and input ranges)")
    h.add_argument("--eta", type=NOISE_LEVEL, default=1.0, help="noise: the device noise level (1 = the published device)")
    h.add_argument("--eta-range", type=float_pair, default=(0.5, 1.5), metavar="MIN,MAX",
                   help="dwp: the reads' noise levels (default 0.5,1.5)")
    h.add_argument("--copies", type=integer(2), default=2, help="dwp: device reads per step (default 2)")
    h.add_argument("--weighting", default="js", choices=WEIGHTINGS, help="dwp: disagreement measure (default js)")
    h.add_argument("--steps", type=POSITIVE, default=60)
    h.add_argument("--lr", type=POSITIVE_NUMBER, default=2e-5)
    h.add_argument("--batch", type=POSITIVE, default=4, help="windows (causal) or sentences (encoder) per step")
    h.add_argument("--context", type=integer(2), default=128, help="causal LM: tokens per window (default 128)")
    h.add_argument("--save-every", type=POSITIVE, default=10, help="steps between resumable training states")
    h.add_argument("--resume", action="store_true", help="continue from OUT.hwa-state/")
    h.add_argument("--overwrite", action="store_true")
    h.set_defaults(func=cmd_hwa)
