"""FP8 attention (the Triton kernel of kernels.fp8_attention) against bf16 FlashAttention on a CUDA GPU.

For each sequence length and causal setting, in the same run and on the same inputs:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on bf16 q, k, v, forced
  to the flash backend (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``). Its inputs are
  already bf16, so it has no input preparation to time.
* ``fp8``: the public ``fp8_attention`` call on the same bf16 tensors: input checks (one
  host sync), the FP8 quantization of Q, K and V (one Triton pass each) and the attention
  kernel. This is the like-for-like comparison with ``sdpa``.
* ``fp8_kernel``: the attention kernel alone on Q, K, V already in FP8 (as when the
  previous layer or the KV cache writes FP8). Reported beside, not instead.

Per-head scales (448 / amax of q, k; per channel for v) are computed once, outside the
timing (a scale recipe delivers them). Before timing, the FP8 output is compared with the
bf16 output (cosine over all elements). Timing: ``triton.testing.do_bench``, median. FLOPs:
4 * B * H * T^2 * D, halved for causal. By default the batch is 16384 // T (the same number of
tokens at every length), 16 heads of 128: about a minute of GPU time in all.
"""

from __future__ import annotations

import platform

import torch

from hilt.errors import HiltError
from hilt.kernels import fp8_attention
from hilt.kernels.backends import triton_kernels
from hilt.kernels.fp8_attention import E4M3_MAX
from hilt.progress import LOG

MIN_COSINE = 0.99  # FP8 vs bf16 on random inputs measures ~0.998; below this something is broken


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def run(seqs=(1024, 2048, 4096, 8192, 16384), head_dim=128, heads=16, batch=None, causal=(False, True)) -> dict:
    """Time FP8 attention against bf16 flash SDPA; ``batch=None`` means 16384 // seq per length."""
    if not torch.cuda.is_available():
        raise HiltError("FP8 attention timings need a CUDA GPU; none is present")
    kernels = triton_kernels("fp8_attention_triton")
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    major, minor = torch.cuda.get_device_capability(0)
    info = {"gpu": torch.cuda.get_device_name(0), "capability": f"sm{major}{minor}", "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "head_dim": head_dim, "heads": heads,
            "timed": {"sdpa": "bf16 flash SDPA on bf16 inputs",
                      "fp8": "fp8_attention on the same bf16 inputs: checks, Q/K/V to FP8, attention kernel",
                      "fp8_kernel": "the attention kernel alone on Q/K/V already in FP8",
                      "fp8_split": "fp8_attention with split_qk (Q and K as two E4M3 terms: 3 FP8 products for Q K^T)"},
            "timing": "triton.testing.do_bench, median ms", "rows": [], "mismatches": []}
    LOG.info(f"{info['gpu']} ({info['capability']}), torch {info['torch']}, triton {info['triton']}; "
             f"{heads} heads x {head_dim}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    sm_scale = head_dim**-0.5
    for seq in seqs:
        b = batch or max(1, 16384 // seq)
        q, k, v = (torch.randn(b, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        q_scale = E4M3_MAX / q.float().abs().amax(dim=(0, 2, 3))
        k_scale = E4M3_MAX / k.float().abs().amax(dim=(0, 2, 3))
        v_scale = E4M3_MAX / v.float().abs().amax(dim=(0, 2))
        q8, k8, v8 = kernels.quantize_inputs(q, k, v, q_scale, k_scale, v_scale)
        out = torch.empty_like(q)
        for is_causal in causal:
            def sdpa(is_causal=is_causal, q=q, k=k, v=v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

            def fp8(is_causal=is_causal, q=q, k=k, v=v, qs=q_scale, ks=k_scale, vs=v_scale):
                return fp8_attention(q, k, v, qs, ks, vs, causal=is_causal)

            def fp8_kernel(is_causal=is_causal, q8=q8, k8=k8, v8=v8, qs=q_scale, ks=k_scale, vs=v_scale, out=out):
                return kernels.attention_from_fp8(q8, k8, v8, qs, ks, vs, is_causal, sm_scale, out)

            cosine = _cosine(fp8(), sdpa())  # also compiles and autotunes before the timing
            if not cosine >= MIN_COSINE:  # not timed; the other lengths still are, and the command fails
                info["mismatches"].append({"seq": seq, "causal": is_causal, "cosine_vs_bf16": cosine})
                LOG.warning(f"T={seq:6d} {'causal' if is_causal else 'full  '}  FP8 attention differs from bf16 SDPA: "
                            f"cosine {cosine:.5f} < {MIN_COSINE}")
                continue
            def fp8_split(is_causal=is_causal, q=q, k=k, v=v, qs=q_scale, ks=k_scale, vs=v_scale):
                return fp8_attention(q, k, v, qs, ks, vs, causal=is_causal, split_qk=True)

            fp8_kernel()
            fp8_split()
            ms = {name: do_bench(fn, return_mode="median")
                  for name, fn in (("sdpa", sdpa), ("fp8", fp8), ("fp8_kernel", fp8_kernel), ("fp8_split", fp8_split))}
            flops = 4 * b * heads * seq * seq * head_dim / (2 if is_causal else 1)
            row = {"seq": seq, "batch": b, "causal": is_causal, "cosine_vs_bf16": cosine,
                   **{f"{n}_ms": t for n, t in ms.items()},
                   **{f"{n}_tflops": flops / (t * 1e-3) / 1e12 for n, t in ms.items()},
                   "speedup": ms["sdpa"] / ms["fp8"], "kernel_speedup": ms["sdpa"] / ms["fp8_kernel"]}
            info["rows"].append(row)
            LOG.info(f"T={seq:6d} B={b:2d} {'causal' if is_causal else 'full  '}  sdpa bf16 {ms['sdpa']:7.3f} ms "
                     f"({row['sdpa_tflops']:5.0f} TFLOP/s)  fp8 {ms['fp8']:7.3f} ms ({row['fp8_tflops']:5.0f})  "
                     f"kernel only {ms['fp8_kernel']:7.3f} ms ({row['fp8_kernel_tflops']:5.0f})  "
                     f"split Q K {ms['fp8_split']:7.3f} ms  "
                     f"speedup {row['speedup']:.2f}x / {row['kernel_speedup']:.2f}x  cosine {cosine:.5f}")
        del q, k, v, q8, k8, v8, out
    return info
