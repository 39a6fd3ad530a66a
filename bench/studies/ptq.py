"""Post-training quantization against its peers, in one run: `hilt bench ptq`.

At 4, 3 and 2 bits with groups/blocks of 64, on SmolLM2-135M (perplexity on Hamlet) and
all-MiniLM-L6-v2 (mean cosine to fp32 on Hamlet sentences):

* ``int``: hilt's symmetric integer grid, each weight rounded on its own (round-to-nearest);
* ``hqq``: HQQ (the ``hqq`` package on the CPU, its default half-quadratic optimisation of the
  zero point and scale; asymmetric, fp16 scale and zero per group), when it is installed;
* ``kmeans`` and ``kmeans-imp``: hilt's k-means codebook, plain and weighted by input importance;
* ``gptq-int`` and ``gptq-kmeans``: the same two formats with error compensation
  (`hilt quantize --compensate`), run as the command line runs it, in a child process whose wall
  time, time split and peak memory are recorded.

SmolLM2's rows also carry downstream task scores (hilt.tasks.downstream, on :data:`TASK_COUNTS` items of
The Winter's Tale): next line, cloze, and the agreement of each format's greedy continuation with the
float model's own; the table ranks the methods at each width by perplexity and by each task.

Bits per weight are counted alike for all: codes + every stored scale, zero and codebook.
Calibration (importance and compensation) is Macbeth; evaluation is Hamlet. GPTQ itself from a
maintained package is not in the table: the maintained GPTQ packages quantize a transformers model
on a GPU (GPTQModel builds CUDA extensions; llm-compressor needs a transformers checkpoint), and
SmolLM2 ships here as GGUF. ``gptq-int`` is that algorithm on hilt's format.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hilt.atomic import write_json, write_text
from hilt.tasks import evaluate
from hilt.quant import QuantConfig, open_source, quantize_checkpoint
from hilt.quant.targets import select_targets
from hilt.progress import LOG



@dataclass(frozen=True)
class Recipe:
    """How a row of the study quantizes: a hilt format (None: HQQ's own quantizer), with calibrated
    importance weights, with error compensation (`hilt quantize --compensate`, GPTQ-style)."""

    format: str | None
    importance: bool = False
    compensate: bool = False


METHODS = {
    "int": Recipe("int"),
    "hqq": Recipe(None),
    "kmeans": Recipe("kmeans"),
    "kmeans-imp": Recipe("kmeans", importance=True),
    "gptq-int": Recipe("int", compensate=True),
    "gptq-kmeans": Recipe("kmeans", compensate=True),
}
GROUP = 64


def hqq_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("hqq") is not None


def hqq_weights(src, bits: int, group: int = GROUP, only: str | None = None) -> tuple[dict[str, torch.Tensor], float]:
    """HQQ's dequantized weights for the tensors `hilt quantize` would quantize (``only``: as its
    --only), and their bits/weight (codes + fp16 scale and zero per group)."""
    from hqq.core.quantize import Quantizer

    out = {}
    with open_source(src) as source:
        for name in select_targets(source, only=only):
            w = source.get(name).float()
            q, meta = Quantizer.quantize(w, nbits=bits, group_size=group, optimize=True, axis=1, bitpack=False,
                                         compute_dtype=torch.float32, device="cpu")
            out[name] = Quantizer.dequantize(q, meta).float().reshape(w.shape)
    return out, bits + 32 / group


def _child_quantize(src, dst, method: str, bits: int, extra: list[str]) -> dict:
    """`hilt quantize` in a child process: its result JSON, wall seconds and the child's own peak
    resident memory (os.wait4 reports it for that one process)."""
    report = Path(str(dst) + ".json")
    cmd = [sys.executable, "-m", "hilt", "-q", "quantize", str(src), str(dst), "--method", method, "--bits",
           str(bits), "--block-size", str(GROUP), "--overwrite", "--json", str(report), *extra]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        if child.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed: {err.read().decode(errors='replace').strip()}")
    result = json.loads(report.read_text())
    report.unlink()
    return {**result, "wall_seconds": round(seconds, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024)}


def _evaluate(model: str, quantized=None, tensors=None, tokens=2048, sentences=256) -> float:
    """Perplexity (smollm2) or mean cosine (minilm) of a hilt checkpoint or of replaced dense tensors."""
    if tensors is None:
        if model == "smollm2":
            return evaluate.perplexity_run(quantized=quantized, tokens=tokens)["perplexity"]
        return evaluate.embedding_run(quantized=quantized, sentences=sentences)["cosine_similarity"]
    from hilt.data.text import sentences as real_sentences
    from hilt.data.text import shakespeare_text

    if model == "smollm2":
        from hilt.models import llama

        net, tokenizer = llama.load_llama(tensors=tensors)
        return llama.perplexity(net, tokenizer.encode(shakespeare_text("hamlet"))[:tokens])
    from hilt.models import bert

    batch = real_sentences(sentences)
    ref_model, tokenizer = bert.load_minilm()
    used = set(ref_model.state_dict())  # the checkpoint's pooler is not part of the embedding model
    other, _ = bert.load_minilm(tensors={k: v for k, v in tensors.items() if k in used})
    return bert.embedding_similarity(bert.embed(ref_model, tokenizer, batch), bert.embed(other, tokenizer, batch))


def _smollm2_lm(quantized=None, tensors=None):
    """SmolLM2 as hilt.tasks.downstream scores it: float, with a hilt checkpoint over it, or with replaced tensors."""
    from hilt.models import llama
    from hilt.models.lm import CausalLM, lm_source

    net, tokenizer = llama.load_llama(tensors=tensors)
    if quantized is not None:
        from hilt.quant import load_quantized_

        load_quantized_(net, quantized, strict=False)
    return CausalLM(lm_source("smollm2"), net, tokenizer)


TASK_COUNTS = {"next_line": 120, "cloze": 120, "continuation": 60}  # items per task: about 1.5 minutes a row


def task_items() -> dict:
    from hilt.data.lm_tasks import load_items
    from hilt.tasks import downstream

    items = load_items()
    return {t: downstream.spread(items[t], TASK_COUNTS[t]) for t in downstream.TASKS}


def _tasks(lm, items: dict, reference: list[list[int]]) -> dict:
    """Next line, cloze, and agreement with the float model's continuation: {measure: score, interval, chance}."""
    from hilt.tasks import downstream

    scores = downstream.score_tasks(lm, items, reference=reference)
    out = {t: {**scores[t][downstream.MAIN[t][0]], "chance": scores[t][downstream.MAIN[t][1]]}
           for t in ("next_line", "cloze")}
    out["agreement"] = {**scores["continuation"]["agreement_prefix"], "chance": None}
    return out


TASK_MEASURES = {"next_line": "next line", "cloze": "cloze", "agreement": "agreement with fp32"}


MODELS = ("smollm2", "minilm")
# --quick quantizes MiniLM's first of six layers, with every method alike: the ranking of the
# methods is what the quick run checks, at a sixth of the quantization work
QUICK_ONLY = r"^encoder\.layer\.0\."
WIDTHS = (4, 3, 2)


def run(out="report", quick=False, models=None, widths=None) -> dict:
    """The study (see the module doc). ``quick``: MiniLM only, 3 bits, its first layer quantized
    (:data:`QUICK_ONLY`), 32 calibration and 16 evaluation sentences. ``models`` / ``widths`` choose a part of the grid. The JSON, table and plot are rewritten
    after every row, so a long run can be read (or stopped) at any point."""
    from hilt.models.bert import minilm_path
    from hilt.models.llama import smollm2_path
    from hilt.tasks.calibrate import calibrate

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"smollm2": smollm2_path, "minilm": minilm_path}
    models = {m: paths[m]() for m in (models or (("minilm",) if quick else MODELS))}
    widths = widths or ((3,) if quick else WIDTHS)
    tokens, sentences = 2048, (16 if quick else 256)
    calib = {"smollm2": ["--calibration-tokens", "4096"], "minilm": ["--calibration-sentences", "32" if quick else "256"]}
    methods = [m for m, recipe in METHODS.items() if recipe.format is not None or hqq_available()]
    if "hqq" not in methods:
        LOG.warning("hqq is not installed (DISABLE_CUDA=1 pip install --no-deps hqq termcolor einops): its rows are left out")
    only = QUICK_ONLY if quick else None
    rows = []
    target = out / ("ptq_quick.json" if quick else "ptq.json")

    def save() -> dict:
        result = {"quick": quick, "only": only, "group": GROUP, "tokens": tokens, "sentences": sentences,
                  "quality": {"smollm2": "perplexity on Hamlet (lower is better)",
                              "minilm": "mean cosine to fp32 on Hamlet sentences (higher is better)"},
                  "task_items": ", ".join(f"{n} {t}" for t, n in TASK_COUNTS.items()) + " items of The Winter's Tale",
                  "rows": rows, "verdicts": verdicts(rows), "rankings": rankings(rows)}
        write_json(target, result)
        write_text(out / "ptq.md", markdown(result))
        plot(result, target.with_suffix(".png"))
        return result

    for model, src in models.items():
        reference = _evaluate(model, tokens=tokens, sentences=sentences)
        rows.append({"model": model, "method": "fp32", "bits": 32, "bits_per_weight": 32.0, "quality": reference})
        if model == "smollm2":
            from hilt.tasks import downstream

            items = task_items()
            float_lm = _smollm2_lm()
            float_tokens = downstream.greedy_continuations(float_lm, items["continuation"])
            rows[-1]["tasks"] = _tasks(float_lm, items, float_tokens)
            del float_lm
        LOG.info(f"{model}: fp32 {reference:.4f}")
        importance = out / f"ptq-importance-{model}.safetensors"
        calibrate(model, importance, work="macbeth", overwrite=True, sentences=32 if quick else 256)
        for bits in widths:
            for method in methods:
                row = {"model": model, "method": method, "bits": bits}
                dst = out / f"ptq-{model}-{method}{bits}"
                start = time.perf_counter()
                recipe = METHODS[method]
                if recipe.format is None:
                    tensors, row["bits_per_weight"] = hqq_weights(src, bits, only=only)
                    row["quantize_seconds"] = round(time.perf_counter() - start, 1)
                    row["quality"] = _evaluate(model, tensors=tensors, tokens=tokens, sentences=sentences)
                    if model == "smollm2":
                        row["tasks"] = _tasks(_smollm2_lm(tensors=tensors), items, float_tokens)
                else:
                    fmt = recipe.format
                    if recipe.compensate:
                        extra = ["--compensate", *calib[model], *(["--only", only] if only else [])]
                        r = _child_quantize(src, dst, fmt, bits, extra)
                        row.update(quantize_seconds=r["wall_seconds"], peak_rss_mb=r["peak_rss_mb"],
                                   seconds_split=r["compensation"]["seconds"],
                                   calibration=r["compensation"]["calibration"])
                        row["bits_per_weight"] = r["totals"]["bits_per_weight"]
                    else:
                        header = quantize_checkpoint(src, dst, QuantConfig(method=fmt, bits=bits, block_size=GROUP),
                                                     overwrite=True, only=only,
                                                     importance=importance if recipe.importance else None).header
                        row["quantize_seconds"] = round(time.perf_counter() - start, 1)
                        row["bits_per_weight"] = header["totals"]["bits_per_weight"]
                    row["quality"] = _evaluate(model, quantized=dst, tokens=tokens, sentences=sentences)
                    if model == "smollm2":
                        row["tasks"] = _tasks(_smollm2_lm(quantized=dst), items, float_tokens)
                    shutil.rmtree(dst)
                rows.append(row)
                save()
                LOG.info(f"{model}: {method:>11} {bits} bit  {row['bits_per_weight']:.3f} b/w  {row['quality']:.4f}  "
                         f"({row['quantize_seconds']:.0f}s)")
        importance.unlink()
    result = save()
    LOG.info(f"wrote {target}, {out / 'ptq.md'}, {target.with_suffix('.png')}")
    return result


def _better(model: str, a: float, b: float) -> bool:
    return a < b if model == "smollm2" else a > b


def verdicts(rows) -> list[dict]:
    """Per model and width: does compensated k-means beat every peer at equal or more bits/weight, and
    does compensated int beat rounded int?"""
    out = []
    for model in sorted({r["model"] for r in rows}):
        for bits in sorted({r["bits"] for r in rows if r["model"] == model and r["bits"] < 32}):
            at = {r["method"]: r for r in rows if r["model"] == model and r["bits"] == bits}
            if "gptq-kmeans" not in at:
                continue
            best = at["gptq-kmeans"]
            peers = [r for m, r in at.items() if m != "gptq-kmeans" and r["bits_per_weight"] >= best["bits_per_weight"] - 1e-9]
            beaten = [r["method"] for r in peers if _better(model, best["quality"], r["quality"])]
            out.append({"model": model, "bits": bits, "gptq_kmeans_beats": beaten,
                        "gptq_kmeans_beats_all": len(beaten) == len(peers),
                        "gptq_int_beats_int": "gptq-int" in at and "int" in at
                        and _better(model, at["gptq-int"]["quality"], at["int"]["quality"])})
    return out


def rankings(rows) -> list[dict]:
    """Per model and width with task scores: the methods best first by perplexity and by each task measure, and
    whether each task's order is perplexity's."""
    out = []
    for bits in sorted({r["bits"] for r in rows if r["bits"] < 32 and "tasks" in r}):
        at = [r for r in rows if r["bits"] == bits and "tasks" in r]
        by = {"perplexity": [r["method"] for r in sorted(at, key=lambda r: r["quality"])]}
        for m in TASK_MEASURES:
            by[m] = [r["method"] for r in sorted(at, key=lambda r: -r["tasks"][m]["score"])]
        out.append({"model": "smollm2", "bits": bits, "ranking": by,
                    "agree": {m: by[m] == by["perplexity"] for m in TASK_MEASURES},
                    "same_best": {m: by[m][0] == by["perplexity"][0] for m in TASK_MEASURES}})
    return out


def _task_cell(t: dict | None) -> str:
    return "" if t is None else f"{t['score']:.3f} ({t['interval'][0]:.2f}-{t['interval'][1]:.2f})"


def markdown(result) -> str:
    lines = ["| model | method | bits | bits/weight | quality | " + " | ".join(TASK_MEASURES.values())
             + " | quantize s |", "|---|---|---|---|---|" + "---|" * len(TASK_MEASURES) + "---|"]
    for r in result["rows"]:
        q = f"{r['quality']:.2f}" if r["model"] == "smollm2" else f"{r['quality']:.4f}"
        tasks = [_task_cell(r.get("tasks", {}).get(m)) for m in TASK_MEASURES]
        lines.append(f"| {r['model']} | {r['method']} | {r['bits']} | {r['bits_per_weight']:.3f} | {q} | "
                     + " | ".join(tasks) + f" | {r.get('quantize_seconds', '')} |")
    lines += ["", "Quality: " + "; ".join(f"{m}: {d}" for m, d in result["quality"].items()), ""]
    fp32 = next((r for r in result["rows"] if r["method"] == "fp32" and "tasks" in r), None)
    if fp32 is not None:
        chance = fp32["tasks"]
        lines += [f"Tasks ({result.get('task_items', '')}; 95% intervals over items): next line and cloze as "
                  f"`hilt eval tasks` scores them (chance {chance['next_line']['chance']:.3f} and "
                  f"{chance['cloze']['chance']:.3f}); agreement with fp32: the share of 8 greedy tokens that match "
                  "fp32's own continuation before the first difference.", ""]
    for k in result.get("rankings", []):
        orders = "; ".join(f"by {name}: {' > '.join(k['ranking'][m])}" for m, name in
                           [("perplexity", "perplexity")] + list(TASK_MEASURES.items()))
        agree = ", ".join(f"{name} {'agrees' if k['agree'][m] else ('same best' if k['same_best'][m] else 'differs')}"
                          for m, name in TASK_MEASURES.items())
        lines.append(f"- {k['model']} {k['bits']} bit, best first: {orders} ({agree})")
    lines.append("")
    for v in result["verdicts"]:
        lines.append(f"- {v['model']} {v['bits']} bit: gptq-kmeans beats {', '.join(v['gptq_kmeans_beats']) or 'none'}"
                     f"{' (every peer)' if v['gptq_kmeans_beats_all'] else ''}; gptq-int beats int: "
                     f"{'yes' if v['gptq_int_beats_int'] else 'no'}")
    return "\n".join(lines) + "\n"


def plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    styles = {"int": "s--", "hqq": "D--", "kmeans": "o:", "kmeans-imp": "^:", "gptq-int": "s-", "gptq-kmeans": "o-"}
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["rows"] if r["model"] == model]
        for method, style in styles.items():
            pts = sorted((r for r in rows if r["method"] == method), key=lambda r: r["bits_per_weight"])
            if pts:
                ax.plot([r["bits_per_weight"] for r in pts], [r["quality"] for r in pts], style, label=method)
        fp32 = next(r for r in rows if r["method"] == "fp32")
        ax.axhline(fp32["quality"], color="gray", lw=1, ls=":", label="fp32")
        ax.set_xlabel("bits per weight (codes + scales + zeros + codebooks)")
        if model == "smollm2":
            ax.set_yscale("log")
            ax.set_ylabel("perplexity on Hamlet (lower is better)")
            ax.set_title("SmolLM2-135M")
        else:
            ax.set_ylabel("cosine to fp32 (higher is better)")
            ax.set_title("all-MiniLM-L6-v2")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
