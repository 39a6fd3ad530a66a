from __future__ import annotations

import argparse

from hilt.cli.common import (
    NON_NEGATIVE, OUTPUT, POSITIVE, POSITIVE_NUMBER, QUANT_METHODS, SEED, command, integer,
    resolve_bits,
)
from hilt.cli.output import write_json_option
from hilt.errors import HiltError


def cmd_qat(args) -> int:
    from hilt.tasks import qat_finetune

    if args.model != "smollm2":
        raise HiltError(f"QAT fine-tuning knows the packaged 'smollm2', not {args.model!r}")
    result = qat_finetune.finetune(args.dst, args.method, resolve_bits(args, 2), args.block_size, args.steps,
                                   args.lr, args.batch, args.context, args.refit_every, args.save_every, args.seed,
                                   args.resume, args.overwrite, args.only, learn_codebook=args.learn_codebook,
                                   progress=True)
    write_json_option(args, result)
    return 0


def register(sub) -> None:
    qa = command(sub, "qat", "quantization-aware fine-tuning of SmolLM2-135M, saved in the hilt quantize format "
                 "(resumable)", "hilt qat smollm2 smollm2-2bit-qat --bits 2 --steps 60", [OUTPUT, SEED])
    qa.add_argument("model", help="smollm2 (the packaged model)")
    qa.add_argument("dst", help="output folder (a hilt checkpoint, as `hilt quantize` writes)")
    qa.add_argument("--method", default="kmeans", choices=QUANT_METHODS)
    qa.add_argument("--bits", type=integer(1, 8), help="bits per code, 1-8 (default 2; binary: 1)")
    qa.add_argument("--block-size", type=POSITIVE, default=64)
    qa.add_argument("--steps", type=POSITIVE, default=60)
    qa.add_argument("--lr", type=POSITIVE_NUMBER, default=1e-4)
    qa.add_argument("--batch", type=POSITIVE, default=4, help="windows per step")
    qa.add_argument("--context", type=integer(2), default=256, help="tokens per window")
    qa.add_argument("--learn-codebook", action=argparse.BooleanOptionalAction, default=True,
                    help="k-means: train the codebook levels by the loss after their fit (default), or only refit them")
    qa.add_argument("--refit-every", type=NON_NEGATIVE, default=0,
                    help="k-means codebook refit interval in steps (default 0: never; the published procedure "
                         "with --no-learn-codebook refits every few thousand)")
    qa.add_argument("--save-every", type=POSITIVE, default=10, help="steps between resumable training states")
    qa.add_argument("--only", metavar="REGEX", help="quantize only the Linear weights whose name matches")
    qa.add_argument("--resume", action="store_true", help="continue from DST.qat-state/")
    qa.add_argument("--overwrite", action="store_true")
    qa.set_defaults(func=cmd_qat)
