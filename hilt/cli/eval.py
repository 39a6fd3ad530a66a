from __future__ import annotations

from hilt.cli.common import OUTPUT, POSITIVE, command, group, integer, name_list
from hilt.cli.output import write_json_option


def _task_names() -> tuple:
    from hilt.tasks.downstream import TASKS

    return tuple(TASKS)


task_list = name_list(_task_names, "a task", "tasks")  # --tasks: names from hilt.tasks.downstream.TASKS


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


def cmd_eval_tasks(args) -> int:
    from hilt.tasks import downstream, evaluate

    tasks = args.tasks.split(",") if args.tasks else None
    result = evaluate.tasks_run(args.model, quantized=args.quantized, tasks=tasks, quick=args.quick,
                                reference=args.reference, progress=True)
    label = result["quantized"] or f"{args.model}'s weights as stored"
    print(f"{label} on {result['items']}:")
    print(downstream.render(result["tasks"], result["reference"]))
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
    ta = command(esub, "tasks", "downstream tasks of a causal LM on a Shakespeare play nothing in hilt tunes on: "
                 "pick the next line of four, complete a line's last word, continue a passage; each score with its "
                 "bootstrap interval and chance level", "hilt eval tasks smollm2 --quick\n"
                 "  hilt eval tasks smollm2 --quantized out-3bit\n  hilt eval tasks gemma3 --tasks next_line,cloze",
                 [OUTPUT])
    ta.add_argument("model", nargs="?", default="smollm2",
                    help="smollm2 or gemma3 (the packaged models), a GGUF path, or a Hugging Face causal-LM folder")
    ta.add_argument("--quantized", metavar="DST", help="hilt checkpoint made from MODEL by `hilt quantize`")
    ta.add_argument("--tasks", metavar="LIST", type=task_list,
                    help="comma-separated, of next_line, cloze, continuation (default: all three)")
    ta.add_argument("--quick", action="store_true", help="60, 60 and 30 items, spread over the play (under a minute)")
    ta.add_argument("--reference", metavar="MODEL", help="float model (same tokenizer) whose own continuations the "
                    "continuation task compares with (default: MODEL itself under --quantized)")
    ta.set_defaults(func=cmd_eval_tasks)
    em = command(esub, "embed", "cosine similarity of sentence embeddings (masked mean, normalised) of a quantized "
                 "encoder against its fp32 model: MiniLM (default) or any Hugging Face encoder folder",
                 "hilt eval embed minilm --quantized minilm-2bit", [OUTPUT])
    em.add_argument("model", nargs="?", default="minilm",
                    help="'minilm' (the packaged model), its folder, or a Hugging Face encoder folder")
    em.add_argument("--quantized", metavar="DST")
    em.add_argument("--sentences", type=POSITIVE, default=256, help="sentences from Hamlet to embed (default 256)")
    em.set_defaults(func=cmd_eval_embed)
