from __future__ import annotations

from pathlib import Path

from hilt.cli.common import CIM_PRESETS, DRIFT_COMPENSATION, OUTPUT, SEED, command, group
from hilt.cli.output import write_json_option
from hilt.errors import HiltError


def cmd_export_onnx(args) -> int:
    from hilt.tasks import export

    src = Path(args.src)
    if not src.exists():
        raise HiltError(f"{src}: no such file or folder")
    if src.is_dir():  # a quantized folder: hilt's own, or as transformers' save_pretrained wrote it again
        if args.cim_preset:
            raise HiltError(f"{src} is a quantized checkpoint; --cim-preset applies to workload checkpoints")
        result = export.export_quantized(src, args.out, overwrite=args.overwrite, packed_ops=not args.standard_ops)
    elif src.suffix == ".safetensors" and src.is_file():
        from hilt.tasks.train import load_workload

        if args.standard_ops:
            raise HiltError(f"{src} is a workload checkpoint; --standard-ops applies to quantized checkpoints")
        _, meta = load_workload(src)
        result = export.export_cim(meta["workload"], src, args.out, args.cim_preset or "pcm", args.time,
                                   seed=args.seed, gdc=args.gdc, overwrite=args.overwrite)
    else:
        raise HiltError(f"{src}: expected a hilt quantized checkpoint folder (from `hilt quantize`) or a workload "
                        f"checkpoint .safetensors (from `hilt train`)")
    write_json_option(args, result)
    return 0


def cmd_export_gguf(args) -> int:
    from hilt.quant.gguf_export import export_gguf

    r = export_gguf(args.src, args.out, overwrite=args.overwrite, dense=args.dense)
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(r["types"].items()))
    skipped = f"; {r['left_out']} tensors outside the text model left out" if r.get("left_out") else ""
    print(f"wrote {r['out']}: {r['architecture']}, {r['tensors']} tensors ({kinds}), {r['bytes'] / 1e6:.1f} MB; "
          f"metadata and tokenizer from {r['source']}{skipped}")
    write_json_option(args, r)
    return 0


def cmd_export_compressed_tensors(args) -> int:
    from hilt.quant.ct_export import export_compressed_tensors

    r = export_compressed_tensors(args.src, args.out, overwrite=args.overwrite)
    kinds = "; ".join(f"{w['num_bits']}-bit {'symmetric' if w['symmetric'] else 'asymmetric'} groups of "
                      f"{w['group_size']}" for w in r["groups"].values())
    print(f"wrote {r['out']}: {r['quantized_modules']} Linear weights {r['format']} ({kinds}), "
          f"{r['bytes'] / 1e6:.1f} MB; transformers and vLLM read it through compressed-tensors")
    write_json_option(args, r)
    return 0


def register(sub) -> None:
    xsub = group(sub, "export", "export to ONNX, GGUF or compressed-tensors", "format")
    xo = command(xsub, "onnx", "a quantized MiniLM checkpoint, or a workload on CIM hardware frozen at a time after "
                 "programming, as ONNX (checked with onnx.checker and onnxruntime)",
                 "hilt export onnx minilm-4bit minilm-4bit.onnx\n"
                 "  hilt export onnx hilt/models/trained/cnn-standard.safetensors cnn-pcm-1y.onnx --time 1y",
                 [OUTPUT, SEED])
    xo.add_argument("src", help="quantized checkpoint folder, or workload checkpoint .safetensors")
    xo.add_argument("out", help="the .onnx file to write")
    xo.add_argument("--cim-preset", choices=CIM_PRESETS, help="workload checkpoints: the CIM preset (default pcm)")
    xo.add_argument("--time", default="1y", help="workload checkpoints: time after programming (default 1y)")
    xo.add_argument("--gdc", default="global", choices=DRIFT_COMPENSATION, help="drift compensation (default global)")
    xo.add_argument("--standard-ops", action="store_true",
                    help="quantized checkpoints: standard operators only (any ONNX runtime): integer weights are "
                         "rebuilt by a subgraph like k-means, instead of ONNX Runtime's MatMulNBits (packed in the session)")
    xo.add_argument("--overwrite", action="store_true")
    xo.set_defaults(func=cmd_export_onnx)
    xg = command(xsub, "gguf", "a checkpoint of integer weights (4-bit and 8-bit int, 4-bit int-asym) as a GGUF "
                 "file llama.cpp reads (Q4_0, Q8_0, Q4_1), losslessly; metadata and tokenizer from its source GGUF, "
                 "or from the config and tokenizer.json of a Hugging Face Llama or Gemma 3 folder",
                 "hilt export gguf smol-int4 smol-int4.gguf\n  hilt export gguf gemma-hf-int4 gemma-int4.gguf", [OUTPUT])
    xg.add_argument("src", help="hilt checkpoint folder quantized from a GGUF file, or from a Hugging Face Llama or "
                    "Gemma 3 folder")
    xg.add_argument("out", help="the .gguf file to write")
    xg.add_argument("--overwrite", action="store_true")
    xg.add_argument("--dense", action="store_true",
                    help="every tensor as F32, the quantized ones dequantized: the same weights, which llama.cpp then "
                         "multiplies without rounding its activations to 8 bits (to compare with hilt exactly)")
    xg.set_defaults(func=cmd_export_gguf)
    xc = command(xsub, "compressed-tensors", "a checkpoint of int weights quantized from a Hugging Face folder as "
                 "a compressed-tensors folder (pack-quantized, llm-compressor's format, which vLLM serves); "
                 "needs hilt[ct]", "hilt export compressed-tensors smol-hf-int4 smol-ct-int4", [OUTPUT])
    xc.add_argument("src", help="hilt checkpoint folder quantized from a Hugging Face folder (int, 2-8 bits)")
    xc.add_argument("out", help="the folder to write")
    xc.add_argument("--overwrite", action="store_true")
    xc.set_defaults(func=cmd_export_compressed_tensors)
