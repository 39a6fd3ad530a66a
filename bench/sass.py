"""`hilt bench kernels --sass`: the LUT matmul kernel compiled for a GPU, on a machine without one.

Triton's wheel carries NVIDIA's ptxas and cuobjdump, so the kernel compiles to SASS for an
sm_90 GPU (H100, H200) on any machine. For a real layer shape (Llama-70B's 8192 x 8192, so
the arguments get the alignment hints a GPU launch would give them) and each path, bit width
and tuning configuration, this reports registers, spilled bytes (local memory), shared
memory, and the instructions of the main loop per weight it covers. These are static counts,
not timings: they show what a lookup costs, whether loads vectorise and what spills; GPU
timings need a GPU (``hilt bench kernels``). Compiling every configuration also proves the
GPU build works: the interpreter accepts code that Triton's compiler rejects.

Runs in its own process with TRITON_INTERPRET=0 (kernels defined under the interpreter
cannot be compiled).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = (8192, 8192)  # (N, K): Llama-70B q_proj
ARCH = 90


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def available() -> bool:
    """Whether this Triton carries the CUDA backend's ptxas and cuobjdump."""
    return all((_tools() / name).exists() for name in ("ptxas", "cuobjdump"))


_PTR_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "u8"}


def _signature(fn, args, flags, config):
    """Triton signature, constexprs and alignment attributes for these launch arguments, as a
    GPU launch would specialise them (pointers and integers divisible by 16 are marked so)."""
    import torch

    names = fn.arg_names
    constexprs = {**flags, **config.kwargs}
    sig, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _PTR_TYPES[str(value.dtype).removeprefix("torch.")]
            aligned = value.data_ptr() % 16 == 0
        else:
            sig[name] = "i32"
            aligned = value % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in names[len(args):]:
        sig[name] = "constexpr"
    return sig, constexprs, attrs


def _loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes between the longest backward branch and its target: the main loop."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in lines:
        branch = re.search(r"\bBRA\b.*?(?:0x)?([0-9a-f]+)\s*\)?\s*$", text)
        if branch and int(branch.group(1), 16) < addr:
            loops.append((int(branch.group(1), 16), addr))
    if not loops:
        return collections.Counter()
    start, end = max(loops, key=lambda span: span[1] - span[0])
    ops = collections.Counter()
    for addr, text in lines:
        if start <= addr <= end:
            op = re.sub(r"^@!?U?P\w+\s+", "", text.strip()).split()[0]
            ops[op] += 1
    return ops


def compile_case(path: str, m: int, bits: int, config, block_size: int = 64, shape=SHAPE) -> dict:
    """Compile one case for sm_90 and read its resources and main loop."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.lut_matmul import _lut_matmul_kernel, kernel_args
    from kernels.packing import packed_row_bytes

    n, k = shape
    x = torch.empty(m, k, dtype=torch.bfloat16)
    codes = torch.empty(n, packed_row_bytes(k, bits), dtype=torch.uint8)
    book = torch.zeros(1 << bits, dtype=torch.float16)
    scales = torch.empty(n, k // block_size, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    args, flags = kernel_args(x, codes, book, scales, None, None, out, bits, block_size, path, 1)
    sig, constexprs, attrs = _signature(_lut_matmul_kernel, args, flags, config)
    compiled = triton.compile(ASTSource(_lut_matmul_kernel, sig, constexprs, attrs), target=GPUTarget("cuda", ARCH, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(_tools() / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(_tools() / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    resources = {key.lower(): int(value) for key, value in re.findall(r"\b(REG|LOCAL):(\d+)", usage)}
    resources["shared"] = compiled.metadata.shared  # dynamic shared memory: what Triton allocates
    ops = _loop_opcodes(sass)
    kw = config.kwargs
    weights = kw["BLOCK_N"] * kw["BLOCK_K"] / (32 * config.num_warps)  # per thread per loop iteration
    loop = sum(ops.values())
    return {"path": path, "m": m, "bits": bits, "config": {**kw, "num_warps": config.num_warps,
                                                           "num_stages": config.num_stages},
            "byte_table": flags["BYTE_TABLE"], **resources, "loop_instructions": loop,
            "weights_per_thread": weights, "instructions_per_weight": loop / weights if loop else None,
            "loop_top": dict(ops.most_common(8))}


def report(batches=None, bits=(1, 2, 3, 4), quick=False, log=print) -> dict:
    """Every tuning configuration compiled for sm_90, for the batch sizes that take it
    (``batches``: only these M). ``quick``: one configuration per path and way to read codes,
    at 1, 3 and 4 bits (seconds: for the tests)."""
    from kernels.lut_matmul import (
        GEMM_CONFIGS,
        SPLIT_K_CONFIGS,
        reads_codes_distinctly,
        split_k_fits,
    )

    rows = []
    cases = [("gemv", m, c) for c in SPLIT_K_CONFIGS for m in (1, 16) if split_k_fits(c, m)]
    cases += [("gemv", 2 if c.kwargs["BLOCK_M"] == 2 else 5, c) for c in SPLIT_K_CONFIGS
              if not (split_k_fits(c, 1) or split_k_fits(c, 16))]
    cases += [("gemm", 256, c) for c in GEMM_CONFIGS]
    if quick:
        first = {}
        for path, m, config in cases:
            first.setdefault((path, m == 1, config.kwargs["USE_DOT"], config.kwargs["CODES"]), (path, m, config))
        cases, bits = list(first.values()), (1, 3, 4)
    for path, m, config in cases:
        if batches and m not in batches:
            continue
        for b in bits:
            if not reads_codes_distinctly(config, b, byte_table=m == 1 and b in (1, 2, 4)):
                continue  # the same code as another configuration
            row = compile_case(path, m, b, config)
            rows.append(row)
            kw = row["config"]
            log(f"{path} M={m:<3} {b} bit  BLOCK {kw['BLOCK_M']:>2}x{kw['BLOCK_N']:>3}x{kw['BLOCK_K']:>3} "
                f"{'dot' if kw['USE_DOT'] else 'fma'} w{kw['num_warps']} s{kw['num_stages']} {kw['CODES']:<6}  regs {row['reg']:>3}  spill {row['local']:>4} B  "
                f"shared {row['shared']:>6} B  loop {row['loop_instructions']:>4} instr"
                + (f" = {row['instructions_per_weight']:5.2f}/weight" if row["instructions_per_weight"] else ""))
    return {"target": f"sm_{ARCH}", "shape": list(SHAPE), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--batch", type=int, action="append", help="only this M (1, 2, 5, 16 or 256; repeatable)")
    p.add_argument("--bits", type=int, action="append", help="only these bit widths (repeatable)")
    p.add_argument("--quick", action="store_true", help="one configuration per path and way to read codes")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # kernels must be defined for the compiler, not the interpreter
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        return subprocess.run([sys.executable, "-m", "bench.sass", *(argv if argv is not None else sys.argv[1:])],
                              env=env, check=False).returncode
    if not available():
        print("hilt: this Triton has no CUDA backend tools (ptxas, cuobjdump); cannot compile for a GPU here",
              file=sys.stderr)
        return 1
    result = report(args.batch, args.bits or (1, 2, 3, 4), args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
