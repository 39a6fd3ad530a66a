from __future__ import annotations

from hilt.cli.common import ENERGY_CHIPS, OUTPUT, PLOT, POSITIVE, Renamed, UsageError, WORKLOADS, command
from hilt.cli.output import write_outputs


def cmd_energy(args) -> int:
    from hilt.tasks import energy

    if args.sweep and args.adc_bits is not None:
        raise UsageError("--sweep: it picks the ADC resolution itself; leave --adc-bits out, or drop --sweep")
    result = energy.run(args.workload, args.checkpoint, args.chip, args.adc_bits, args.dac_bits, args.gpu_batch,
                        sweep=args.sweep)
    write_outputs(args, result, energy.plot)
    return 0


def register(sub) -> None:
    e = command(sub, "energy", "energy per inference on a CIM chip against a GPU, per layer",
                "hilt energy --workload cnn --sweep --plot energy.png", [OUTPUT, PLOT],
                plot="energy per inference per layer, CIM against GPU, and where the CIM energy goes")
    e.add_argument("--workload", required=True, choices=WORKLOADS)
    e.add_argument("--checkpoint", metavar="FILE", help="default: hilt/models/trained/WORKLOAD-standard.safetensors")
    e.add_argument("--chip", default="rram-22nm", choices=ENERGY_CHIPS,
                   help="the CIM chip's energy constants (default rram-22nm)")
    e.add_argument("--preset", action=Renamed, new="--chip", why=" (--preset names a CIM device preset)")
    e.add_argument("--adc-bits", type=POSITIVE,
                   help="ADC resolution (default 9, or the lowest that keeps accuracy with --sweep)")
    e.add_argument("--dac-bits", type=POSITIVE, default=7, help="DAC resolution (default 7)")
    e.add_argument("--gpu-batch", type=POSITIVE, default=256, help="batch over which the GPU reads its weights once")
    e.add_argument("--sweep", action="store_true",
                   help="first find the lowest ADC resolution within 1 point of the 9-bit accuracy (pcm, 1 s)")
    e.set_defaults(func=cmd_energy)
