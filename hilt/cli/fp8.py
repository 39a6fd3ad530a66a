from __future__ import annotations

from hilt.cli.common import OUTPUT, PLOT, POSITIVE, SEED, command, group
from hilt.cli.output import write_json_option, write_outputs


def cmd_fp8_scales(args) -> int:
    from hilt.bench.studies import fp8_scales

    write_json_option(args, fp8_scales.run(args.model, args.tokens, args.context))
    return 0


def cmd_fp8_transient(args) -> int:
    from hilt.bench.studies import fp8_transient

    result = fp8_transient.study(quick=args.quick, seed=args.seed)
    write_outputs(args, result, fp8_transient.plot)
    return 0


def cmd_fp8_attention(args) -> int:
    from hilt.bench.studies import fp8_accuracy

    if args.model == "smollm2":
        write_json_option(args, fp8_accuracy.run(tokens=args.tokens))
    else:
        write_json_option(args, fp8_accuracy.causal_lm(args.model, tokens=args.tokens))
    return 0


def register(sub) -> None:
    f8sub = group(sub, "fp8", "FP8 attention: logit bounds and scales from the weights", "what")
    fs = command(f8sub, "scales", "per layer and head: the weight-only bound on |attention logit| "
                 "(spectral norm of W_Q,h^T W_K,g, or the q/k norms' gains) against the largest observed on real text",
                 "hilt fp8 scales minilm --json minilm-fp8.json", [OUTPUT])
    fs.add_argument("model", help="minilm, smollm2, gemma3, a GGUF file, a causal-LM folder or a BERT directory "
                                  "(config.json, tokenizer.json, model.safetensors)")
    fs.add_argument("--tokens", type=POSITIVE, default=1024,
                    help="a causal LM through transformers: Hamlet tokens to observe logits on (default 1024)")
    fs.add_argument("--context", type=POSITIVE, default=256, help="... in windows of this many tokens (default 256)")
    fs.set_defaults(func=cmd_fp8_scales)
    ft = command(f8sub, "transient", "overflow of FP8 attention logits after a load, a resume and a learning-rate "
                 "spike, per scale recipe (fine-tuning a character GPT on Shakespeare)",
                 "hilt fp8 transient --quick --json transient.json --plot transient.png", [OUTPUT, PLOT, SEED],
                 plot="logits clipped per step, one panel per scenario")
    ft.add_argument("--quick", action="store_true", help="shorter pretraining and fine-tuning (a few minutes)")
    ft.set_defaults(func=cmd_fp8_transient)
    fa = command(f8sub, "attention", "accuracy of FP8 attention on real models: SmolLM2 perplexity and MiniLM "
                 "embeddings against float32", "hilt fp8 attention --json fp8_attention.json\n  hilt fp8 attention --model gemma3 --tokens 1024", [OUTPUT])
    fa.add_argument("--model", default="smollm2", help="smollm2 (default, with MiniLM beside it), or any causal LM "
                    "transformers runs: gemma3, a GGUF file, a folder")
    fa.add_argument("--tokens", type=POSITIVE, default=4096, help="tokens of Hamlet for the perplexity (default 4096)")
    fa.set_defaults(func=cmd_fp8_attention)
