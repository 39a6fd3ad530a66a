from __future__ import annotations

import argparse
from pathlib import Path

from hilt.atomic import write_text
from hilt.cli.common import (
    NON_NEGATIVE, OUTPUT, PLOT, POSITIVE, POSITIVE_NUMBER, UsageError, command, integer, name_list,
)
from hilt.cli.output import write_json_option, write_outputs
from hilt.errors import HiltError


def cmd_bench_qat(args) -> int:
    from hilt.bench.studies import qat_scaling

    result = qat_scaling.study(quick=args.quick, seeds=args.seeds, lr=args.lr, learn_codebook=args.learn_codebook)
    write_outputs(args, result, qat_scaling.plot)
    return 0


def cmd_bench_ptq(args) -> int:
    from hilt.bench.studies import ptq

    write_json_option(args, ptq.run(out=args.out, quick=args.quick, models=args.models, widths=args.bits))
    return 0


def cmd_bench_sensitivity(args) -> int:
    from hilt.bench.studies import sensitivity

    models = args.models or (["minilm", "cnn", "cim"] if args.quick else ["minilm", "cnn", "smollm2", "cim"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = sensitivity.run(out=out / "sensitivity_validation.json", quick=args.quick, models=models)
    if "cim" in r:
        c = r["cim"]
        print(f"cnn on {c['label']}: Spearman {c['spearman_kl']:.3f} (KL), {c['spearman_accuracy_drop']:.3f} "
              f"(accuracy drop) over {len(c['rows'])} layers each alone on {c['chips']} chips")
        for key, k in c["keep_digital"].items():
            last = k["curve"][-1]
            print(f"  keep digital {', '.join(k['digital']) or 'nothing':<14} ({key}): accuracy at {last['time']} "
                  f"{last['accuracy_mean']:.4f} ± {last['accuracy_std']:.4f}")
    for name, m in r["models"].items():
        for label, f in m["formats"].items():
            print(f"{name:<8} {label:<11} Spearman {f['spearman']:.3f} (blocks {f['spearman_blocks']:.3f}) over "
                  f"{f['layers']} layers; whole model predicted {f['whole_model_predicted']:.4g}, "
                  f"measured {f['whole_model_measured']:.4g}")
    write_json_option(args, r)
    return 0


def cmd_bench_mixed(args) -> int:
    from hilt.bench.studies import mixed

    models = args.models or (["minilm"] if args.quick else ["minilm", "smollm2"])
    budgets = args.budgets or ([3.0] if args.quick else list(mixed.BUDGETS))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = mixed.run(out=out / "mixed.json", quick=args.quick, models=models, budgets=budgets)
    print(r["table"])
    write_json_option(args, r)
    return 0


# the rows of `hilt bench decode --formats` (bench.perf.decode_speed.NAMES; kept here so that parsing imports no torch)
DECODE_NAMES = ("int4", "int4+int8emb", "kmeans4", "kmeans4+int8head", "kmeans2+int8head", "kmeans3", "kmeans2",
                "binary", "kmeans4-compensated")


decode_formats = name_list(DECODE_NAMES, "a decode row", "rows")  # --formats of bench decode


def cmd_bench_decode(args) -> int:
    from hilt.bench.perf import decode_speed

    if args.out:
        from hilt.atomic import check_out_folder

        check_out_folder(args.out)  # before minutes of benchmark, not after
    formats = args.formats and tuple(decode_speed.NAMES[n] for n in args.formats.split(","))
    r = decode_speed.run(quick=args.quick, work=args.work, threads=args.threads, new_tokens=args.tokens,
                         repeats=args.repeats, model=args.model, formats=formats)
    print(r["table"])
    if args.out:
        from hilt.atomic import write_json as write_json_file

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_file(out / "decode.json", r)
        write_text(out / "decode.md", r["table"] + "\n")
    write_json_option(args, r)
    return 0


def cmd_bench_quantize(args) -> int:
    from hilt.bench.perf import quantize_speed

    write_json_option(args, quantize_speed.run(quick=args.quick))
    return 0


def cmd_bench_kernels(args) -> int:
    import json
    import tempfile

    from hilt.bench.perf import lut_kernels

    if args.sass:
        from hilt.bench.perf import sass

        return sass.run(None if args.json == "-" else args.json, quick=args.quick)
    if args.table:
        try:
            saved = json.loads(Path(args.table).read_text())
            table = lut_kernels.render_table(saved)
        except OSError as e:
            raise HiltError(f"{args.table}: {e.strerror or e}") from e
        except (ValueError, KeyError, HiltError) as e:
            raise HiltError(f"{args.table}: {e}") from e
        args.stdout.write(table)
        if args.plot:
            lut_kernels.plot(saved, args.plot)
        return 0
    if args.smollm2 and not (args.all or args.decode):
        raise UsageError("--smollm2 is the decode check's model: add --all or --decode")
    parts = dict(check_only=args.check, timings_only=args.timings, everything=args.all, decode_only=args.decode,
                 quick=args.quick, cuda_graphs=args.cuda_graphs, smollm2=args.smollm2, plot_path=args.plot)
    if args.json != "-":
        return lut_kernels.run(**parts, json_path=args.json)
    with tempfile.TemporaryDirectory() as tmp:  # it writes a file as it goes: pass it on whole at the end
        path = Path(tmp) / "kernels.json"
        try:
            return lut_kernels.run(**parts, json_path=path)
        finally:
            if path.exists():
                args.stdout.write(path.read_text())
                args.stdout.flush()


def register(bsub) -> None:
    bq = command(bsub, "quantize", "quantization speed vs the published k-means procedure, and peak memory",
                 "hilt bench quantize --quick --json speed.json", [OUTPUT])
    bq.add_argument("--quick", action="store_true", help="4 reference tensors and a 1 GB memory checkpoint")
    bq.set_defaults(func=cmd_bench_quantize)
    bk = command(bsub, "kernels", "LUT matmul kernels: correctness vs reference; GPU timings vs bf16 cuBLAS",
                 "hilt bench kernels --check", [OUTPUT, PLOT],
                 plot="speedup against M per layer shape and bit width (of the timings, or of --table's file)")
    bk.add_argument("--check", action="store_true", help="the correctness check (on the CPU through Triton's "
                    "interpreter); without --check, --timings or --decode: the check, then timings on a GPU")
    bk.add_argument("--timings", action="store_true", help="GPU: the timings alone")
    bk.add_argument("--all", action="store_true", help="GPU: check, timings and SmolLM2 decode in one run")
    bk.add_argument("--decode", action="store_true", help="the SmolLM2 decode check alone (GPU: through the "
                    "kernel, CPU: through the reference)")
    bk.add_argument("--quick", action="store_true", help="fewer layer shapes (timings) and test shapes (check)")
    bk.add_argument("--cuda-graphs", action="store_true", help="GPU: also time both sides inside CUDA graphs "
                    "(no launch overhead; weights cycled so they come from memory, not L2)")
    bk.add_argument("--smollm2", metavar="GGUF", help="SmolLM2 GGUF for the decode check of --all or --decode "
                    "(default: the packaged one)")
    bk.add_argument("--table", metavar="JSON", help="print the markdown table of a results file (no new run)")
    bk.add_argument("--sass", action="store_true", help="no GPU needed: compile the tuning configurations for sm_90 "
                    "and report registers, spills and main-loop instructions per weight (with --quick: a few)")
    bk.set_defaults(func=cmd_bench_kernels)
    bqat = command(bsub, "qat", "QAT from scratch on Shakespeare: widths x bits {1,2,4,16} x {kmeans,int}, loss "
                   "against weight memory, gamma fits, memory-matched winners",
                   "hilt bench qat --quick --json qat_scaling.json --plot qat_scaling.png", [OUTPUT, PLOT],
                   plot="validation loss against weight memory")
    bqat.add_argument("--quick", action="store_true", help="two widths, shorter training (under 10 minutes on 2 cores)")
    bqat.add_argument("--seeds", type=NON_NEGATIVE, nargs="+", help="default: 0 1 2 (--quick: 0)")
    bqat.add_argument("--learn-codebook", action=argparse.BooleanOptionalAction, default=True,
                      help="k-means codebooks trained by the loss after their fit (default), or refitted by k-means")
    bqat.add_argument("--lr", type=POSITIVE_NUMBER, default=None, help="peak learning rate for every width (default: "
                      "per width, bench/studies/qat_scaling.py's LR_BY_WIDTH: 9e-3 at widths 64 and 96, 6e-3 at 128)")
    bqat.set_defaults(func=cmd_bench_qat)
    bp = command(bsub, "ptq", "post-training quantization against its peers: round-to-nearest int, HQQ, k-means, "
                 "and error-compensated int and k-means at 4/3/2 bits on SmolLM2 and MiniLM",
                 "hilt bench ptq --out report/", [OUTPUT])
    bp.add_argument("--out", default="report", metavar="DIR", help="folder for ptq.json, ptq.md, ptq.png")
    bp.add_argument("--quick", action="store_true", help="MiniLM at 3 bits, its first two layers quantized (under a minute)")
    bp.add_argument("--models", nargs="+", choices=["smollm2", "minilm"], help="default: both (--quick: minilm)")
    bp.add_argument("--bits", type=integer(2, 8), nargs="+", help="default: 4 3 2 (--quick: 3)")
    bp.set_defaults(func=cmd_bench_ptq)
    bsen = command(bsub, "sensitivity", "does TPV predict what quantizing a layer costs? Each layer quantized on "
                   "its own against its prediction (rank correlation), and the whole model",
                   "hilt bench sensitivity --models minilm cnn --out report/", [OUTPUT])
    bsen.add_argument("--out", default="report", metavar="DIR",
                      help="folder for sensitivity_validation.json and .png")
    bsen.add_argument("--quick", action="store_true", help="fewer samples and layers (minilm and cnn: about a minute)")
    bsen.add_argument("--models", nargs="+", choices=["minilm", "cnn", "smollm2", "cim"],
                      help="cim: the CNN on a PCM chip a year after programming, layer by layer, and which "
                           "layers to keep digital (default: all; --quick: minilm cnn cim)")
    bsen.set_defaults(func=cmd_bench_sensitivity)
    bdec = command(bsub, "decode", "CPU decode of a language model (SmolLM2, Gemma 3, yours) through transformers' "
                   "from_pretrained: hilt's int4, "
                   "k-means 2/3/4-bit, binary and compensated folders against the dense bf16 model, transformers' own "
                   "GGUF loading and llama.cpp where built; tokens/s, load memory, one-layer GEMV GB/s against copy "
                   "bandwidth (needs hilt[hf])", "hilt bench decode --out bench/results", [OUTPUT])
    bdec.add_argument("--quick", action="store_true", help="a tiny random Llama, dense and k-means 4-bit, 4 tokens, "
                      "one GEMV row: checks the pipeline in seconds, not the speeds")
    bdec.add_argument("--model", default="smollm2", help="smollm2 (default; adds hilt's own Llama runner), gemma3 "
                      "or a Hugging Face causal-LM folder")
    bdec.add_argument("--threads", type=POSITIVE, default=2, help="torch threads (default 2)")
    bdec.add_argument("--tokens", type=POSITIVE, help="new tokens per timed generate (default 64; --quick 4)")
    bdec.add_argument("--repeats", type=POSITIVE, help="timed generates per model, the median kept (default 5; --quick 1)")
    bdec.add_argument("--formats", type=decode_formats, metavar="LIST",
                      help="comma-separated quantized rows to time (default all): " + ", ".join(DECODE_NAMES))
    bdec.add_argument("--work", metavar="DIR", help="where the converted and quantized folders go while it runs")
    bdec.add_argument("--out", metavar="DIR", help="write decode.json and decode.md there")
    bdec.set_defaults(func=cmd_bench_decode)
    bmix = command(bsub, "mixed", "mixed precision under a bits budget: uniform, llama.cpp's rule, HAWQ and TPV "
                   "allocations at 2.5/3/3.5/4.25 bits/weight on SmolLM2 and MiniLM",
                   "hilt bench mixed --out report/", [OUTPUT])
    bmix.add_argument("--out", default="report", metavar="DIR", help="folder for mixed.json, mixed.md, mixed.png")
    bmix.add_argument("--quick", action="store_true", help="MiniLM at 3 bits/weight on fewer sentences, one Hutchinson "
                      "probe a sample")
    bmix.add_argument("--models", nargs="+", choices=["smollm2", "minilm"], help="default: both (--quick: minilm)")
    bmix.add_argument("--budgets", type=POSITIVE_NUMBER, nargs="+", metavar="BITS",
                      help="default: 2.5 3 3.5 4.25 (--quick: 3)")
    bmix.set_defaults(func=cmd_bench_mixed)
