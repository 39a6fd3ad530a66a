"""Exports judged by llama.cpp: SmolLM2-135M quantized by hilt, exported with `hilt export gguf`, and
read by llama.cpp's own tools (built by scripts/build_llama_cpp.sh) next to hilt's reading of the same
file (hilt.tasks.llama_cpp.check_gguf): llama-perplexity's statistic on Hamlet both ways, the token
ids of the whole play, and the greedy continuation of a prompt.

Formats: int 4-bit (Q4_0), int-asym 4-bit (Q4_1), int 8-bit (Q8_0), blocks of 64, each with the
token embedding dense and in 8 bits (``--embeddings 8``, Q8_0). Then the same int4 checkpoint made
from a Hugging Face folder (`hilt convert --dtype float32`, quantized, exported with metadata and
vocabulary built from the folder), compared with the GGUF-sourced export tensor by tensor.

    python -m hilt.bench.studies.exports [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from hilt.atomic import write_json
from hilt.progress import LOG

FORMATS = [("int4", "int", 4), ("int4-asym", "int-asym", 4), ("int8", "int", 8)]


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
    from hilt.tasks.llama_cpp import check_gguf, missing_tools

    missing = missing_tools()
    if missing:
        raise SystemExit(f"llama.cpp tools missing ({', '.join(missing)}): run scripts/build_llama_cpp.sh")
    text, src = shakespeare_text("hamlet"), smollm2_path()
    work = Path(work or tempfile.mkdtemp(prefix="hilt-exports-"))
    chunks = 2 if quick else 8
    variants = FORMATS[:1] if quick else FORMATS
    rows = []
    for label, method, bits in variants:
        for emb in (None, 8):
            name = label + ("" if emb is None else "-e8")
            q, g = work / name, work / f"{name}.gguf"
            start = time.perf_counter()
            quantize_checkpoint(src, q, QuantConfig(method, bits, 64), embeddings=emb, overwrite=True)
            exported = export_gguf(q, g, overwrite=True)
            row = {"variant": name, "source": "gguf", "types": exported["types"],
                   **check_gguf(g, text, context=512, chunks=chunks)}
            row["seconds"] = round(time.perf_counter() - start, 1)
            LOG.info(f"{name}: llama.cpp ppl {row['ppl_llama_cpp']:.4f} vs hilt {row['ppl_hilt']:.4f} "
                     f"({100 * row['ppl_rel_diff']:+.3f}%), tokens identical {row['tokens_identical']}, "
                     f"{row['generated_tokens_agreeing']}/{row['generated_tokens']} generated tokens agree")
            rows.append(row)
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
        hf_route = {"variant": "int4 from a Hugging Face folder", "source": "hf", **check_gguf(g, text, 512, chunks),
                    "vs_gguf_sourced": _same_tensors(work / "int4.gguf", g)}
        rows.append(hf_route)
    result = {"model": "SmolLM2-135M-Instruct", "text": "Hamlet", "context": 512, "chunks": chunks, "quick": quick,
              "rows": rows}
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_json(Path(out) / ("export_llama_cpp_quick.json" if quick else "export_llama_cpp.json"), result)
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--work", help="folder for the checkpoints and GGUF files (default: a temporary one)")
    a = p.parse_args()
    for r in run(a.out, a.quick, a.work)["rows"]:
        print(f"{r['variant']}: llama.cpp {r['ppl_llama_cpp']:.4f} hilt {r['ppl_hilt']:.4f} "
              f"({100 * r['ppl_rel_diff']:+.3f}%) tokens identical {r['tokens_identical']} "
              f"generation {r['generated_tokens_agreeing']}/{r['generated_tokens']} {r['bytes'] / 1e6:.1f} MB")
