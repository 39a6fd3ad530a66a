"""How `hilt quantize` scales to 1B and 8B checkpoints (`hilt bench scale`).

1. Writes a synthetic Llama-shaped Hugging Face folder: config.json, bf16 sharded safetensors and
   their index. The weights are not plain Gaussians: each projection kind has the spread of row
   scales, of column scales and the tails that SmolLM2-135M's own weights show (``SMOLLM2_STATS``,
   measured by :func:`measure_stats`), so block scales, k-means codebooks and the error statistics
   see the kind of values a real checkpoint holds. No download is needed.
2. Measures the disk's read rate on those shards (page cache dropped first, where the system lets a
   process drop its own files' pages): the ceiling for round-to-nearest.
3. Runs `hilt quantize` (int4, k-means 4 and 3 bit, and compensated k-means 4-bit on calibration text
   through the folder's byte-level tokenizer; not by default on the 8B shape) as child processes, each
   from a cold cache, and reports wall and CPU time, peak RSS (the child's own VmHWM), the writer's time
   split and the linear weights per second, against the read rate.

The folder of the 8B shape takes about 16 GB; it is removed afterwards unless ``keep``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hilt.progress import LOG

# Llama shapes: hidden, layers, MLP width, attention heads, key/value heads, vocabulary, shard size.
SHAPES = {
    "quick": dict(hidden=128, layers=2, intermediate=384, heads=4, kv_heads=2, vocab=256, shard_bytes=400_000),
    "1b": dict(hidden=2048, layers=16, intermediate=8192, heads=16, kv_heads=4, vocab=32000, shard_bytes=600 << 20),
    "8b": dict(hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8, vocab=128256, shard_bytes=5000 << 20),
}

# Per projection kind, from SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized; `measure_stats`):
# (std of the weights, std of log row std, std of log column std after the rows are divided out,
#  Student-t degrees of freedom matching the kurtosis of what is left).
SMOLLM2_STATS = {
    "q_proj": (0.2001, 0.3819, 0.1560, 22.3), "k_proj": (0.2056, 0.3199, 0.1430, 32.6),
    "v_proj": (0.1892, 0.1151, 0.2318, 20.2), "o_proj": (0.1751, 0.1925, 0.1836, 23.5),
    "gate_proj": (0.1876, 0.1564, 0.0728, 20.3), "up_proj": (0.1990, 0.0969, 0.0902, 17.6),
    "down_proj": (0.1919, 0.1251, 0.0967, 15.8),
}
GGUF_KINDS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
              "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}

RUNS = {  # name -> hilt quantize flags
    "int4": ["--method", "int", "--bits", "4"],
    "kmeans4": ["--method", "kmeans", "--bits", "4"],
    "kmeans3": ["--method", "kmeans", "--bits", "3"],
    # the calibration text (Macbeth) tokenized byte by byte: the folder's tokenizer (write_synthetic)
    "kmeans4-compensated": ["--method", "kmeans", "--bits", "4", "--compensate"],
}
LONG_RUNS = {"kmeans4-compensated"}  # left out of the 8B shape's default runs (hours on 2 cores)


def measure_stats(gguf_path) -> dict[str, tuple[float, float, float, float]]:
    """SMOLLM2_STATS from a Llama GGUF: per kind, the means over its layers."""
    from hilt.quant import open_source

    found: dict[str, list[list[float]]] = {}
    with open_source(gguf_path) as src:
        for name in src.names():
            parts = name.split(".")
            if len(parts) != 4 or parts[2] not in GGUF_KINDS or len(src.shape(name)) != 2:
                continue
            w = src.get(name).double()
            rows = w.std(1)
            z = w / rows[:, None]
            cols = z.std(0)
            z = z / cols
            kurtosis = float(((z - z.mean()) ** 4).mean() / z.var() ** 2)
            found.setdefault(GGUF_KINDS[parts[2]], []).append(
                [float(w.std()), float(rows.log().std()), float(cols.log().std()), kurtosis])
    out = {}
    for kind, values in found.items():
        std, row, col, kurt = torch.tensor(values).mean(0).tolist()
        out[kind] = (std, row, col, 4 + 6 / max(kurt - 3, 1e-3))  # Student-t: excess kurtosis 6 / (nu - 4)
    return out


def synthetic_weight(shape, kind: str, generator: torch.Generator) -> torch.Tensor:
    """A bf16 weight of ``shape`` with the row/column scale spread and tails of ``kind`` (SMOLLM2_STATS)."""
    std, row_sigma, col_sigma, nu = SMOLLM2_STATS[kind]
    n, k = shape
    rows = torch.exp(row_sigma * torch.randn(n, 1, generator=generator))
    cols = torch.exp(col_sigma * torch.randn(1, k, generator=generator))
    out = torch.empty(n, k, dtype=torch.bfloat16)
    step = max(1, (1 << 22) // k)
    for r in range(0, n, step):  # Student-t as a normal over sqrt(chi2 / nu), in row bands: bounded memory
        z = torch.randn(min(step, n - r), k, generator=generator)
        chi2 = torch._standard_gamma(torch.full_like(z, nu / 2), generator=generator) * 2
        z *= (chi2 / (nu - 2)).rsqrt_()  # unit variance
        out[r : r + step] = z * rows[r : r + step] * cols
    return out.mul_(std / float(out.float().std()))


def tensor_shapes(shape: dict) -> list[tuple[str, tuple[int, int], str | None]]:
    """(name, shape, kind or None for non-linear tensors) in Llama's order, as transformers names them."""
    h, f, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    kv = h // shape["heads"] * shape["kv_heads"]
    out = [("model.embed_tokens.weight", (v, h), "up_proj")]
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), None), (p + "self_attn.q_proj.weight", (h, h), "q_proj"),
                (p + "self_attn.k_proj.weight", (kv, h), "k_proj"), (p + "self_attn.v_proj.weight", (kv, h), "v_proj"),
                (p + "self_attn.o_proj.weight", (h, h), "o_proj"), (p + "post_attention_layernorm.weight", (h,), None),
                (p + "mlp.gate_proj.weight", (f, h), "gate_proj"), (p + "mlp.up_proj.weight", (f, h), "up_proj"),
                (p + "mlp.down_proj.weight", (h, f), "down_proj")]
    out += [("model.norm.weight", (h,), None), ("lm_head.weight", (v, h), "up_proj")]
    return out


def llama_config(shape: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape["hidden"],
            "intermediate_size": shape["intermediate"], "num_hidden_layers": shape["layers"],
            "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
            "vocab_size": shape["vocab"], "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2}


def write_synthetic(folder, shape_name: str, seed: int = 0) -> dict:
    """The synthetic Llama folder of ``SHAPES[shape_name]`` at ``folder``; returns its sizes."""
    from hilt.atomic import save_safetensors, write_json
    from hilt.quant import hf_folder

    shape = SHAPES[shape_name]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    limit = shape["shard_bytes"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    names = tensor_shapes(shape)
    count = -(-sum(math.prod(s) * 2 for _, s, _ in names) // limit)  # the shard count, for their names
    files = hf_folder.shard_names(max(1, count))
    weight_map, size, linear, used = {}, 0, 0, 0
    for name, s, kind in names:
        t = torch.ones(s, dtype=torch.bfloat16) if kind is None else synthetic_weight(s, kind, g)
        nbytes = t.numel() * 2
        if used and used + nbytes > limit:
            _save_shard(save_safetensors, folder / files[len(shards) - 1], shards[-1])
            shards.append({})
            used = 0
        shards[-1][name] = t
        weight_map[name] = files[len(shards) - 1]
        used += nbytes
        size += nbytes
        linear += t.numel() if kind is not None and "embed" not in name and "lm_head" not in name else 0
    _save_shard(save_safetensors, folder / files[len(shards) - 1], shards[-1])
    shards[-1] = {}
    if len(shards) > 1:
        hf_folder.write_index(folder, weight_map, size)
    write_json(folder / hf_folder.CONFIG, llama_config(shape))
    write_byte_tokenizer(folder)
    made = {"shape": shape_name, "seed": seed, **shape, "tensors": len(names), "linear_weights": linear,
            "bytes": size, "shards": len(shards)}
    write_json(folder / "synthetic.json", made)
    return made


def write_byte_tokenizer(folder: Path) -> None:
    """A tokenizer transformers' AutoTokenizer loads: one token per byte (ids 0-255, inside every shape's
    vocabulary), so that `--compensate` can tokenize its calibration text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hilt.atomic import write_json, write_text

    tk = Tokenizer(models.BPE({chr(b) if 33 <= b < 127 else f"<0x{b:02X}>": b for b in range(256)}, [],
                              byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.ByteFallback()
    write_text(folder / "tokenizer.json", tk.to_str())
    write_json(folder / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})


def _kept(src: Path, shape_name: str) -> dict | None:
    """The sizes of a folder an earlier run kept (--keep) with this shape, None if there is none."""
    try:
        made = json.loads((src / "synthetic.json").read_text())
    except (OSError, ValueError):
        return None
    return made if made.get("shape") == shape_name and made.get("seed") == 0 else None


def _save_shard(save, path: Path, tensors: dict) -> None:
    save(tensors, path, metadata={"format": "pt"})
    tensors.clear()
    drop_cache([path])


def drop_cache(files) -> bool:
    """Ask the kernel to forget the cached pages of ``files`` (flushed first); False where it cannot."""
    ok = hasattr(os, "posix_fadvise")
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if ok:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return ok


def read_rate(folder: Path) -> dict:
    """Bytes per second of reading every shard once from a cold cache, in 16 MB reads."""
    files = sorted(folder.glob("*.safetensors"))
    cold = drop_cache(files)
    buf = bytearray(16 << 20)
    total, start = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    seconds = time.perf_counter() - start
    drop_cache(files)
    return {"bytes": total, "seconds": round(seconds, 3), "bytes_per_second": total / seconds, "cold_cache": cold}


# The child reports its own VmHWM: ru_maxrss would carry this parent's peak over fork and exec.
_CHILD = """
import json, sys
from hilt.cli import main
rc = main(sys.argv[2:])
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
open(sys.argv[1], "w").write(str(int(hwm.split()[1]) * 1024))
sys.exit(rc)
"""


def run_child(argv: list[str], work: Path) -> dict:
    """`hilt ARGV` in a child process: wall, CPU (user + system) and peak RSS, and its exit status."""
    peak_file = work / "peak.txt"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(peak_file), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    stderr = proc.stderr.read()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"hilt {' '.join(argv)} failed ({proc.returncode}): {stderr.strip()[-500:]}")
    return {"wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "user_s": round(usage.ru_utime, 3), "peak_rss_bytes": int(peak_file.read_text())}


def quantize_run(name: str, flags: list[str], src: Path, work: Path, linear: int, rate: float,
                 extra: list[str] = ()) -> dict:
    dst, report = work / f"q-{name}", work / f"{name}.json"
    for old in (dst, dst.with_name(dst.name + ".partial")):  # what an interrupted benchmark left in its folder
        shutil.rmtree(old, ignore_errors=True)
    drop_cache(sorted(src.glob("*.safetensors")))
    LOG.info(f"scale: hilt quantize {' '.join(flags + list(extra))} ...")
    r = run_child(["quantize", str(src), str(dst), *flags, *extra, "--quiet", "--json", str(report)], work)
    result = json.loads(report.read_text())
    seconds = result["seconds"]
    row = {"run": name, "flags": flags + list(extra), **r, "split_s": seconds,
           "linear_weights_per_s": linear / r["wall_s"], "output_bytes": result["totals"]["bytes"],
           "rel_error_mean": result["totals"]["rel_error_mean"]}
    if "compensation" in result:  # its own split: forward passes, input Gram matrices, the quantization
        row["compensation_s"] = result["compensation"]["seconds"]
    row["read_ceiling_s"] = round(sum(f.stat().st_size for f in src.glob("*.safetensors")) / rate, 3)
    row["wall_over_read_ceiling"] = round(r["wall_s"] / row["read_ceiling_s"], 2)
    shutil.rmtree(dst, ignore_errors=True)
    LOG.info(f"scale: {name}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, peak RSS "
             f"{r['peak_rss_bytes'] / 2**30:.2f} GiB, {row['linear_weights_per_s'] / 1e6:.1f} M linear weights/s "
             f"({row['wall_over_read_ceiling']:.1f}x the read time); split {seconds}")
    return row


def run(quick: bool = False, shape: str | None = None, keep: bool = False, work: str | None = None,
        runs: list[str] | None = None, extra: list[str] = ()) -> dict:
    """`hilt bench scale`: the synthetic folder, its read rate, and each run of ``runs`` (default all)."""
    shape = "quick" if quick else shape or "1b"
    root = Path(work) if work else Path(tempfile.mkdtemp(prefix="hilt-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"llama-{shape}"
    try:
        t0 = time.perf_counter()
        made = _kept(src, shape) or write_synthetic(src, shape)
        made.setdefault("write_s", round(time.perf_counter() - t0, 1))
        LOG.info(f"scale: wrote {src} ({made['bytes'] / 1e9:.2f} GB, {made['shards']} shards, "
                 f"{made['linear_weights'] / 1e6:.0f} M linear weights) in {made['write_s']} s")
        rate = read_rate(src)
        LOG.info(f"scale: disk read {rate['bytes_per_second'] / 1e6:.0f} MB/s"
                 f"{'' if rate['cold_cache'] else ' (page cache not dropped)'}")
        runs = runs or [name for name in RUNS if shape != "8b" or name not in LONG_RUNS]
        rows = [quantize_run(name, RUNS[name], src, root, made["linear_weights"], rate["bytes_per_second"], extra)
                for name in runs]
    finally:
        if not keep:
            shutil.rmtree(src, ignore_errors=True)
            if not work:
                shutil.rmtree(root, ignore_errors=True)
    return {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "platform": platform.platform(), "torch": torch.__version__,
                        "max_rss_of_bench_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
            "model": made, "read": rate, "runs": rows, "kept": src.name if keep else None}  # in the work folder
