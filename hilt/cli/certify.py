from __future__ import annotations

from hilt.cli.common import (
    CIM_PRESETS, DRIFT_COMPENSATION, LOG, OUTPUT, PLOT, POSITIVE, POSITIVE_NUMBER, QUANT_METHODS, UsageError,
    WORKLOADS, command, integer, resolve_bits,
)
from hilt.cli.output import write_json_option


def cmd_certify(args) -> int:
    from hilt.tasks import certify

    if args.method is None and (args.bits is not None or args.worst_case):
        raise UsageError("--bits and --worst-case describe a quantization format: give --method too")
    if args.chip is None and args.time is not None:
        raise UsageError("--time is the age of a chip: give --chip too")
    if args.chip is None and args.delta is not None:
        raise UsageError("--delta is the probability a chip's bound may fail: give --chip too")
    if args.chip is None and args.gdc is not None:
        raise UsageError("--gdc is a chip's drift compensation: give --chip too")
    if args.method is not None and args.chip is not None:
        raise UsageError("give a quantization format (--method) or a CIM chip (--chip), not both")
    delta = 0.01 if args.delta is None else args.delta
    if not 0 < delta < 1:
        raise UsageError(f"--delta must be between 0 and 1, got {delta}")
    bits = resolve_bits(args, 4) if args.method is not None else None
    if args.time is not None:
        from hilt.cim_sim import parse_time
        from hilt.errors import HiltError

        try:  # a bad --time is refused before the model and the images load
            parse_time(args.time)
        except HiltError as e:
            raise UsageError(f"--time: {e}") from None
    result, cert = certify.certify_run(args.workload, args.checkpoint, args.method, bits, args.block_size,
                                       args.worst_case, args.chip, args.time or "1y", delta, args.gdc or "global",
                                       args.test_images, progress=True)
    print(certify.render_run(result))
    write_json_option(args, result)
    if args.plot:
        certify.plot_run(result, cert, args.plot)
        LOG.info(f"wrote {args.plot}")
    return 0


def register(sub) -> None:
    ce = command(sub, "certify", "per test image, the smallest weight change that flips its prediction (exact at the "
                 "last layer, first order before it, a sound bound for all layers at once), against a quantization "
                 "format or a CIM chip at a time after programming",
                 "hilt certify cnn --method int --bits 8\n  hilt certify cnn --chip pcm --time 1y --delta 0.01",
                 [OUTPUT, PLOT], plot="every layer's flip norms over the test images, and the setting's bounds")
    ce.add_argument("workload", choices=WORKLOADS)
    ce.add_argument("--checkpoint", metavar="FILE", help="from `hilt train` (default: hilt/models/trained/WORKLOAD-standard.safetensors)")
    ce.add_argument("--method", choices=QUANT_METHODS, help="a quantization format: its actual error ||W - Q(W)||_F "
                    "per layer bounds the perturbation")
    ce.add_argument("--bits", type=integer(1, 8), help="bits per code with --method (default 4; binary: 1)")
    ce.add_argument("--block-size", type=POSITIVE, default=64, help="weights per scale (default 64; a layer whose "
                    "inputs it does not divide uses the largest size below it that does)")
    ce.add_argument("--worst-case", action="store_true", help="with --method: the largest error inside the format's "
                    "rounding cells instead of the actual one")
    ce.add_argument("--chip", choices=CIM_PRESETS, help="a CIM preset: a bound on ||dW||_F at --time that holds with "
                    "probability 1 - --delta under the device model, for drift-compensation factors in the "
                    "interval the JSON reports")
    ce.add_argument("--time", help="with --chip: time after programming (default 1y)")
    ce.add_argument("--delta", type=POSITIVE_NUMBER, help="with --chip: the probability the bound may "
                    "fail (default 0.01)")
    ce.add_argument("--gdc", choices=DRIFT_COMPENSATION, help="with --chip: drift compensation "
                    "(default global)")
    ce.add_argument("--test-images", "--n", dest="test_images", type=POSITIVE, default=10_000,
                    help="test images (default all 10000)")
    ce.set_defaults(func=cmd_certify)
