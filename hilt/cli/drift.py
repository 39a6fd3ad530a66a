from __future__ import annotations

import argparse

from hilt.cli.common import CIM_PRESETS, DRIFT_COMPENSATION, OUTPUT, PLOT, POSITIVE, command, model_spec
from hilt.cli.output import write_outputs


def cmd_drift(args) -> int:
    from hilt.tasks import drift

    result = drift.drift_study(args.model, args.checkpoint, args.preset, args.times, args.repeats, args.gdc,
                               args.test_images, progress=True, data=args.data)
    write_outputs(args, result, drift.plot_drift)
    return 0


def register(sub) -> None:
    d = command(sub, "drift", "accuracy on simulated CIM hardware over time after programming",
                "hilt drift --model cnn --preset pcm --times 1s,1h,1d,1mo,1y --repeats 5 --plot drift.png\n  "
                "hilt drift --model mynets:resnet8 --checkpoint resnet8.safetensors --data test.npz --repeats 10",
                [OUTPUT, PLOT], plot="accuracy against log time, bands over chips")
    d.add_argument("--model", default="cnn", type=model_spec, metavar="NAME|PKG.MODULE:FACTORY",
                   help="a built-in workload (mlp, cnn; default cnn) or a function building your nn.Module")
    d.add_argument("--workload", dest="model", type=model_spec, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    d.add_argument("--checkpoint", metavar="FILE", help="safetensors weights: from `hilt train` for a workload "
                   "(default: hilt/models/trained/WORKLOAD-standard.safetensors), your state dict for a factory")
    d.add_argument("--data", metavar="FILE", help="a .safetensors or .npz file of `inputs` and `labels` "
                   "(default: the Fashion-MNIST test split)")
    d.add_argument("--preset", default="pcm", choices=CIM_PRESETS, help="the CIM device preset (default pcm)")
    d.add_argument("--times", default="1s,1h,1d,1mo,1y", help="comma-separated times after programming")
    d.add_argument("--repeats", type=POSITIVE, default=5, help="programmed chips (default 5)")
    d.add_argument("--gdc", default="global", choices=DRIFT_COMPENSATION,
                   help="drift compensation compared with none (default global)")
    d.add_argument("--test-images", type=POSITIVE, default=10_000, help="test examples per evaluation (default 10000)")
    d.set_defaults(func=cmd_drift)
