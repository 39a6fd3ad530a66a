from __future__ import annotations

from pathlib import Path

from hilt.cli.common import CIM_PRESETS, OUTPUT, PLOT, SEED, WORKLOADS, command, config_overrides, integer
from hilt.cli.output import write_json_option, write_outputs
from hilt.errors import HiltError


def cmd_bench_certify(args) -> int:
    from hilt.bench.studies import certify

    result = certify.study(quick=args.quick, progress=True, seed=args.seed)
    write_outputs(args, result, certify.plot, certify.render)
    if any(result["sound_violations"].values()):
        raise HiltError(f"an input certified by an exact or Lipschitz certificate flipped under an allowed "
                        f"perturbation: {result['sound_violations']} (the results are written)")
    return 0


def cmd_bench_cim(args) -> int:
    from hilt.bench.perf import cim_speed

    write_json_option(args, cim_speed.speed())
    return 0


def cmd_bench_sweep(args) -> int:
    from hilt.bench.studies import cim_peers

    result = cim_peers.sweep(quick=args.quick, workloads=args.workload and [args.workload])
    write_outputs(args, result, cim_peers.plot)
    return 0


def cmd_bench_sweep_ray(args) -> int:
    from hilt.bench.perf import sweep_scaling

    result = sweep_scaling.run(quick=args.quick)
    write_json_option(args, result)
    if not result["identical_files"]:  # saved above with the timings
        raise HiltError("the sweep's result files differ between the local and the Ray runs")
    return 0


def cmd_bench_robustness(args) -> int:
    from hilt.bench.studies import robustness

    result = robustness.study(quick=args.quick)
    write_outputs(args, result, robustness.plot, robustness.render)
    return 0


def cmd_bench_analog_lm_diagnosis(args) -> int:
    from hilt.bench.studies import analog_lm_diagnosis

    try:
        blocks = None if args.blocks is None else [int(b) for b in args.blocks.split(",")]
    except ValueError:
        raise HiltError(f"--blocks {args.blocks}: expected block numbers separated by commas, e.g. 0,15,29") from None
    result = analog_lm_diagnosis.diagnose(args.model, args.preset, args.time, blocks, args.tokens, quick=args.quick,
                                progress=True)
    write_outputs(args, result, analog_lm_diagnosis.plot, analog_lm_diagnosis.render)
    return 0


def cmd_bench_analog_lm(args) -> int:
    from hilt.bench.studies import analog_lm

    models = args.models and [m.strip() for m in args.models.split(",") if m.strip()]
    presets = args.presets and [p.strip() for p in args.presets.split(",") if p.strip()]
    for p in presets or []:
        if p not in CIM_PRESETS:
            raise HiltError(f"--presets {args.presets}: {p!r} is not a preset; choose from {', '.join(CIM_PRESETS)}")
    result = analog_lm.study(quick=args.quick, models=models, presets=presets, chips=args.chips, work=args.work,
                             peer=not args.no_aihwkit, overrides=config_overrides(args.set))
    write_outputs(args, result, analog_lm.plot, analog_lm.render)
    return 0


def cmd_bench_afm(args) -> int:
    from hilt.bench.studies import afm

    models = args.models and [m.strip() for m in args.models.split(",") if m.strip()]
    result = afm.study(quick=args.quick, models=models, draws=args.chips, work=args.work)
    write_outputs(args, result, afm.plot, afm.render)
    return 0


def register(bsub) -> None:
    bc = command(bsub, "cim", "CIM simulator speed: each preset against the digital forward (batch 256), and "
                 "aihwkit's default configuration when it is installed",
                 "hilt bench cim --json cim_speed.json", [OUTPUT])
    bc.set_defaults(func=cmd_bench_cim)
    bw = command(bsub, "sweep", "a PCM drift sweep (10 chips x 6 times x 10,000 images) timed four ways: digital, "
                 "aihwkit's serial loop (when installed), hilt one chip at a time, hilt batched; accuracy beside "
                 "aihwkit's", "hilt bench sweep --quick --json cim_sweep.json --plot cim_sweep.png", [OUTPUT, PLOT],
                 plot="accuracy against time (mean ± std over chips) per workload, and the sweep's time per way")
    bw.add_argument("--quick", action="store_true", help="MLP only, 2 chips, 2 times, 500 images (seconds)")
    bw.add_argument("--workload", choices=WORKLOADS, help="one workload only (default: mlp and cnn; --quick: mlp)")
    bw.set_defaults(func=cmd_bench_sweep)
    bsr = command(bsub, "sweep-ray", "`hilt sweep` on Ray: one grid (16 CNN cells) run locally, then as Ray tasks "
                  "with 1 and with 2 workers, each after an untimed warm-up run; wall times and their ratio, result "
                  "files compared", "hilt bench sweep-ray --json bench/results/sweep_scaling.json", [OUTPUT])
    bsr.add_argument("--quick", action="store_true", help="200 images instead of 1000 (a few minutes on 2 cores)")
    bsr.set_defaults(func=cmd_bench_sweep_ray)
    br = command(bsub, "robustness", "standard vs noise-injection vs DWP training on the CNN: mismatch sweep, a year "
                 "of PCM drift, DWP ablation",
                 "hilt bench robustness --quick --json robustness.json --plot robustness.png", [OUTPUT, PLOT],
                 plot="accuracy against mismatch level and over a year of drift")
    br.add_argument("--quick", action="store_true", help="small budget (under 5 minutes on 2 cores)")
    br.add_argument("--markdown", metavar="FILE", help="the tables as Markdown")
    br.set_defaults(func=cmd_bench_robustness)
    bce = command(bsub, "certify", "weight-perturbation certificates of the Fashion-MNIST MLP and CNN against int and "
                  "k-means at 2-8 bits and CIM chips over a year, with Monte-Carlo soundness checks",
                  "hilt bench certify --quick --json certify.json --plot certify.png", [OUTPUT, PLOT, SEED],
                  plot="certified fraction against bits, and against time on a chip beside the measured accuracy")
    bce.add_argument("--quick", action="store_true", help="small budgets (under a minute)")
    bce.add_argument("--markdown", metavar="FILE", help="the tables as Markdown")
    bce.set_defaults(func=cmd_bench_certify)
    bd = command(bsub, "analog-lm-diagnosis", "where a language model's error on a CIM chip comes from: each Linear "
                 "of a few decoder blocks alone on a chip, its relative output error with every non-ideality, each "
                 "alone, and the mapping and range options; the statistics of its weights and inputs",
                 "hilt bench analog-lm-diagnosis --json cim_lm_diagnosis.json --plot cim_lm_diagnosis.png",
                 [OUTPUT, PLOT], plot="relative output error per layer, one line per scenario")
    bd.add_argument("--model", default="smollm2", help="smollm2 (default) or a Llama GGUF file")
    bd.add_argument("--preset", default="pcm", choices=CIM_PRESETS, help="the chip (default pcm)")
    bd.add_argument("--time", default="1s", help="time after programming (default 1s)")
    bd.add_argument("--blocks", help="decoder blocks, comma-separated (default: the first, the middle and the last)")
    bd.add_argument("--tokens", type=integer(2), default=128, help="Hamlet tokens fed to the layers (default 128)")
    bd.add_argument("--quick", action="store_true", help="the first and the last block, 32 tokens (under 2 minutes)")
    bd.add_argument("--markdown", metavar="FILE", help="the tables as Markdown")
    bd.set_defaults(func=cmd_bench_analog_lm_diagnosis)
    bl = command(bsub, "analog-lm", "SmolLM2 and MiniLM on pcm and rram chips over a year: as trained, tuned by noise "
                 "injection and by DWP (hilt hwa), beside float, W4 and W4A8 on the same tokens; energy per token; "
                 "aihwkit on the same weights when installed",
                 "hilt bench analog-lm --quick --json analog_lm.json --plot analog_lm.png --markdown analog_lm.md",
                 [OUTPUT, PLOT], plot="the metric over time per model and preset, one line per variant")
    bl.add_argument("--quick", action="store_true",
                    help="pcm only, 2 chips, 1 s and 1 y, 64 tokens, tuning of 1-2 steps (a few minutes)")
    bl.add_argument("--models", help="comma-separated: smollm2, gemma3, minilm, a GGUF file or a model folder "
                    "(default smollm2,minilm)")
    bl.add_argument("--presets", help="comma-separated chip presets (default pcm,rram; --quick: pcm)")
    bl.add_argument("--chips", type=integer(1), help="chips per configuration (default 8; --quick: 2)")
    bl.add_argument("--set", action="append", metavar="FIELD=VALUE",
                    help="an AnalogConfig field over the deployment (column mapping, smoothing 0.5) on every preset "
                         "(repeatable), e.g. gdc_before_adc=true, tile_size=2048")
    bl.add_argument("--work", type=Path, default=Path("analog-lm-work"),
                    help="where the tuned models are kept and read back by a rerun (default ./analog-lm-work)")
    bl.add_argument("--no-aihwkit", action="store_true", help="skip the side-by-side run of aihwkit")
    bl.add_argument("--markdown", metavar="FILE", help="the tables as Markdown")
    bl.set_defaults(func=cmd_bench_analog_lm)
    ba = command(bsub, "afm", "the Analog Foundation Models yardstick: SmolLM2 as released, tuned by noise injection "
                 "and by their recipe (hilt hwa --method afm), each under their chip's noise beside float, W4 and "
                 "W4A8 on held-out text, and on the pcm chip at 1 s, 1 d and 1 y",
                 "hilt bench afm --quick --json afm.json --plot afm.png --markdown afm.md",
                 [OUTPUT, PLOT], plot="each variant digital, on the afm chip and on pcm at a year, bars to the worst chip")
    ba.add_argument("--quick", action="store_true",
                    help="2 afm chips, one pcm chip at 1 y, 64 tokens, tuning of 2 steps (a few minutes)")
    ba.add_argument("--models", help="comma-separated causal LMs: smollm2, gemma3, a GGUF file or a model folder "
                    "(default smollm2)")
    ba.add_argument("--chips", type=integer(1), help="chips per configuration (default 8; --quick: 2 afm, 1 pcm)")
    ba.add_argument("--work", type=Path, default=Path("analog-lm-work"),
                    help="where the tuned models are kept and read back by a rerun, shared with `hilt bench "
                         "analog-lm` (default ./analog-lm-work)")
    ba.add_argument("--markdown", metavar="FILE", help="the tables as Markdown")
    ba.set_defaults(func=cmd_bench_afm)
