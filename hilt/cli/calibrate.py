from __future__ import annotations

from hilt.cli.common import OUTPUT, POSITIVE, command
from hilt.cli.output import write_json_option


def cmd_calibrate(args) -> int:
    from hilt.tasks.calibrate import calibrate

    r = calibrate(args.model, args.out, work=args.work, tokens=args.tokens, sentences=args.sentences,
                  overwrite=args.overwrite)
    print(f"wrote {r['out']}: input importance of {r['layers']} linear layers from {r['calibration']}")
    write_json_option(args, r)
    return 0


def register(sub) -> None:
    c = command(sub, "calibrate", "per-column input importance of every linear layer, from real text",
                "hilt calibrate smollm2 --out smollm2-importance.safetensors", [OUTPUT])
    c.add_argument("model", nargs="?", default="smollm2", help="smollm2, gemma3, a GGUF path, a causal-LM folder, minilm or a BERT folder")
    c.add_argument("--out", required=True, metavar="FILE", help="safetensors file to write")
    c.add_argument("--work", default="macbeth", help="Shakespeare work to calibrate on (default macbeth)")
    c.add_argument("--tokens", type=POSITIVE, default=2048, help="tokens for a causal LM (default 2048)")
    c.add_argument("--sentences", type=POSITIVE, default=256, help="sentences for an encoder (default 256)")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=cmd_calibrate)
