from __future__ import annotations

from hilt.cli.common import OUTPUT, POSITIVE, command, group, integer
from hilt.cli.output import write_json_option


def cmd_eval_ppl(args) -> int:
    from hilt.tasks import evaluate

    result = evaluate.perplexity_run(args.model, quantized=args.quantized, text=args.text, tokens=args.tokens,
                                     context=args.context, progress=True)
    label = result["quantized"] or f"{args.model}'s weights as stored"
    print(f"perplexity {result['perplexity']:.3f} over {result['tokens']} tokens "
          f"(context {result['context']}) of {result['text']} — {label}")
    write_json_option(args, result)
    return 0


def cmd_eval_embed(args) -> int:
    from hilt.tasks import evaluate

    result = evaluate.embedding_run(args.model, quantized=args.quantized, sentences=args.sentences)
    label = args.quantized or f"{args.model}'s weights as stored"
    print(f"mean cosine similarity to fp32 embeddings {result['cosine_similarity']:.5f} "
          f"(min {result['cosine_similarity_min']:.5f}) over {result['sentences']} sentences — {label}")
    write_json_option(args, result)
    return 0


def register(sub) -> None:
    esub = group(sub, "eval", "evaluate a model, quantized or not", "metric")
    pp = command(esub, "ppl", "perplexity of a causal LM on text: SmolLM2-135M (default), a Llama GGUF, or any "
                 "Hugging Face folder (through transformers; hilt's quantized folders included)",
                 "hilt eval ppl smollm2 --quantized out-2bit --tokens 2048\n  hilt eval ppl gemma3\n  hilt eval ppl smol-hf-4bit", [OUTPUT])
    pp.add_argument("model", nargs="?", default="smollm2",
                    help="smollm2 or gemma3 (the packaged models), a GGUF path, or a Hugging Face causal-LM folder")
    pp.add_argument("--quantized", metavar="DST", help="hilt checkpoint made from MODEL by `hilt quantize`")
    pp.add_argument("--text", metavar="FILE", help="UTF-8 text file (default: Shakespeare's Hamlet)")
    pp.add_argument("--tokens", type=integer(2), default=2048, help="tokens to score (default 2048)")
    pp.add_argument("--context", type=integer(2), default=512, help="window length (default 512)")
    pp.set_defaults(func=cmd_eval_ppl)
    em = command(esub, "embed", "cosine similarity of sentence embeddings (masked mean, normalised) of a quantized "
                 "encoder against its fp32 model: MiniLM (default) or any Hugging Face encoder folder",
                 "hilt eval embed minilm --quantized minilm-2bit", [OUTPUT])
    em.add_argument("model", nargs="?", default="minilm",
                    help="'minilm' (the packaged model), its folder, or a Hugging Face encoder folder")
    em.add_argument("--quantized", metavar="DST")
    em.add_argument("--sentences", type=POSITIVE, default=256, help="sentences from Hamlet to embed (default 256)")
    em.set_defaults(func=cmd_eval_embed)
