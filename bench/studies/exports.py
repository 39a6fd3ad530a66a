"""Exports judged by llama.cpp: SmolLM2-135M quantized by hilt, exported with `hilt export gguf`, and
read by llama.cpp's own tools (built by scripts/build_llama_cpp.sh) next to hilt's reading of the same
file (hilt.tasks.llama_cpp.check_gguf): llama-perplexity's statistic on Hamlet both ways, the token
ids of the whole play, and the greedy continuation of a prompt.

Formats: int 4-bit (Q4_0), int-asym 4-bit (Q4_1), int 8-bit (Q8_0), blocks of 64, each with the
token embedding dense and in 8 bits (``--embeddings 8``, Q8_0). Then the same int4 checkpoint made
from a Hugging Face folder (`hilt convert --dtype float32`, quantized, exported with metadata and
vocabulary built from the folder), compared with the GGUF-sourced export tensor by tensor, and the same
folder as compressed-tensors read by transformers. Every llama.cpp row also gets llama-bench's decode rate
and peak resident memory. The int4 checkpoint is exported dense too (every tensor F32): llama.cpp then
rounds no activations and its greedy tokens must be hilt's outright; the effect of the rounding is measured
both in llama.cpp (its KL divergence from the dense file) and in hilt (simulate_llama_cpp_rounding).

    hilt bench exports [--quick] [--out bench/results]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from hilt.atomic import write_json, write_text
from hilt.progress import LOG

FORMATS = [("int4", "int", 4), ("int4-asym", "int-asym", 4), ("int8", "int", 8)]


def _kl_llama_cpp(quantized, dense, text_file, context, chunks) -> dict:
    """llama-perplexity's KL divergence of ``quantized`` from ``dense`` (the same weights), and how often
    their top tokens agree: the effect of llama.cpp's activation rounding, inside llama.cpp."""
    import re

    from hilt.tasks.llama_cpp import run_tool

    base = Path(str(dense) + ".kld")
    common = ["-f", text_file, "-c", context, "-b", context, "--chunks", chunks, "-t", 1, "-tb", 1, "--no-warmup",
              "--kl-divergence-base", base]
    try:
        run_tool("llama-perplexity", ["-m", dense, *common])
        text = "\n".join(run_tool("llama-perplexity", ["-m", quantized, *common, "--kl-divergence"]))
    finally:
        base.unlink(missing_ok=True)
    kld = re.search(r"Mean\s+KLD:\s+([0-9.]+)", text)
    top = re.search(r"Same top p:\s+([0-9.]+)", text)
    return {"mean_kld": float(kld.group(1)), "same_top": float(top.group(1)) / 100}


def _kl_hilt(net, gguf, ids, context, chunks) -> dict:
    """The same two numbers for hilt's forward with and without llama.cpp's rounding simulated, and how much
    the rounding moved the margin between the top two logits (what GREEDY_TOLERANCE is derived from)."""
    import torch
    import torch.nn.functional as F

    from hilt.tasks.llama_cpp import simulate_llama_cpp_rounding

    def logits():
        with torch.inference_mode():
            return torch.cat([net(torch.tensor(ids[c * context:(c + 1) * context])[None])[0, context // 2:-1].float()
                              for c in range(chunks)])

    a = logits()
    simulate_llama_cpp_rounding(net, gguf)
    b = logits()
    pa, pb = F.log_softmax(a, -1), F.log_softmax(b, -1)
    top2 = a.topk(2, -1).indices
    change = ((a.gather(1, top2) @ torch.tensor([1.0, -1.0])) - (b.gather(1, top2) @ torch.tensor([1.0, -1.0]))).abs()
    return {"mean_kld": float((pa.exp() * (pa - pb)).sum(-1).mean()),
            "same_top": float((a.argmax(-1) == b.argmax(-1)).float().mean()), "positions": len(a),
            "margin_change_max": float(change.max()), "margin_change_median": float(change.median())}


def _transformers_rows(folder, q, work, text) -> list[dict]:
    """hilt's quantized folder and its compressed-tensors export, both through transformers' from_pretrained:
    the logits on a Hamlet window, the size on disk and a greedy decode rate."""
    import torch
    import transformers

    import hilt  # noqa: F401  (registers hilt's quantizer with transformers)
    from hilt.quant.ct_export import export_compressed_tensors

    ct = work / "hf-int4-ct"
    export_compressed_tensors(q, ct, overwrite=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = tok(text[:4000], return_tensors="pt").input_ids[:, :512]
    rows, ref = [], None
    for label, path in [("hilt folder (transformers)", q), ("compressed-tensors (transformers)", ct)]:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.inference_mode():
            logits = model(ids).logits[0]
            start = time.perf_counter()
            model.generate(ids[:, :8], max_new_tokens=32, min_new_tokens=32, do_sample=False)
            rate = 32 / (time.perf_counter() - start)
        ref = logits if ref is None else ref
        rows.append({"variant": label, "consumer": "transformers", "bytes": sum(f.stat().st_size for f in Path(path).iterdir()),
                     "max_logit_diff_vs_hilt_folder": float((logits - ref).abs().max() / ref.abs().max()),
                     "tokens_per_s": rate})
        del model
    return rows


def _same_tensors(a, b) -> dict:
    import gguf
    import numpy as np

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    same = sum(1 for n in ta if n in tb and ta[n].tensor_type == tb[n].tensor_type
               and np.array_equal(np.asarray(ta[n].data).view(np.uint8), np.asarray(tb[n].data).view(np.uint8)))
    return {"tensors": len(ta), "byte_identical": same, "names_equal": set(ta) == set(tb)}


def run(out="bench/results", quick=False, work=None) -> dict:
    from hilt.data.text import shakespeare_text
    from hilt.models.llama import smollm2_path
    from hilt.quant import QuantConfig, quantize_checkpoint
    from hilt.quant.gguf_export import export_gguf
    from hilt.tasks.llama_cpp import check_gguf, llama_bench, missing_tools

    if out:
        from hilt.atomic import check_out_folder

        check_out_folder(out)  # before the benchmark's minutes, not after
    missing = missing_tools()
    if missing:
        raise SystemExit(f"llama.cpp tools missing ({', '.join(missing)}): run scripts/build_llama_cpp.sh")
    text, src = shakespeare_text("hamlet"), smollm2_path()
    work = Path(work or tempfile.mkdtemp(prefix="hilt-exports-"))
    work.mkdir(parents=True, exist_ok=True)
    chunks, context, new_tokens = (2, 64, 8) if quick else (8, 512, 32)
    variants = FORMATS[:1] if quick else FORMATS
    if quick:
        text = text[:1500]
    rows = []
    for label, method, bits in variants:
        for emb in (None,) if quick else (None, 8):
            name = label + ("" if emb is None else "-e8")
            q, g = work / name, work / f"{name}.gguf"
            start = time.perf_counter()
            # --quick: the first block only (the rest stays as the source stores it)
            quantize_checkpoint(src, q, QuantConfig(method, bits, 64), embeddings=emb, overwrite=True,
                                only=r"^blk\.[01]\." if quick else None)
            exported = export_gguf(q, g, overwrite=True)
            row = {"variant": name, "source": "gguf", "consumer": "llama.cpp", "types": exported["types"],
                   **check_gguf(g, text, context=context, chunks=chunks, new_tokens=new_tokens), **llama_bench(g)}
            if name == "int4" and not quick:  # the same weights dense: no rounding, so the tokens must be hilt's outright
                d = work / "int4-f32.gguf"
                dense_types = export_gguf(q, d, overwrite=True, dense=True)["types"]
                dense = {"variant": "int4 dense (F32)", "source": "gguf", "consumer": "llama.cpp", "types": dense_types,
                         **check_gguf(d, text, context=context, chunks=chunks, new_tokens=new_tokens, tolerance=0.0),
                         **llama_bench(d)}
                from hilt.models.llama import load_llama

                with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                    f.write(text)
                try:
                    row["rounding_llama_cpp"] = _kl_llama_cpp(g, d, f.name, context, chunks)
                finally:
                    Path(f.name).unlink()
                net, tokenizer = load_llama(d)
                row["rounding_hilt_simulated"] = _kl_hilt(net, g, tokenizer.encode(text), context, chunks)
                d.unlink()
            row["seconds"] = round(time.perf_counter() - start, 1)
            LOG.info(summary(row))
            rows.append(row)
            if name == "int4" and not quick:
                rows.append(dense)
            if not (label == "int4" and emb is None):
                shutil.rmtree(q, ignore_errors=True)
    hf_route = None
    if not quick:  # the Hugging Face folder route, against the GGUF-sourced int4 export
        from hilt.models.hf import gguf_to_hf

        folder, q, g = work / "smol-hf32", work / "hf-int4", work / "hf-int4.gguf"
        if not folder.exists():
            gguf_to_hf(src, folder, dtype=__import__("torch").float32)
        quantize_checkpoint(folder, q, QuantConfig("int", 4, 64), overwrite=True)
        export_gguf(q, g, overwrite=True)
        hf_route = {"variant": "int4 from a Hugging Face folder", "source": "hf", "consumer": "llama.cpp",
                    **check_gguf(g, text, context, chunks, new_tokens=new_tokens), **llama_bench(g),
                    "vs_gguf_sourced": _same_tensors(work / "int4.gguf", g)}
        rows.append(hf_route)
        rows += _transformers_rows(folder, q, work, text)
    from hilt.tasks.llama_cpp import GREEDY_TOLERANCE

    result = {"model": "SmolLM2-135M-Instruct", "text": "Hamlet", "context": context, "chunks": chunks, "quick": quick,
              "greedy_tolerance": GREEDY_TOLERANCE, "rows": rows}
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        stem = "export_llama_cpp_quick" if quick else "export_llama_cpp"
        write_json(Path(out) / f"{stem}.json", result)
        write_text(Path(out) / f"{stem}.md", table(result))
    return result


def table(result: dict) -> str:
    """The per-format, per-consumer table of docs/results/export.md (markdown)."""
    lines = ["| export | consumer | loads | same numbers | file | peak resident | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["consumer"] == "transformers":
            same = f"logits within {r['max_logit_diff_vs_hilt_folder']:.1e} of the largest (vs hilt's folder)"
            rss = "-"
        else:
            same = (f"ppl {r['ppl_llama_cpp']:.4f} vs hilt {r['ppl_hilt']:.4f} ({100 * r['ppl_rel_diff']:+.2f}%); "
                    f"Hamlet tokens {'identical' if r['tokens_identical'] else 'differ'}; greedy equal "
                    f"{r['equal_prefix']}/{r['generated_tokens']}, every token within {r['tolerance']} "
                    f"logits: {'yes' if r['within_tolerance'] else 'NO'} (largest gap {r['largest_gap']:.3f})")
            rss = "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 1e6:.0f} MB"
        lines.append(f"| {r['variant']} | {r['consumer']} | yes | {same} | {r['bytes'] / 1e6:.1f} MB | {rss} | "
                     f"{r['tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def summary(row: dict) -> str:
    """One line per row, as `hilt bench exports` prints it."""
    if row["consumer"] == "transformers":
        return (f"{row['variant']}: logits vs hilt's folder {row['max_logit_diff_vs_hilt_folder']:.1e} of the largest, "
                f"{row['bytes'] / 1e6:.1f} MB, {row['tokens_per_s']:.1f} tokens/s")
    return (f"{row['variant']}: llama.cpp ppl {row['ppl_llama_cpp']:.4f} hilt {row['ppl_hilt']:.4f} "
            f"({100 * row['ppl_rel_diff']:+.3f}%), tokens identical {row['tokens_identical']}, greedy equal "
            f"{row['equal_prefix']}/{row['generated_tokens']} (largest gap {row['largest_gap']:.3f} <= "
            f"{row['tolerance']}: {row['within_tolerance']}), {row['bytes'] / 1e6:.1f} MB, "
            f"{row['tokens_per_s']:.1f} tokens/s, peak RSS "
            + ("-" if row["peak_rss_bytes"] is None else f"{row['peak_rss_bytes'] / 1e6:.0f} MB"))

