"""CPU decode through transformers, hilt's quantized folders against the dense model: `hilt bench decode`.

SmolLM2-135M made into a Hugging Face folder (`hilt convert`, bfloat16), quantized by `hilt quantize`
to symmetric int4, the same with int8 embeddings (`--embeddings 8`), k-means at 2, 3 and 4 bits,
binary (1 bit) and compensated k-means 4-bit, each loaded with
``AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`` beside transformers' own loading of the
packed GGUF. All are loaded at once and take turns in each round of timing (greedy ``generate``, then
one prefill forward of 256 tokens), the median of the rounds kept, so that the ratios come from the
same moments of the machine. Per token, the time is split between the linear layers and the rest (the
framework's share) by the share that hooks measure in one more generate. Every quantized layer but
row-wise int8 runs the CPU lookup-table kernel (kernels.lut_cpu). Each model's load runs once more in a
child process, for its peak resident memory against the bytes of its weights. Two more rows run the same
weights through hilt's own Llama (hilt/models/llama.py: one readable file, its own key/value cache),
dense and k-means 4-bit (``quantize_model_``), taking turns with the others: what a leaner model than
transformers' leaves of the per-token framework time.

The one-layer GEMV table (M = 1, bfloat16 x) separates the kernel from the per-token framework
overhead: GB/s of weight bytes read, against the copy bandwidth measured in the same run (a 256 MB
``copy_``, read and written bytes counted, as STREAM does). Each layer is cycled through enough
copies to exceed the last-level cache, so the weights come from memory.

llama.cpp: where `llama-bench` is built (scripts/build_llama_cpp.sh, from the llama-cpp-python sdist's
sources, into ``${HILT_LLAMA_CPP:-~/.cache/hilt/llama.cpp}/bin``), its token-generation rate on hilt's
own Q4_0 and Q8_0 exports of SmolLM2 (`hilt export gguf`) is measured in the same run; otherwise its
row says "not built".

``--quick`` (the test's): a tiny random Llama in place of SmolLM2, dense and k-means 4-bit, a few
tokens, SmolLM2's layer alone in the GEMV table; it checks that the pipeline runs, not the speeds.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hilt.bench.perf import wall_times
from hilt.errors import HiltError
from hilt.models.hf import gguf_to_hf, require_transformers
from hilt.quant import QuantConfig, quantize_checkpoint
from hilt.progress import LOG

PROMPT = "The capital of France is Paris. The capital of Germany is"
PREFILL = 256  # tokens of one prefill forward (M = 256 rows through every layer)
# label -> (format, --embeddings bits)
FORMATS = {"hilt int4 (block 64)": (QuantConfig("int", 4, 64), None),
           "hilt int4 + int8 embeddings": (QuantConfig("int", 4, 64), 8),
           "hilt k-means 4 (block 64)": (QuantConfig("kmeans", 4, 64), None),
           "hilt k-means 4 + int8 head": (QuantConfig("kmeans", 4, 64), 8),
           "hilt k-means 2 + int8 head": (QuantConfig("kmeans", 2, 64), 8),
           "hilt k-means 3 (block 64)": (QuantConfig("kmeans", 3, 64), None),
           "hilt k-means 2 (block 64)": (QuantConfig("kmeans", 2, 64), None),
           "hilt binary (block 64)": (QuantConfig("binary", 1, 64), None),
           "hilt k-means 4 compensated": (QuantConfig("kmeans", 4, 64), "compensate")}
# `hilt bench decode --formats`: short names of the FORMATS rows
NAMES = {"int4": "hilt int4 (block 64)", "int4+int8emb": "hilt int4 + int8 embeddings",
         "kmeans4": "hilt k-means 4 (block 64)", "kmeans4+int8head": "hilt k-means 4 + int8 head",
         "kmeans2+int8head": "hilt k-means 2 + int8 head", "kmeans3": "hilt k-means 3 (block 64)",
         "kmeans2": "hilt k-means 2 (block 64)", "binary": "hilt binary (block 64)",
         "kmeans4-compensated": "hilt k-means 4 compensated"}
QUICK_FORMATS = ("hilt k-means 4 (block 64)",)
# the k-means 4-bit model again with q/k/v and gate/up called one layer at a time: what the grouped call gives
APART = "hilt k-means 4 (block 64), a call per layer"
REPORT_FORMATS = ("hilt int4 (block 64)", "hilt k-means 4 (block 64)")  # `hilt report`'s rows, with 16 tokens
# the llama.cpp rows: hilt's GGUF exports (llama.cpp's blocks are 32 weights)
LLAMA_CPP_FORMATS = {"Q4_0": QuantConfig("int", 4, 32), "Q8_0": QuantConfig("int", 8, 32)}
# (in_features, out_features): SmolLM2's up projection, and an 8B model's
GEMV_SHAPES = [(576, 1536), (4096, 14336)]
GEMV_FORMATS = [("k-means 4", QuantConfig("kmeans", 4, 64)), ("k-means 3", QuantConfig("kmeans", 3, 64)),
                ("k-means 2", QuantConfig("kmeans", 2, 64)), ("binary", QuantConfig("binary", 1, 64)),
                ("int4", QuantConfig("int", 4, 64))]

# Resident memory of a load, in a fresh process. The baseline is taken once the load path's own modules
# are imported (transformers' quantizer registry, which registers hilt's, and the model's class: hundreds
# of MB that any model of the family costs). "loaded": the high-water mark after from_pretrained with
# every stored tensor read once (safetensors maps the file: an unread weight is not resident yet);
# "decoding": the high-water mark after one short bfloat16 forward pass, which also readies the CPU kernels.
# "code": the shared libraries' pages resident at each point (/proc/self/smaps). The first forward pages
# in 10-20 MB of torch's own machine code, the same for every model and shared with every process that
# maps those libraries; the rows also give the memory over weights without it (the high-water mark less the
# code resident at the end: code pages are not given back), which is what the model and its format hold.
_MEMORY_PROBE = """
import json, sys, torch, transformers, transformers.quantizers.auto, hilt
def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024
def code():
    total, lib = 0, False
    for line in open('/proc/self/smaps'):
        head = line.split()
        if '-' in head[0] and not head[0].endswith(':'):
            lib = len(head) > 5 and ('.so' in head[5].rsplit('/', 1)[-1])
        elif lib and head[0] == 'Rss:':
            total += int(head[1]) * 1024
    return total
kwargs = json.loads(sys.argv[2])
config = transformers.AutoConfig.from_pretrained(sys.argv[1], **kwargs)
transformers.AutoModelForCausalLM._model_mapping[type(config)]  # imports the model's module
base, base_code = status('VmRSS'), code()
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, **kwargs)
with torch.inference_mode():
    for t in model.state_dict().values():
        t.contiguous().view(-1).view(torch.uint8).max()  # reads every page, allocates nothing
    loaded, loaded_code = status('VmHWM'), code()
    model(torch.tensor([[1, 2, 3]]))
print(json.dumps({"baseline": base, "loaded": loaded, "decoding": status('VmHWM'), "after_forward": status('VmRSS'),
                  "baseline_code": base_code, "loaded_code": loaded_code, "decoding_code": code()}))
"""


class HiltLlamaRunner(torch.nn.Module):
    """hilt's Llama behind the two calls the timing makes of a transformers model: greedy ``generate``
    with its key/value cache, and one forward over a prompt."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def generate(self, ids, max_new_tokens: int, min_new_tokens: int | None = None, do_sample: bool = False):
        from hilt.models.llama import greedy

        return greedy(self.model, ids, max_new_tokens)  # no stop token: every run decodes as many tokens

    def forward(self, ids, use_cache: bool = False):
        return self.model(ids)


def _hilt_llamas(quick: bool) -> dict:
    """hilt's Llama on SmolLM2's weights (quick: a tiny random one), dense bf16 and k-means 4-bit."""
    from hilt.models.llama import Llama, LlamaConfig, load_llama
    from hilt.quant.nn import quantize_model_

    def make():
        if quick:
            torch.manual_seed(0)
            return Llama(LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
                                     max_seq_len=128)).eval()
        return load_llama()[0]

    config = QuantConfig("kmeans", 4, 64)
    runners = {"hilt's Llama, dense bf16": make().to(torch.bfloat16),
               "hilt's Llama, k-means 4 (block 64)": quantize_model_(make(), config).to(torch.bfloat16)}
    if not quick:
        # the head in int8 (its perplexity cost: docs/results/kernels.md), activations in bfloat16 and in float32
        # (CPUs without bfloat16 arithmetic convert every bfloat16 activation)
        with_head = quantize_model_(make(), config, embeddings=8)
        runners["hilt's Llama, k-means 4 + int8 head"] = with_head.to(torch.bfloat16)
        runners["hilt's Llama, k-means 4 + int8 head, float32 activations"] = copy.deepcopy(with_head).float()
    return {label: HiltLlamaRunner(model).eval() for label, model in runners.items()}


def _generate(model, ids, new_tokens: int):
    return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def _interleaved(models: dict, call, repeats: int) -> dict[str, float]:
    """Median seconds of ``call(model)`` per model, the models taking turns in each of ``repeats`` rounds
    (on shared cores a slow moment then falls on every model alike, not on whichever ran in it)."""
    times = {label: [] for label in models}
    for _ in range(repeats):
        for label, model in models.items():
            start = time.perf_counter()
            call(model)
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


class _Spans:
    """Exclusive time per kind of span (a span's time less the spans inside it): the linear layers, the head
    and attention (its projections, timed as linear layers, taken out)."""

    def __init__(self):
        self.spent, self.stack = {"linear": 0.0, "head": 0.0, "attention": 0.0}, []

    def enter(self, kind):
        self.stack.append([kind, time.perf_counter(), 0.0])

    def leave(self):
        kind, start, inner = self.stack.pop()
        took = time.perf_counter() - start
        self.spent[kind] += took - inner
        if self.stack:
            self.stack[-1][2] += took

    def wrap(self, kind, fn):
        def timed(*args, **kwargs):
            self.enter(kind)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        return timed


def _time_split(model, ids, new_tokens: int) -> dict[str, float]:
    """Shares of a generate's time spent in the linear layers, the output head and attention (rotary
    embeddings, the cache, the scaled dot products: the attention modules less their projections), timed by
    hooks in one untimed generate; the rest is norms, the MLP's activation, embeddings and the framework's
    Python. Shares, not times: the hooks slow that generate, and on a tiny model by more than its layers take."""
    from torch import nn

    from hilt.quant.nn import QuantLinear, TiedHead

    spans, hooks, patched = _Spans(), [], []
    own = isinstance(model, HiltLlamaRunner)
    inner = model.model if own else model
    head = None if own else inner.get_output_embeddings()

    def hook(module, kind):
        hooks.extend((module.register_forward_pre_hook(lambda *_: spans.enter(kind)),
                      module.register_forward_hook(lambda *_: spans.leave())))

    for m in inner.modules():
        if m is head:
            hook(m, "head")
        elif isinstance(m, (nn.Linear, QuantLinear, TiedHead)):
            hook(m, "linear")
        elif not own and type(m).__name__.endswith("Attention"):
            hook(m, "attention")
    if own:  # its head and attention are methods: timed through instance attributes that shadow them
        patched = [(inner, "head")] + [(blk, "attention") for blk in inner.blk]
        for obj, name in patched:
            setattr(obj, name, spans.wrap(name, getattr(obj, name)))
    try:
        start = time.perf_counter()
        _generate(model, ids, new_tokens)
        total = time.perf_counter() - start
    finally:
        for h in hooks:
            h.remove()
        for obj, name in patched:
            delattr(obj, name)
    return {kind: t / total for kind, t in spans.spent.items()}


def _split_ms(shares: dict[str, float], per_token: float) -> dict[str, float]:
    """A row's per-token milliseconds by part: the shares of the hooked generate applied to the timed token."""
    ms = {f"{kind}_ms_per_token": round(share * per_token * 1e3, 2) for kind, share in shares.items()}
    ms["rest_ms_per_token"] = round(per_token * 1e3 - sum(ms.values()), 2)
    return ms


def _load_memory(folder: Path, kwargs: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(folder), json.dumps(kwargs)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _compensator(folder: Path, config):
    """The Compensator maker for quantize_checkpoint on the Hugging Face folder itself (Macbeth)."""
    from hilt.tasks.compensate import compensator

    return lambda targets: compensator(folder, config, targets=targets)


def _best_time(fn, repeats: int) -> float:
    return min(wall_times(fn, repeats))


def copy_bandwidth(mbytes: int = 256, repeats: int = 5) -> float:
    """GB/s of a large tensor copy, read and written bytes counted (STREAM's convention)."""
    a = torch.ones(mbytes << 18)  # float32: mbytes MB
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _best_time(lambda: b.copy_(a), repeats) / 1e9


def last_level_cache() -> int:
    """Bytes of the CPU's last-level cache (sysfs), or 32 MB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def gemv_table(shapes=None, repeats: int = 10, formats=None, past_bytes: int | None = None) -> list[dict]:
    """One layer at M = 1, bfloat16 x: GB/s of weight bytes read, per format, the dense bf16 matmul and
    PyTorch's int4 kernel beside hilt's. Weights cycled through copies adding up to ``past_bytes``
    (default: twice the last-level cache), so that they come from memory."""
    from hilt.kernels import int_cpu, lut_cpu
    from hilt.quant import quantize_tensor

    past_bytes = past_bytes or 2 * last_level_cache()
    rows = []
    for k, n in shapes or GEMV_SHAPES:
        g = torch.Generator().manual_seed(k + n)
        w = torch.randn(n, k, generator=g) * 0.02
        x = torch.randn(1, k, generator=g).to(torch.bfloat16)

        def cycled(nbytes, make, call):
            copies = [make() for _ in range(max(2, -(-past_bytes // nbytes)))]

            def step():
                for c in copies:
                    call(c)
            return _best_time(step, repeats) / len(copies)

        dense = w.to(torch.bfloat16)
        t = cycled(dense.numel() * 2, dense.clone, lambda d: x @ d.T)
        rows.append({"shape": f"{k}x{n}", "format": "dense bf16 (torch)", "bytes": dense.numel() * 2,
                     "us": t * 1e6, "gb_per_s": dense.numel() * 2 / t / 1e9})
        for label, config in formats or GEMV_FORMATS:
            q = quantize_tensor(w, config)
            p = q.packed
            mk = lambda p=p: type(p)(**{f: (v.clone() if isinstance(v, torch.Tensor) else v)  # noqa: E731
                                        for f, v in vars(p).items()})
            # as QuantLinear keeps it: readied once, interleaved in place where the pair tables take it
            t = cycled(p.nbytes, lambda: lut_cpu.prepare(mk(), interleave=True), lambda c: c(x))
            kind = ("pair tables" if lut_cpu.pair_path(p) else "bf16 path" if lut_cpu.bf16_path(p)
                    else "int8 path" if lut_cpu.int8_path(p) else f"{lut_cpu.layout(p)[0]} lanes")
            rows.append({"shape": f"{k}x{n}", "format": f"hilt {label} (lut_cpu, {kind})",
                         "bytes": p.nbytes, "us": t * 1e6, "gb_per_s": p.nbytes / t / 1e9})
            if int_cpu.supports(p):  # symmetric integer levels the int4/int8 kernels take
                t = cycled(p.nbytes, lambda: int_cpu.prepack(p), lambda c: c(x))
                rows.append({"shape": f"{k}x{n}", "format": "int4 (torch _weight_int4pack_mm_for_cpu)",
                             "bytes": p.nbytes, "us": t * 1e6, "gb_per_s": p.nbytes / t / 1e9})
            LOG.info(f"  GEMV {k}x{n} {rows[-1]['format']}: {rows[-1]['gb_per_s']:.1f} GB/s")
    return rows


def llama_cpp_tool(name: str) -> Path | None:
    """llama.cpp's tool ``name`` (llama-bench, ...) where scripts/build_llama_cpp.sh built it, else None."""
    root = os.environ.get("HILT_LLAMA_CPP") or Path.home() / ".cache" / "hilt" / "llama.cpp"
    tool = Path(root) / "bin" / name
    return tool if tool.is_file() and os.access(tool, os.X_OK) else None


def _llama_cpp_rows(tmp: Path, threads: int, new_tokens: int, repeats: int, source: Path | None = None) -> list[dict]:
    """llama-bench's token generation on hilt's Q4_0 and Q8_0 GGUF exports of ``source`` (a Hugging Face folder;
    default SmolLM2's GGUF)."""
    from hilt.models.llama import smollm2_path
    from hilt.quant.gguf_export import export_gguf

    bench = llama_cpp_tool("llama-bench")
    if bench is None:
        return [{"model": "llama.cpp llama-bench (Q4_0, Q8_0 exports)", "tokens_per_second": None,
                 "note": "not built"}]
    rows = []
    for kind, config in LLAMA_CPP_FORMATS.items():
        label = f"llama.cpp llama-bench, hilt's {kind} export"
        try:
            folder, gguf_file = tmp / f"llama-{kind}", tmp / f"model-{kind}.gguf"
            quantize_checkpoint(source or smollm2_path(), folder, config)
            export_gguf(folder, gguf_file)
            r = subprocess.run([str(bench), "-m", str(gguf_file), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
                                "-r", str(repeats), "-o", "json"], capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise RuntimeError((r.stderr.strip().splitlines() or ["failed"])[-1])
            result = next(t for t in json.loads(r.stdout) if t.get("n_gen"))
            rows.append({"model": label, "tokens_per_second": round(float(result["avg_ts"]), 2),
                         "weight_bytes": gguf_file.stat().st_size})
        except Exception as e:  # noqa: BLE001 (the row says why; the others stand)
            rows.append({"model": label, "tokens_per_second": None, "note": f"failed: {type(e).__name__}: {e}"})
    return rows


def _bfloat16_folder(folder: Path, out: Path, transformers) -> Path:
    """``folder`` where it is stored in bfloat16, else a bfloat16 copy at ``out`` (the dense row's weights, and
    what the quantized rows are made from, as `hilt convert` makes them)."""
    from hilt.models.hf import save_causal_lm
    from hilt.quant.hf_folder import read_config

    config = read_config(folder)
    if (config.get("dtype") or config.get("torch_dtype")) == "bfloat16":
        return folder
    LOG.info(f"{folder}: a bfloat16 copy to time and quantize")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    return save_causal_lm(model, folder, out)


def _tiny_llama(folder: Path, transformers) -> Path:
    """A random 2-layer Llama as a Hugging Face folder (bfloat16): the quick mode's model."""
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def run(quick: bool = False, work=None, threads: int = 2, gemv: bool = True, new_tokens: int | None = None,
        repeats: int | None = None, model: str = "smollm2", formats=None, gemv_formats=None,
        everything: bool = True) -> dict:
    """``model``: any causal LM hilt.models.lm names (smollm2 adds hilt's own Llama runner and transformers' own
    GGUF loading); ``quick``: a tiny random Llama, dense and k-means 4-bit, 4 tokens; SmolLM2's layer alone in the
    GEMV table. ``formats``: the FORMATS labels to time (default all); ``gemv_formats``: the GEMV table's
    (default GEMV_FORMATS); ``everything=False`` leaves out the load-memory probes, transformers' GGUF loading and
    llama.cpp (the report's budget)."""
    from hilt.models.lm import OWN, lm_source
    from hilt.models.llama import GGUF_FILE, smollm2_path

    transformers = require_transformers()
    source = None if quick else lm_source(model)  # a model no path serves is refused before the minutes below
    chosen = QUICK_FORMATS if quick else formats or tuple(FORMATS)
    unknown = set(chosen) - set(FORMATS)
    if unknown:
        raise HiltError(f"no decode format {sorted(unknown)}; the formats: {', '.join(FORMATS)}")
    formats = {k: v for k, v in FORMATS.items() if k in chosen}
    smollm2 = not quick and model == "smollm2"
    if work is not None:  # made now, not after the GEMV table's minutes
        if Path(work).exists() and not Path(work).is_dir():
            raise HiltError(f"{work}: --work is a file, expected a folder")
        Path(work).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    new_tokens, repeats = new_tokens or (4 if quick else 64), repeats or (1 if quick else 5)
    prefill = 32 if quick else PREFILL
    bandwidth = copy_bandwidth(16 if quick else max(256, 4 * last_level_cache() >> 20))  # past the caches
    LOG.info(f"copy bandwidth: {bandwidth:.1f} GB/s")
    gemv_rows = []
    if gemv:
        gemv_rows = (gemv_table(GEMV_SHAPES[:1], 2, GEMV_FORMATS[:1], past_bytes=4 << 20) if quick
                     else gemv_table(None, 10, gemv_formats))
    for r in gemv_rows:
        r["of_copy_bandwidth"] = round(r["gb_per_s"] / bandwidth, 3)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        tmp = Path(tmp)
        if quick:
            dense = _tiny_llama(tmp / "tiny-llama", transformers)
            ids = torch.arange(1, 9).unsqueeze(0)
            decode_text = lambda tokens: " ".join(map(str, tokens))  # noqa: E731 (no tokenizer: the ids)
        else:
            if source.runner == OWN:
                LOG.info(f"converting {model}'s GGUF to a Hugging Face folder (bfloat16)")
                dense = gguf_to_hf(source.path, tmp / "dense-hf")
            elif source.path.is_dir():
                dense = _bfloat16_folder(source.path, tmp / "dense-hf", transformers)
            else:
                raise HiltError(f"{source.path}: bench decode times Hugging Face folders; `hilt convert` it first")
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(dense))
            # the prompt as the model reads text: Gemma's tokenizer leads with its BOS, SmolLM2's adds none
            ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=not smollm2)["input_ids"]
            decode_text = tokenizer.decode
        folders = {"dense bf16": dense}
        for i, (label, (config, extra)) in enumerate(formats.items()):
            LOG.info(f"quantizing: {label}")
            folders[label] = tmp / f"quantized-{i}"
            try:
                if extra == "compensate":
                    quantize_checkpoint(dense, folders[label], config, compensate=_compensator(dense, config))
                else:
                    quantize_checkpoint(dense, folders[label], config, embeddings=extra)
            except Exception as e:  # noqa: BLE001 (one row fails, the others are measured)
                LOG.warning(f"{label}: {type(e).__name__}: {e}")
                del folders[label]
        gguf_kwargs = {"gguf_file": GGUF_FILE}
        cases = [(label, folder, {}) for label, folder in folders.items()]
        if smollm2 and everything:
            cases.append(("transformers GGUF (Q4_1 file)", smollm2_path().parent, gguf_kwargs))
        LOG.info(f"loading {len(cases)} models")
        models = {label: transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                                          **kwargs).eval()
                  for label, folder, kwargs in cases}
        kmeans4 = "hilt k-means 4 (block 64)"
        if kmeans4 in folders and not quick:
            from hilt.quant.nn import QuantLinear

            apart = transformers.AutoModelForCausalLM.from_pretrained(str(folders[kmeans4]), dtype=torch.bfloat16).eval()
            for m in apart.modules():
                if isinstance(m, QuantLinear):
                    m.group = None
            models[APART] = apart
            cases.append((APART, folders[kmeans4], {}))
        own = {}
        if quick or smollm2:
            LOG.info("hilt's own Llama, dense and k-means 4-bit")
            own = _hilt_llamas(quick)
        models.update(own)
        prefill_ids = torch.randint(0, models["dense bf16"].config.vocab_size, (1, prefill),
                                    generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            for m in models.values():
                _generate(m, ids, 4)  # warm up: the kernels build and ready each layer
            LOG.info(f"decoding: {new_tokens} tokens, {repeats} rounds")
            decode = _interleaved(models, lambda m: _generate(m, ids, new_tokens), repeats)
            LOG.info(f"prefill: {prefill} tokens, {repeats} rounds")
            prefills = _interleaved(models, lambda m: m(prefill_ids, use_cache=False), repeats)
            texts = {label: decode_text(_generate(m, ids, new_tokens)[0, ids.shape[1]:].tolist()[:12])
                     for label, m in models.items()}
            shares = {label: _time_split(m, ids, new_tokens) for label, m in models.items()}
        del models
        rows = []
        for label, folder, kwargs in cases:
            weights = smollm2_path().stat().st_size if kwargs else _weight_bytes(folder)
            memory = _load_memory(folder, kwargs) if everything and not quick and label != APART else {}  # the probe's fresh process: seconds
            per_token = decode[label] / new_tokens
            rows.append({"model": label, "tokens_per_second": round(1 / per_token, 2),
                         "prefill_tokens_per_second": round(prefill / prefills[label], 1), "weight_bytes": weights,
                         "ms_per_token": round(per_token * 1e3, 2), **_split_ms(shares[label], per_token),
                         "text": texts[label], **{f"rss_{k}": v for k, v in memory.items()}})
        for label, runner in own.items():  # no folder for the memory probe
            per_token = decode[label] / new_tokens
            weights = sum(t.numel() * t.element_size() for t in runner.model.state_dict().values())
            rows.append({"model": label, "tokens_per_second": round(1 / per_token, 2),
                         "prefill_tokens_per_second": round(prefill / prefills[label], 1), "weight_bytes": weights,
                         "ms_per_token": round(per_token * 1e3, 2), **_split_ms(shares[label], per_token),
                         "text": texts[label]})
        base = rows[0]["tokens_per_second"]
        if quick or not everything:
            rows.append({"model": "llama.cpp llama-bench (Q4_0, Q8_0 exports)", "tokens_per_second": None,
                         "note": ("not run in --quick" if quick else "not run in this budget (`hilt bench decode`)")
                         if llama_cpp_tool("llama-bench") else "not built"})
        else:
            rows += _llama_cpp_rows(tmp, threads, new_tokens, repeats, None if smollm2 else dense)
    base_prefill = rows[0]["prefill_tokens_per_second"]
    for r in rows:
        if r.get("tokens_per_second") is None:
            continue
        r["vs_dense_bf16"] = round(r["tokens_per_second"] / base, 3)
        if "prefill_tokens_per_second" in r:
            r["prefill_vs_dense_bf16"] = round(r["prefill_tokens_per_second"] / base_prefill, 3)
        if "rss_loaded" in r:
            r["loaded_over_weights"] = round((r["rss_loaded"] - r["rss_baseline"]) / r["weight_bytes"], 3)
            r["decoding_over_weights"] = round((r["rss_decoding"] - r["rss_baseline"]) / r["weight_bytes"], 3)
            r["first_forward_mb"] = round((r["rss_decoding"] - r["rss_loaded"]) / 1e6, 1)
            held = r["rss_decoding"] - r["rss_baseline"] - (r["rss_decoding_code"] - r["rss_baseline_code"])
            r["decoding_over_weights_without_code"] = round(held / r["weight_bytes"], 3)
            r["first_forward_code_mb"] = round((r["rss_decoding_code"] - r["rss_loaded_code"]) / 1e6, 1)
    return {"threads": threads, "new_tokens": new_tokens, "repeats": repeats, "prefill_tokens": prefill,
            "prompt": None if quick else PROMPT,
            "model": "tiny random Llama (quick)" if quick else "SmolLM2-135M-Instruct" if smollm2 else model,
            "device": "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu_flags": _cpu_flags(), "copy_gb_per_s": round(bandwidth, 2), "rows": rows, "gemv": gemv_rows,
            "table": table(rows) + ("\n\n" + gemv_markdown(gemv_rows, bandwidth) if gemv_rows else "")}


def _cpu_flags() -> str:
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split(":")[1].split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in flags if f.startswith(("avx", "fma", "f16c")))


def gemv_markdown(rows: list[dict], bandwidth: float) -> str:
    lines = [f"One layer, M = 1, bfloat16 x (copy bandwidth {bandwidth:.1f} GB/s)", "",
             "| layer (in x out) | format | weight MB | us | GB/s | of copy bandwidth |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['format']} | {r['bytes'] / 1e6:.2f} | {r['us']:.0f} | "
                     f"{r['gb_per_s']:.1f} | {r['of_copy_bandwidth']:.0%} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The decode rows as Markdown; the memory columns only where the load probes ran."""
    probed = any("rss_baseline" in r or "rss_error" in r for r in rows)
    head = ["model (from_pretrained, bf16)", "tokens/s", "vs dense bf16", "ms/token: linear layers / head / attention / rest",
            "prefill tokens/s (vs dense)", "weights MB"]
    if probed:
        head += ["resident over weights: loaded / decoding (without library code)", "first forward adds MB (library code)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        if r.get("tokens_per_second") is None:
            lines.append(f"| {r['model']} | {r.get('note', 'n/a')} |" + " |" * (len(head) - 2))
            continue
        vs = f"{r['vs_dense_bf16']:.2f}x" if "vs_dense_bf16" in r else "n/a"
        split = (" / ".join(f"{r[f'{kind}_ms_per_token']:.1f}" for kind in ("linear", "head", "attention", "rest"))
                 if "linear_ms_per_token" in r else "n/a")
        prefill = (f"{r['prefill_tokens_per_second']:.0f} ({r['prefill_vs_dense_bf16']:.2f}x)"
                   if "prefill_vs_dense_bf16" in r else "n/a")
        cells = [r["model"], f"{r['tokens_per_second']:.2f}", vs, split, prefill, f"{r['weight_bytes'] / 1e6:.1f}"]
        if probed:
            cells.append(f"{r['loaded_over_weights']:.2f}x / {r['decoding_over_weights']:.2f}x "
                         f"({r['decoding_over_weights_without_code']:.2f}x)" if "loaded_over_weights" in r
                         else r.get("rss_error", "n/a"))
            cells.append(f"{r['first_forward_mb']} ({r['first_forward_code_mb']})" if "first_forward_mb" in r else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
