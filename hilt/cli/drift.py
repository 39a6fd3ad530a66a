from __future__ import annotations

import argparse
from pathlib import Path

from hilt.cli.common import (
    DRIFT_COMPENSATION, LM_CHIPS, OUTPUT, PLOT, POSITIVE, UsageError, command, config_overrides, integer,
    model_spec,
)
from hilt.cli.output import write_outputs

LANGUAGE_MODELS = ("smollm2", "gemma3", "minilm")  # as hilt.tasks.drift_lm (not imported here: no torch for --help)
DEFAULT_TIMES = "1s,1h,1d,1mo,1y"


def drift_model(text: str) -> str:
    """A workload, a factory, or a language model: smollm2, gemma3, minilm, a .gguf file or a model folder."""
    if not text.strip():  # Path("") is the current folder
        raise argparse.ArgumentTypeError("expected a workload or a language model, got ''")
    if text in LANGUAGE_MODELS or text.endswith(".gguf") or Path(text).is_dir():
        return text
    try:
        return model_spec(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or a language model: smollm2, gemma3, minilm, a .gguf file or a model "
                                         "folder)") from None


def cmd_drift(args) -> int:
    from hilt.tasks import drift

    lm = args.model in LANGUAGE_MODELS or args.model.endswith(".gguf") or Path(args.model).is_dir()
    chips = args.chips or args.repeats
    if lm:
        if args.checkpoint or args.data or args.test_images:
            raise UsageError("--checkpoint, --data and --test-images apply to mlp/cnn/factory models; a language "
                             "model reads --text")
        from hilt.tasks import drift_lm

        if args.preset == "afm":
            if args.preset_as_is:
                raise UsageError("--preset-as-is: the afm chip has one configuration (its fields by --set)")
            if args.times is not None or args.gdc is not None:
                raise UsageError("--times and --gdc: the afm chip has no drift; it is read as programmed")
            if args.plot:
                raise UsageError("--plot: the afm chip is read at one time; its chips are in the JSON (--json)")
            result = drift_lm.afm_study(args.model, chips or 8, args.text, args.tokens, args.context, args.sentences,
                                        config_overrides(args.set), progress=True)
            write_outputs(args, result)
            return 0
        overrides = drift_lm.lm_deployment(config_overrides(args.set), args.preset_as_is)
        result = drift_lm.lm_drift_study(args.model, args.preset, args.times or DEFAULT_TIMES, chips or 2,
                                         args.gdc or "global", args.text, args.tokens, args.context, args.sentences,
                                         overrides, progress=True)
    else:
        for flag, value in (("--text", args.text), ("--set", args.set), ("--preset-as-is", args.preset_as_is)):
            if value:
                raise UsageError(f"{flag} applies to a language model (--model smollm2, minilm or a folder)")
        if args.preset == "afm":
            raise UsageError("--preset afm: the Analog Foundation Models chip takes a language model")
        result = drift.drift_study(args.model, args.checkpoint, args.preset, args.times or DEFAULT_TIMES, chips or 5,
                                   args.gdc or "global", args.test_images or 10_000, progress=True, data=args.data)
    write_outputs(args, result, drift.plot_drift)
    return 0


def register(sub) -> None:
    d = command(sub, "drift", "accuracy (or a language model's perplexity / embedding cosine) on simulated CIM "
                "hardware over time after programming",
                "hilt drift --model cnn --preset pcm --times 1s,1h,1d,1mo,1y --repeats 5 --plot drift.png\n  "
                "hilt drift --model mynets:resnet8 --checkpoint resnet8.safetensors --data test.npz --repeats 10\n  "
                "hilt drift --model smollm2 --preset pcm --chips 2 --set gdc_before_adc=true --set clip_std=3\n  "
                "hilt drift --model smollm2 --preset afm --chips 8 --set noise=additive",
                [OUTPUT, PLOT], plot="the metric against log time, bands over chips")
    d.add_argument("--model", default="cnn", type=drift_model, metavar="NAME|PKG.MODULE:FACTORY|FOLDER",
                   help="a built-in workload (mlp, cnn; default cnn), a function building your nn.Module, or a "
                        "language model: smollm2, gemma3, minilm, a .gguf, a BERT or transformers model folder")
    d.add_argument("--workload", dest="model", type=drift_model, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    d.add_argument("--checkpoint", metavar="FILE", help="safetensors weights: from `hilt train` for a workload "
                   "(default: hilt/models/trained/WORKLOAD-standard.safetensors), your state dict for a factory")
    d.add_argument("--data", metavar="FILE", help="a .safetensors or .npz file of `inputs` and `labels` "
                   "(default: the Fashion-MNIST test split)")
    d.add_argument("--preset", default="pcm", choices=LM_CHIPS,
                   help="the CIM device preset (default pcm); afm: a language model on the Analog Foundation "
                        "Models chip (their programming noise and 8-bit converters, no drift; 8 chips by default)")
    d.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="language model: an AnalogConfig field over the preset (repeatable), e.g. weight_mapping=column, "
                        "smoothing=0.5, clip_std=3, input_range=static, adc_bits=10")
    d.add_argument("--preset-as-is", action="store_true",
                   help="language model: the preset's own mapping and input handling (aihwkit's) instead of a "
                        "language model's deployment (column mapping, smoothing 0.5)")
    d.add_argument("--times", help=f"comma-separated times after programming (default {DEFAULT_TIMES})")
    d.add_argument("--repeats", type=POSITIVE, help="programmed chips (default 5; a language model 2)")
    d.add_argument("--chips", type=POSITIVE, help="the same as --repeats")
    d.add_argument("--gdc", choices=DRIFT_COMPENSATION,
                   help="drift compensation compared with none (default global)")
    d.add_argument("--test-images", type=POSITIVE, help="test examples per evaluation (default 10000)")
    d.add_argument("--text", metavar="FILE", help="language model: the evaluation text (default Hamlet)")
    d.add_argument("--tokens", type=integer(2), default=256, help="causal LM: tokens evaluated (default 256)")
    d.add_argument("--context", type=integer(2), default=128, help="causal LM: tokens per window (default 128)")
    d.add_argument("--sentences", type=POSITIVE, default=64, help="encoder: sentences embedded (default 64)")
    d.set_defaults(func=cmd_drift)
