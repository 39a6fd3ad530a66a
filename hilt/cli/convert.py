from __future__ import annotations

from hilt.cli.common import DENSE_DTYPES, OUTPUT, command
from hilt.cli.output import write_json_option


def cmd_convert(args) -> int:
    import torch

    from hilt.models.hf import gguf_to_hf

    dst = gguf_to_hf(args.src, args.dst, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in dst.iterdir() if f.is_file())
    print(f"wrote {dst}: a Hugging Face model folder ({args.dtype}), {size / 1e6:.1f} MB")
    write_json_option(args, {"src": str(args.src), "dst": str(dst), "dtype": args.dtype, "bytes": size})
    return 0


def register(sub) -> None:
    cv = command(sub, "convert", "a GGUF model as a Hugging Face model folder (config, weights, tokenizer) that "
                 "transformers and `hilt quantize` read; needs hilt[hf]", "hilt convert model.gguf model-hf", [OUTPUT])
    cv.add_argument("src", help="GGUF file (an architecture transformers reads from GGUF, e.g. llama)")
    cv.add_argument("dst", help="output folder")
    cv.add_argument("--dtype", choices=DENSE_DTYPES, default="bfloat16",
                    help="dtype of the weights (default bfloat16; GGUF block types are dequantized to it)")
    cv.add_argument("--overwrite", action="store_true")
    cv.set_defaults(func=cmd_convert)
