"""The `hilt` command: parses arguments, calls the packages, prints.

Every user mistake arrives as a HiltError and is printed as one line on
stderr with a non-zero exit (the traceback only with --debug).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hilt.errors import HiltError

EXIT_ERROR, EXIT_INTERRUPTED = 1, 130


def _write_json(path: str, obj) -> None:
    """Write JSON atomically: a temporary name, renamed when complete."""
    target = Path(path)
    if not target.parent.is_dir():
        raise HiltError(f"{target}: folder {target.parent} does not exist")
    tmp = target.with_name(target.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise HiltError(f"{target}: cannot write ({e.strerror})") from None


def _write_outputs(args, result, plot=None) -> None:
    """--json (atomic) and, where the command has one, --plot FILE drawn by ``plot(result, path)``."""
    if args.json:
        _write_json(args.json, result)
    if plot is not None and args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")


_COMMON = argparse.ArgumentParser(add_help=False)
# SUPPRESS: a subcommand's default must not undo `hilt --debug CMD`
_COMMON.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def _float_pair(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX such as 0.1,0.6, got {text!r}") from None
    return lo, hi


def _parser_with_example(sub, name, help_text, example):
    return sub.add_parser(name, help=help_text, description=help_text, parents=[_COMMON],
                          epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)


# ------------------------------------------------------------------ quantize


def cmd_quantize(args) -> int:
    from hilt.quant import QuantConfig, open_source, quantize_checkpoint
    from hilt.quant.checkpoint import select_targets
    from hilt.quant.quantize import check_quantizable, expected_bits_per_weight

    method = "int-asym" if args.method == "int" and args.asymmetric else args.method
    if args.asymmetric and args.method != "int":
        raise HiltError("--asymmetric applies to --method int only")
    config = QuantConfig(method=method, bits=args.bits, block_size=args.block_size, codebook=args.codebook,
                         solver=args.solver, seed=args.seed).validate()
    if args.dry_run:
        with open_source(args.src) as source:
            targets = select_targets(source, args.only, args.ignore)
            rows = []
            for name in targets:
                check_quantizable(name, source.shape(name), config)
                rows.append({"name": name, "shape": list(source.shape(name)),
                             "bits_per_weight": round(expected_bits_per_weight(source.shape(name), config), 4)})
            kept = len(source.names()) - len(targets)
        for r in rows:
            print(f"would quantize {r['name']:<48} {str(tuple(r['shape'])):>14}  {r['bits_per_weight']:.3f} bits/weight")
        print(f"{len(rows)} tensors to quantize, {kept} kept as they are; nothing written (--dry-run)")
        if args.json:
            _write_json(args.json, {"dry_run": True, "tensors": rows})
        return 0

    from tqdm import tqdm

    records = []

    def on_tensor(entry):
        if entry["kind"] == "quantized":
            records.append({"name": entry["name"], "bits_per_weight": entry["bits_per_weight"],
                            "rel_error": entry["rel_error"], "shape": entry["shape"]})
            if not args.quiet:
                tqdm.write(f"{entry['name']:<48} {entry['bits_per_weight']:7.3f} bits/weight  "
                           f"rel. error {entry['rel_error']:.4f}")

    header = quantize_checkpoint(args.src, args.dst, config, only=args.only, ignore=args.ignore,
                                 overwrite=args.overwrite, resume=args.resume, importance=args.importance,
                                 shard_bytes=int(args.shard_size * (1 << 20)), on_tensor=on_tensor,
                                 progress=not args.quiet and sys.stderr.isatty())
    totals = header["totals"]
    size = sum((Path(args.dst) / s).stat().st_size for s in header["shards"])
    print(f"wrote {args.dst}: {totals['quantized_tensors']} of {totals['tensors']} tensors quantized "
          f"({config.method}, {config.bits} bits, block {config.block_size}), "
          f"{totals['bits_per_weight']:.3f} bits/weight on quantized tensors, "
          f"mean rel. error {totals['rel_error_mean']:.4f}, {size / 1e6:.1f} MB")
    if args.json:
        # resumed runs report tensors quantized earlier from the header
        done = {r["name"] for r in records}
        for name, e in header["tensors"].items():
            if e["kind"] == "quantized" and name not in done:
                records.append({"name": name, "bits_per_weight": e["bits_per_weight"],
                                "rel_error": e["rel_error"], "shape": e["shape"]})
        _write_json(args.json, {"dst": str(args.dst), "config": header["config"], "tensors": records,
                                "totals": {**totals, "bytes": size}})
    return 0


# ------------------------------------------------------------------- inspect


def cmd_inspect(args) -> int:
    from hilt.quant import read_header

    h = read_header(args.dst)
    dst = Path(args.dst)
    size = sum((dst / s).stat().st_size for s in h["shards"] if (dst / s).exists())
    c = h["config"]
    t = h["totals"]
    print(f"{dst}: {h['format']} v{h['format_version']} (written by hilt {h['tool_version']})")
    print(f"source      {h['source']['path']} ({h['source']['format']})")
    print(f"method      {c['method']}, {c['bits']} bits, block {c['block_size']}, codebook per {c['codebook']}")
    print(f"tensors     {t['tensors']} ({t['quantized_tensors']} quantized, {t['quantized_weights']:,} weights)")
    print(f"bits/weight {t['bits_per_weight']:.4f} on quantized tensors (codes + scales + codebooks)")
    print(f"size        {size / 1e6:.2f} MB in {len(h['shards'])} shard(s)")
    if args.tensors:
        for name, e in h["tensors"].items():
            if e["kind"] == "quantized":
                print(f"  {name:<48} {str(tuple(e['shape'])):>14} {e['bits_per_weight']:7.3f} b/w  err {e['rel_error']:.4f}")
            else:
                print(f"  {name:<48} {str(tuple(e['shape'])):>14} {e['dtype']} (kept)")
    if args.json:
        _write_json(args.json, {**h, "bytes": size})
    return 0


# ---------------------------------------------------------------------- eval


def cmd_eval_ppl(args) -> int:
    from hilt.bench.tasks import evaluate

    result = evaluate.perplexity_run(args.model, quantized=args.quantized, text=args.text, tokens=args.tokens,
                                     context=args.context, progress=sys.stderr.isatty())
    label = args.quantized or "unquantized"
    print(f"perplexity {result['perplexity']:.3f} over {result['tokens']} tokens "
          f"(context {result['context']}) of {result['text']} — {label}")
    if args.json:
        _write_json(args.json, result)
    return 0


def cmd_eval_embed(args) -> int:
    from hilt.bench.tasks import evaluate

    result = evaluate.embedding_run(args.model, quantized=args.quantized, sentences=args.sentences)
    label = args.quantized or "unquantized"
    print(f"mean cosine similarity to fp32 embeddings {result['cosine_similarity']:.5f} "
          f"(min {result['cosine_similarity_min']:.5f}) over {result['sentences']} sentences — {label}")
    if args.json:
        _write_json(args.json, result)
    return 0


# ------------------------------------------------------------------- report


def cmd_report(args) -> int:
    from hilt.bench import report

    summary = report.run(out=args.out, quick=args.quick)
    if args.json:
        _write_json(args.json, summary)
    return 0


def cmd_calibrate(args) -> int:
    from hilt.bench.tasks.calibrate import calibrate

    r = calibrate(args.model, args.out, work=args.work, tokens=args.tokens, sentences=args.sentences,
                  overwrite=args.overwrite)
    print(f"wrote {r['out']}: input importance of {r['layers']} linear layers from {r['calibration']}")
    return 0


def cmd_train(args) -> int:
    from hilt.bench.tasks.train import train_run
    from hilt.cim_sim.training import NoisyTraining

    defaults = NoisyTraining()
    eta_min, eta_max = args.eta_range or (defaults.eta_min, defaults.eta_max)
    training = NoisyTraining(method=args.method, noise_model=args.noise_model,
                             eta=defaults.eta if args.eta is None else args.eta,
                             eta_min=eta_min, eta_max=eta_max,
                             copies=defaults.copies if args.copies is None else args.copies,
                             weighting=args.weighting)
    r = train_run(args.workload, training=training, epochs=args.epochs, seed=args.seed, out=args.out,
                  progress=sys.stderr.isatty(), overwrite=args.overwrite)
    print(f"{args.workload} ({args.method}): test accuracy {r['test_accuracy']:.4f} after {r['epochs']} epochs, "
          f"{r['train_seconds']:.0f} s" + (f"; wrote {args.out}" if args.out else ""))
    if args.json:
        _write_json(args.json, r)
    return 0


def cmd_drift(args) -> int:
    from hilt.bench.tasks import drift

    result = drift.drift_study(args.workload, args.checkpoint, args.preset, args.times, args.repeats, args.gdc,
                             args.test_images, progress=sys.stderr.isatty())
    _write_outputs(args, result, drift.plot_drift)
    return 0


def cmd_energy(args) -> int:
    from hilt.bench.tasks import energy

    result = energy.run(args.workload, args.checkpoint, args.preset, args.adc_bits, args.dac_bits, args.gpu_batch,
                        sweep=args.sweep)
    _write_outputs(args, result, energy.plot)
    return 0


def cmd_export_onnx(args) -> int:
    from hilt.bench.tasks import export

    src = Path(args.src)
    if (src / "hilt.json").is_file():
        if args.cim_preset:
            raise HiltError(f"{src} is a quantized checkpoint; --cim-preset applies to workload checkpoints")
        result = export.export_quantized(src, args.out, overwrite=args.overwrite)
    elif src.suffix == ".safetensors" and src.is_file():
        from hilt.bench.tasks.train import load_workload

        _, meta = load_workload(src)
        result = export.export_cim(meta["workload"], src, args.out, args.cim_preset or "pcm", args.time,
                                   seed=args.seed, gdc=args.gdc, overwrite=args.overwrite)
    else:
        raise HiltError(f"{src}: expected a hilt quantized checkpoint folder (from `hilt quantize`) or a workload "
                        f"checkpoint .safetensors (from `hilt train`)")
    if args.json:
        _write_json(args.json, result)
    return 0


def cmd_fp8_scales(args) -> int:
    from hilt.bench.studies import fp8_scales

    result = fp8_scales.run(args.model)
    if args.json:
        _write_json(args.json, result)
    return 0


def cmd_fp8_transient(args) -> int:
    from hilt.bench.studies import fp8_transient

    result = fp8_transient.study(quick=args.quick, seed=args.seed)
    _write_outputs(args, result, fp8_transient.plot)
    return 0


def cmd_fp8_attention(args) -> int:
    from hilt.bench.studies import fp8_accuracy

    result = fp8_accuracy.run(tokens=args.tokens)
    _write_outputs(args, result)
    return 0


def cmd_bench_attention(args) -> int:
    from hilt.bench.perf import attention_speed

    result = attention_speed.run()
    _write_outputs(args, result)
    if result["mismatches"]:  # saved above with the timings of the other configurations
        bad = ", ".join(f"T={m['seq']}{' causal' if m['causal'] else ''} (cosine {m['cosine_vs_bf16']:.4f})"
                        for m in result["mismatches"])
        raise HiltError(f"FP8 attention differs from bf16 SDPA (cosine < {attention_speed.MIN_COSINE}) at {bad}")
    return 0


def cmd_bench_cim(args) -> int:
    from hilt.bench.perf import cim_speed

    result = cim_speed.speed()
    if args.json:
        _write_json(args.json, result)
    return 0


def cmd_bench_robustness(args) -> int:
    from hilt.bench.studies import robustness

    result = robustness.study(quick=args.quick)
    _write_outputs(args, result, robustness.plot)
    if args.markdown:
        Path(args.markdown).write_text(robustness.render(result))
        print(f"wrote {args.markdown}")
    return 0


def cmd_qat(args) -> int:
    from hilt.bench.tasks import qat_finetune

    if args.model != "smollm2":
        raise HiltError(f"QAT fine-tuning knows the packaged 'smollm2', not {args.model!r}")
    result = qat_finetune.finetune(args.dst, args.method, args.bits, args.block_size, args.steps, args.lr, args.batch,
                                   args.context, args.refit_every, args.save_every, args.seed, args.resume,
                                   args.overwrite, args.only, learn_codebook=args.learn_codebook,
                                   progress=sys.stderr.isatty())
    _write_outputs(args, result)
    return 0


def cmd_bench_qat(args) -> int:
    from hilt.bench.studies import qat_scaling

    result = qat_scaling.study(quick=args.quick, seeds=args.seeds, lr=args.lr, learn_codebook=args.learn_codebook)
    _write_outputs(args, result, qat_scaling.plot)
    return 0


def cmd_bench_quantize(args) -> int:
    from hilt.bench.perf import quantize_speed

    argv = ["--quick"] if args.quick else []
    argv += ["--json", args.json] if args.json else []
    return quantize_speed.main(argv)


def cmd_bench_kernels(args) -> int:
    from hilt.bench.perf import lut_kernels

    flags = (("--check", args.check), ("--timings", args.timings), ("--all", args.all), ("--decode", args.decode),
             ("--quick", args.quick), ("--cuda-graphs", args.cuda_graphs), ("--sass", args.sass))
    argv = [flag for flag, on in flags if on]
    for option, value in (("--smollm2", args.smollm2), ("--json", args.json), ("--plot", args.plot),
                          ("--table", args.table)):
        argv += [option, value] if value else []
    return lut_kernels.main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hilt", description="hilt: low-precision inference, from checkpoint to hardware.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    q = _parser_with_example(sub, "quantize", "quantize a checkpoint (safetensors file or folder, GGUF)",
                             "hilt quantize model.safetensors out-2bit --method kmeans --bits 2")
    q.add_argument("src", help="safetensors file, Hugging Face-style folder, or GGUF file")
    q.add_argument("dst", help="output folder (hilt format: safetensors shards + hilt.json)")
    q.add_argument("--method", choices=["kmeans", "int", "binary"], default="kmeans",
                   help="kmeans codebook (default), integer grid, or sign x absmean (1 bit)")
    q.add_argument("--bits", type=int, default=4, help="bits per code, 1-8 (default 4)")
    q.add_argument("--block-size", type=int, default=64, help="weights per scale along the input dim (default 64)")
    q.add_argument("--codebook", choices=["layer", "block"], default="layer", help="kmeans: one codebook per layer or per block")
    q.add_argument("--solver", choices=["optimal", "lloyd"], default="optimal",
                   help="kmeans: certified-optimal DP (default) or k-means++ + Lloyd")
    q.add_argument("--asymmetric", action="store_true", help="int: min/max grid with a per-block offset")
    q.add_argument("--importance", metavar="FILE",
                   help="kmeans: per-column importance from `hilt calibrate` (weights the k-means error)")
    q.add_argument("--only", metavar="RE", help="quantize only 2-D tensors whose name matches RE")
    q.add_argument("--ignore", metavar="RE", help="keep tensors whose name matches RE unquantized")
    q.add_argument("--dry-run", action="store_true", help="list what would be quantized; write nothing")
    q.add_argument("--resume", action="store_true", help="continue an interrupted run (DST.partial)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing DST (only once the new one is complete)")
    q.add_argument("--shard-size", type=float, default=256, metavar="MB",
                   help="output shard size (default 256 MB; memory holds one shard)")
    q.add_argument("--seed", type=int, default=0, help="seed for k-means++ (--solver lloyd)")
    q.add_argument("--json", metavar="FILE", help="write per-tensor results and totals as JSON")
    q.add_argument("--quiet", action="store_true", help="no per-tensor lines or progress bar")
    q.set_defaults(func=cmd_quantize)

    i = _parser_with_example(sub, "inspect", "show what is in a quantized checkpoint", "hilt inspect out-2bit --tensors")
    i.add_argument("dst")
    i.add_argument("--tensors", action="store_true", help="one line per tensor")
    i.add_argument("--json", metavar="FILE")
    i.set_defaults(func=cmd_inspect)

    c = _parser_with_example(sub, "calibrate", "per-column input importance of every linear layer, from real text",
                             "hilt calibrate smollm2 --out smollm2-importance.safetensors")
    c.add_argument("model", nargs="?", default="smollm2", help="'smollm2', 'minilm', a GGUF path or a MiniLM folder")
    c.add_argument("--out", required=True, metavar="FILE", help="safetensors file to write")
    c.add_argument("--work", default="macbeth", help="Shakespeare work to calibrate on (default macbeth)")
    c.add_argument("--tokens", type=int, default=2048, help="tokens for a causal LM (default 2048)")
    c.add_argument("--sentences", type=int, default=256, help="sentences for an encoder (default 256)")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    t = _parser_with_example(sub, "train", "train a Fashion-MNIST workload (MLP or CNN) and save a safetensors checkpoint",
                             "hilt train --workload cnn --out cnn.safetensors")
    t.add_argument("--workload", required=True, help="mlp or cnn")
    t.add_argument("--method", default="standard",
                   help="standard, noise (noise injection at --eta) or dwp (--copies noisy copies over --eta-range, "
                        "samples weighted by their disagreement)")
    t.add_argument("--noise-model", default="mismatch", help="the noise trained under: mismatch, pcm or rram")
    t.add_argument("--eta", type=float, help="noise: the mismatch level (default 0.3)")
    t.add_argument("--eta-range", type=_float_pair, metavar="MIN,MAX", help="dwp: the copies' levels (default 0.1,0.6)")
    t.add_argument("--copies", type=int, help="dwp: noisy copies per step (default 4)")
    t.add_argument("--weighting", default="js", help="dwp: disagreement measure js, error or none (default js)")
    t.add_argument("--epochs", type=int, help="epochs (default: the workload's)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", metavar="FILE", help="checkpoint to write (.safetensors)")
    t.add_argument("--overwrite", action="store_true")
    t.add_argument("--json", metavar="FILE")
    t.set_defaults(func=cmd_train)

    e = _parser_with_example(sub, "energy", "energy per inference on a CIM chip against a GPU, per layer",
                             "hilt energy --workload cnn --sweep --plot energy.png")
    e.add_argument("--workload", required=True, help="mlp or cnn")
    e.add_argument("--checkpoint", metavar="FILE", help="default: bench/results/WORKLOAD-standard.safetensors")
    e.add_argument("--preset", default="rram-22nm", help="chip energy constants: rram-22nm, sram-22nm, sram-5nm")
    e.add_argument("--adc-bits", type=int, help="ADC resolution (default 9, or the lowest that keeps accuracy with --sweep)")
    e.add_argument("--dac-bits", type=int, default=7)
    e.add_argument("--gpu-batch", type=int, default=256, help="batch over which the GPU reads its weights once")
    e.add_argument("--sweep", action="store_true",
                   help="first find the lowest ADC resolution within 1 point of the 9-bit accuracy (pcm, 1 s)")
    e.add_argument("--json", metavar="FILE")
    e.add_argument("--plot", metavar="FILE", help="PNG bar chart, per layer")
    e.set_defaults(func=cmd_energy)

    x = sub.add_parser("export", help="export to ONNX that onnxruntime runs", parents=[_COMMON])
    xsub = x.add_subparsers(dest="format", required=True)
    xo = _parser_with_example(xsub, "onnx", "a quantized MiniLM checkpoint, or a workload on CIM hardware frozen at a "
                              "time after programming, as ONNX (checked with onnx.checker and onnxruntime)",
                              "hilt export onnx minilm-4bit minilm-4bit.onnx\n"
                              "  hilt export onnx bench/results/cnn-standard.safetensors cnn-pcm-1y.onnx --time 1y")
    xo.add_argument("src", help="quantized checkpoint folder, or workload checkpoint .safetensors")
    xo.add_argument("out", help="the .onnx file to write")
    xo.add_argument("--cim-preset", help="workload checkpoints: the CIM preset (default pcm)")
    xo.add_argument("--time", default="1y", help="workload checkpoints: time after programming (default 1y)")
    xo.add_argument("--gdc", default="global", help="drift compensation: global, column, exact or none")
    xo.add_argument("--seed", type=int, default=0, help="which programmed chip")
    xo.add_argument("--overwrite", action="store_true")
    xo.add_argument("--json", metavar="FILE")
    xo.set_defaults(func=cmd_export_onnx)

    f8 = sub.add_parser("fp8", help="FP8 attention: logit bounds and scales from the weights", parents=[_COMMON])
    f8sub = f8.add_subparsers(dest="what", required=True)
    fs = _parser_with_example(f8sub, "scales", "per layer and head: the weight-only bound on |attention logit| "
                              "(spectral norm of W_Q,h^T W_K,g) against the largest observed on real text",
                              "hilt fp8 scales minilm --json minilm-fp8.json")
    fs.add_argument("model", help="minilm, smollm2, or a checkpoint: a llama GGUF file or a BERT directory "
                                  "(config.json, tokenizer.json, model.safetensors)")
    fs.add_argument("--json", metavar="FILE")
    fs.set_defaults(func=cmd_fp8_scales)
    ft = _parser_with_example(f8sub, "transient", "overflow of FP8 attention logits after a load, a resume and a "
                              "learning-rate spike, per scale recipe (fine-tuning a character GPT on Shakespeare)",
                              "hilt fp8 transient --quick --json transient.json --plot transient.png")
    ft.add_argument("--quick", action="store_true", help="shorter pretraining and fine-tuning (a few minutes)")
    ft.add_argument("--seed", type=int, default=0)
    ft.add_argument("--json", metavar="FILE")
    ft.add_argument("--plot", metavar="FILE", help="PNG: logits clipped per step, one panel per scenario")
    ft.set_defaults(func=cmd_fp8_transient)
    fa = _parser_with_example(f8sub, "attention", "accuracy of FP8 attention on real models: SmolLM2 perplexity and "
                              "MiniLM embeddings against float32", "hilt fp8 attention --json fp8_attention.json")
    fa.add_argument("--tokens", type=int, default=4096, help="tokens of Hamlet for the perplexity (default 4096)")
    fa.add_argument("--json", metavar="FILE")
    fa.set_defaults(func=cmd_fp8_attention)

    qa = _parser_with_example(sub, "qat", "quantization-aware fine-tuning of SmolLM2-135M, saved in the hilt quantize "
                              "format (resumable)", "hilt qat smollm2 smollm2-2bit-qat --bits 2 --steps 60")
    qa.add_argument("model", help="smollm2 (the packaged model)")
    qa.add_argument("dst", help="output folder (a hilt checkpoint, as `hilt quantize` writes)")
    qa.add_argument("--method", default="kmeans", choices=["kmeans", "int", "int-asym", "binary"])
    qa.add_argument("--bits", type=int, default=2)
    qa.add_argument("--block-size", type=int, default=64)
    qa.add_argument("--steps", type=int, default=60)
    qa.add_argument("--lr", type=float, default=1e-4)
    qa.add_argument("--batch", type=int, default=4, help="windows per step")
    qa.add_argument("--context", type=int, default=256, help="tokens per window")
    qa.add_argument("--learn-codebook", action=argparse.BooleanOptionalAction, default=True,
                    help="k-means: train the codebook levels by the loss after their fit (default), or only refit them")
    qa.add_argument("--refit-every", type=int, default=0,
                    help="k-means codebook refit interval in steps (default 0: never; the published procedure "
                         "with --no-learn-codebook refits every few thousand)")
    qa.add_argument("--save-every", type=int, default=10, help="steps between resumable training states")
    qa.add_argument("--seed", type=int, default=0)
    qa.add_argument("--only", metavar="REGEX", help="quantize only the Linear weights whose name matches")
    qa.add_argument("--resume", action="store_true", help="continue from DST.qat-state/")
    qa.add_argument("--overwrite", action="store_true")
    qa.add_argument("--json", metavar="FILE")
    qa.set_defaults(func=cmd_qat)

    d = _parser_with_example(sub, "drift", "accuracy on simulated CIM hardware over time after programming",
                             "hilt drift --workload cnn --preset pcm --times 1s,1h,1d,1mo,1y --repeats 5 --plot drift.png")
    d.add_argument("--workload", default="cnn", help="mlp or cnn (default cnn)")
    d.add_argument("--checkpoint", metavar="FILE", help="from `hilt train` (default: bench/results/WORKLOAD-standard.safetensors)")
    d.add_argument("--preset", default="pcm", help="ideal, pcm, pcm-hwa or rram (default pcm)")
    d.add_argument("--times", default="1s,1h,1d,1mo,1y", help="comma-separated times after programming")
    d.add_argument("--repeats", type=int, default=5, help="programmed chips (default 5)")
    d.add_argument("--gdc", default="global", choices=["global", "exact", "column", "none"],
                   help="drift compensation compared with none (default global)")
    d.add_argument("--test-images", type=int, default=10_000, help="test images per evaluation (default all 10000)")
    d.add_argument("--json", metavar="FILE")
    d.add_argument("--plot", metavar="FILE", help="PNG: accuracy against log time, bands over chips")
    d.set_defaults(func=cmd_drift)

    e = sub.add_parser("eval", help="evaluate a model, quantized or not", description="evaluate a model, quantized or not")
    esub = e.add_subparsers(dest="metric", required=True)
    pp = _parser_with_example(esub, "ppl", "perplexity of a Llama-architecture GGUF (SmolLM2-135M by default) on text",
                              "hilt eval ppl smollm2 --quantized out-2bit --tokens 2048")
    pp.add_argument("model", nargs="?", default="smollm2", help="'smollm2' (the packaged model) or a GGUF path")
    pp.add_argument("--quantized", metavar="DST", help="hilt checkpoint made from MODEL by `hilt quantize`")
    pp.add_argument("--text", metavar="FILE", help="UTF-8 text file (default: Shakespeare's Hamlet)")
    pp.add_argument("--tokens", type=int, default=2048, help="tokens to score (default 2048)")
    pp.add_argument("--context", type=int, default=512, help="window length (default 512)")
    pp.add_argument("--json", metavar="FILE")
    pp.set_defaults(func=cmd_eval_ppl)
    em = _parser_with_example(esub, "embed", "cosine similarity of MiniLM sentence embeddings against the fp32 model",
                              "hilt eval embed minilm --quantized minilm-2bit")
    em.add_argument("model", nargs="?", default="minilm", help="'minilm' (the packaged model) or its folder")
    em.add_argument("--quantized", metavar="DST")
    em.add_argument("--sentences", type=int, default=256, help="sentences from Hamlet to embed (default 256)")
    em.add_argument("--json", metavar="FILE")
    em.set_defaults(func=cmd_eval_embed)

    b = sub.add_parser("bench", help="benchmarks (ratios against baselines measured in the same run)",
                       description="benchmarks (ratios against baselines measured in the same run)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bq = _parser_with_example(bsub, "quantize", "quantization speed vs the published k-means procedure, and peak memory",
                              "hilt bench quantize --quick --json speed.json")
    bq.add_argument("--quick", action="store_true", help="4 reference tensors and a 1 GB memory checkpoint")
    bq.add_argument("--json", metavar="FILE")
    bq.set_defaults(func=cmd_bench_quantize)

    bk = _parser_with_example(bsub, "kernels", "LUT matmul kernels: correctness vs reference; GPU timings vs bf16 cuBLAS",
                              "hilt bench kernels --check")
    bk.add_argument("--check", action="store_true", help="the correctness check (on the CPU through Triton's "
                    "interpreter); without --check, --timings or --decode: the check, then timings on a GPU")
    bk.add_argument("--timings", action="store_true", help="GPU: the timings alone")
    bk.add_argument("--all", action="store_true", help="GPU: check, timings and SmolLM2 decode in one run")
    bk.add_argument("--decode", action="store_true", help="the SmolLM2 decode check alone (GPU: through the "
                    "kernel, CPU: through the reference)")
    bk.add_argument("--quick", action="store_true", help="fewer layer shapes")
    bk.add_argument("--cuda-graphs", action="store_true", help="GPU: also time both sides inside CUDA graphs "
                    "(no launch overhead; weights cycled so they come from memory, not L2)")
    bk.add_argument("--smollm2", metavar="GGUF", help="SmolLM2 GGUF for the decode check of --all or --decode "
                    "(default: the packaged one)")
    bk.add_argument("--json", metavar="FILE")
    bk.add_argument("--plot", metavar="PNG", help="speedup against M per layer shape and bit width (of the timings, "
                    "or of --table's file)")
    bk.add_argument("--table", metavar="JSON", help="print the markdown table of a results file (no new run)")
    bk.add_argument("--sass", action="store_true", help="no GPU needed: compile the tuning configurations for sm_90 "
                    "and report registers, spills and main-loop instructions per weight (with --quick: a few)")
    bk.set_defaults(func=cmd_bench_kernels)

    ba = _parser_with_example(bsub, "attention", "FP8 attention kernel against bf16 flash SDPA (GPU only), "
                              "sequences 1k-16k, head dim 128", "hilt bench attention --json attention-gpu.json")
    ba.add_argument("--json", metavar="FILE")
    ba.set_defaults(func=cmd_bench_attention)

    bc = _parser_with_example(bsub, "cim", "CIM simulator speed: each preset against the digital forward (batch 256)",
                              "hilt bench cim --json cim_speed.json")
    bc.add_argument("--json", metavar="FILE")
    bc.set_defaults(func=cmd_bench_cim)
    br = _parser_with_example(bsub, "robustness",
                              "standard vs noise-injection vs DWP training on the CNN: mismatch sweep, a year of PCM "
                              "drift, DWP ablation", "hilt bench robustness --quick --json robustness.json --plot robustness.png")
    br.add_argument("--quick", action="store_true", help="small budget (under 5 minutes on 2 cores)")
    br.add_argument("--json", metavar="FILE")
    br.add_argument("--plot", metavar="FILE", help="PNG: accuracy against mismatch level and over a year of drift")
    br.add_argument("--markdown", metavar="FILE", help="the tables as Markdown")
    br.set_defaults(func=cmd_bench_robustness)

    bqat = _parser_with_example(bsub, "qat", "QAT from scratch on Shakespeare: widths x bits {1,2,4,16} x {kmeans,int}, "
                                "loss against weight memory, gamma fits, memory-matched winners",
                                "hilt bench qat --quick --json qat_scaling.json --plot qat_scaling.png")
    bqat.add_argument("--quick", action="store_true", help="two widths, shorter training (under 10 minutes on 2 cores)")
    bqat.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 2 (--quick: 0)")
    bqat.add_argument("--learn-codebook", action=argparse.BooleanOptionalAction, default=True,
                      help="k-means codebooks trained by the loss after their fit (default), or refitted by k-means")
    bqat.add_argument("--lr", type=float, default=None, help="peak learning rate for every width (default: per width, "
                      "bench/qat_scaling.py's LR_BY_WIDTH: 9e-3 at widths 64 and 96, 6e-3 at 128)")
    bqat.add_argument("--json", metavar="FILE")
    bqat.add_argument("--plot", metavar="FILE", help="PNG: validation loss against weight memory")
    bqat.set_defaults(func=cmd_bench_qat)

    r = _parser_with_example(sub, "report", "the end-to-end run on the embedded defaults (real models): quantization, "
                             "LUT kernels, FP8 attention, CIM drift, DWP robustness, energy, ONNX; writes DIR/report.md",
                             "hilt report --out report/")
    r.add_argument("--out", default="report", help="output folder (default ./report)")
    r.add_argument("--quick", action="store_true", help="smaller budgets everywhere (about 10 minutes on 2 cores)")
    r.add_argument("--json", metavar="FILE")
    r.set_defaults(func=cmd_report)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except HiltError as e:
        if args.debug:
            raise
        print(f"hilt: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if args.debug:
            raise
        hint = " (run the same command with --resume to continue)" if args.command == "quantize" else ""
        print(f"hilt: interrupted{hint}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
