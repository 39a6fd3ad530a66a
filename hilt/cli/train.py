from __future__ import annotations

from hilt.cli.common import (
    NOISE_LEVEL, NOISE_MODELS, OUTPUT, POSITIVE, SEED, TRAINING_METHODS, WEIGHTINGS, WORKLOADS, command, float_pair,
)
from hilt.cli.output import write_json_option


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
    write_json_option(args, r)
    return 0


def register(sub) -> None:
    t = command(sub, "train", "train a Fashion-MNIST workload (MLP or CNN) and save a safetensors checkpoint",
                "hilt train --workload cnn --out cnn.safetensors", [OUTPUT, SEED])
    t.add_argument("--workload", required=True, choices=WORKLOADS)
    t.add_argument("--method", default="standard", choices=TRAINING_METHODS,
                   help="standard, noise (noise injection at --eta) or dwp (--copies noisy copies over --eta-range, "
                        "samples weighted by their disagreement)")
    t.add_argument("--noise-model", default="mismatch", choices=NOISE_MODELS, help="the noise trained under")
    t.add_argument("--eta", type=NOISE_LEVEL, help="noise: the mismatch level (default 0.3)")
    t.add_argument("--eta-range", type=float_pair, metavar="MIN,MAX", help="dwp: the copies' levels (default 0.1,0.6)")
    t.add_argument("--copies", type=POSITIVE, help="dwp: noisy copies per step (default 4)")
    t.add_argument("--weighting", default="js", choices=WEIGHTINGS, help="dwp: disagreement measure (default js)")
    t.add_argument("--epochs", type=POSITIVE, help="epochs (default: the workload's)")
    t.add_argument("--out", metavar="FILE", help="checkpoint to write (.safetensors)")
    t.add_argument("--overwrite", action="store_true")
    t.set_defaults(func=cmd_train)
