"""CPU decode through transformers, hilt's 4-bit folders against the dense model: `hilt bench decode`.

SmolLM2-135M made into a Hugging Face folder (`hilt convert`, bfloat16), quantized by `hilt quantize`
to symmetric int4 (PyTorch's fused CPU int4 kernel), the same with int8 embeddings (`--embeddings 8`:
the tied head through the int8 kernel) and to 4-bit k-means (the reference: dequantize, then matmul),
each loaded with ``AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`` and timed on
greedy ``generate`` in one run, beside transformers' own loading of the packed GGUF. Each model's
load runs once more in a child process, for its peak resident memory against the bytes of its weights.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hilt.models.hf import gguf_to_hf, require_transformers
from hilt.quant import QuantConfig, quantize_checkpoint

PROMPT = "The capital of France is Paris. The capital of Germany is"
# label -> (format, --embeddings bits)
FORMATS = {"hilt int4 (block 64)": (QuantConfig("int", 4, 64), None),
           "hilt int4 + int8 embeddings": (QuantConfig("int", 4, 64), 8),
           "hilt k-means 4 (block 64)": (QuantConfig("kmeans", 4, 64), None)}

# Resident memory of a load, in a fresh process. The baseline is taken once the load path's own modules
# are imported (transformers' quantizer registry, which registers hilt's, and the model's class: hundreds
# of MB that any model of the family costs). "loaded": the high-water mark after from_pretrained with
# every stored tensor read once (safetensors maps the file: an unread weight is not resident yet);
# "decoding": after one short bfloat16 forward pass, which also makes the CPU kernels' packed copies.
_MEMORY_PROBE = """
import json, sys, torch, transformers, transformers.quantizers.auto, hilt
def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024
kwargs = json.loads(sys.argv[2])
config = transformers.AutoConfig.from_pretrained(sys.argv[1], **kwargs)
transformers.AutoModelForCausalLM._model_mapping[type(config)]  # imports the model's module
base = status('VmRSS')
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, **kwargs)
with torch.inference_mode():
    for t in model.state_dict().values():
        t.contiguous().view(-1).view(torch.uint8).max()  # reads every page, allocates nothing
    loaded = status('VmHWM')
    model(torch.tensor([[1, 2, 3]]))
print(json.dumps({"baseline": base, "loaded": loaded, "decoding": status('VmHWM')}))
"""


def _tokens_per_second(model, ids, new_tokens: int, repeats: int) -> tuple[float, list[int]]:
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            times.append(time.perf_counter() - start)
    return new_tokens / statistics.median(times), out[0, ids.shape[1]:].tolist()


def _load_memory(folder: Path, kwargs: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(folder), json.dumps(kwargs)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def run(quick: bool = False, work=None, threads: int = 2, log=print) -> dict:
    from hilt.models.llama import GGUF_FILE, smollm2_path

    transformers = require_transformers()
    torch.set_num_threads(threads)
    new_tokens, repeats = (16, 2) if quick else (64, 3)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        tmp = Path(tmp)
        log("converting SmolLM2's GGUF to a Hugging Face folder (bfloat16)")
        dense = gguf_to_hf(smollm2_path(), tmp / "smollm2-hf")
        folders = {"dense bf16": dense}
        for i, (label, (config, embeddings)) in enumerate(FORMATS.items()):
            log(f"quantizing: {label}")
            folders[label] = tmp / f"quantized-{i}"
            quantize_checkpoint(dense, folders[label], config, embeddings=embeddings)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(dense))
        ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False)["input_ids"]
        rows = []
        gguf_kwargs = {"gguf_file": GGUF_FILE}
        cases = [(label, folder, {}) for label, folder in folders.items()]
        cases.append(("transformers GGUF (Q4_1 file)", smollm2_path().parent, gguf_kwargs))
        for label, folder, kwargs in cases:
            log(f"decoding: {label}")
            model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, **kwargs)
            speed, tokens = _tokens_per_second(model.eval(), ids, new_tokens, repeats)
            del model
            weights = smollm2_path().stat().st_size if kwargs else _weight_bytes(folder)
            memory = _load_memory(folder, kwargs)
            rows.append({"model": label, "tokens_per_second": round(speed, 2), "weight_bytes": weights,
                         "text": tokenizer.decode(tokens[:12]), **{f"rss_{k}": v for k, v in memory.items()}})
    base = rows[0]["tokens_per_second"]
    for r in rows:
        r["vs_dense_bf16"] = round(r["tokens_per_second"] / base, 3)
        if "rss_loaded" in r:
            r["loaded_over_weights"] = round((r["rss_loaded"] - r["rss_baseline"]) / r["weight_bytes"], 3)
            r["decoding_over_weights"] = round((r["rss_decoding"] - r["rss_baseline"]) / r["weight_bytes"], 3)
    return {"threads": threads, "new_tokens": new_tokens, "repeats": repeats, "prompt": PROMPT,
            "device": "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
            "rows": rows, "table": table(rows)}


def table(rows: list[dict]) -> str:
    lines = ["| model (from_pretrained, bf16) | tokens/s | vs dense bf16 | weights MB | "
             "resident over weights: loaded / decoding |", "|---|---|---|---|---|"]
    for r in rows:
        memory = (f"{r['loaded_over_weights']:.2f}x / {r['decoding_over_weights']:.2f}x" if "loaded_over_weights" in r
                  else r.get("rss_error", "n/a"))
        lines.append(f"| {r['model']} | {r['tokens_per_second']:.2f} | {r['vs_dense_bf16']:.2f}x | "
                     f"{r['weight_bytes'] / 1e6:.1f} | {memory} |")
    return "\n".join(lines)
