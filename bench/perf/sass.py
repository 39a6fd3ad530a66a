"""`hilt bench kernels --sass`: the Triton kernels compiled for a GPU, on a machine without one.

Triton's wheel carries NVIDIA's ptxas and cuobjdump, so the kernels compile to SASS for an
sm_90 GPU (H100, H200) on any machine. LUT matmul: for a real layer shape (Llama-70B's 8192 x 8192, so
the arguments get the alignment hints a GPU launch would give them) and each path, bit width
and tuning configuration, this reports registers, the stack frame (where ptxas puts the
registers it spills: these kernels keep no arrays in memory), shared memory, and the
instructions of the main loop per weight it covers. These are static counts,
not timings: they show what a lookup costs, whether loads vectorise and what spills; GPU
timings need a GPU (``hilt bench kernels``). Compiling every configuration also proves the
GPU build works: the interpreter accepts code that Triton's compiler rejects. FP8 attention:
the quantization and attention kernels with every tuning configuration, as the public
function launches them (:func:`attention_report`).

Runs in its own process with TRITON_INTERPRET=0 (kernels defined under the interpreter
cannot be compiled).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from hilt.atomic import write_json
from hilt.progress import LOG

SHAPE = (8192, 8192)  # (N, K): Llama-70B q_proj
ARCH = 90


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def available() -> bool:
    """Whether this Triton carries the CUDA backend's ptxas and cuobjdump."""
    return all((_tools() / name).exists() for name in ("ptxas", "cuobjdump"))


_PTR_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "u8", "float8_e4m3fn": "fp8e4nv"}


def _signature(fn, args, constexprs):
    """Triton signature, alignment attributes and constexprs for these launch arguments, as a GPU
    launch specialises them: pointers and integers divisible by 16 are marked so, integers equal
    to 1 become constants (a stride of 1 is what lets loads vectorise), except the parameters
    the kernel marks do_not_specialize."""
    import torch

    sig, attrs, constexprs = {}, {}, dict(constexprs)
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        if fn.params[i].do_not_specialize:  # as the kernel asks: no hints, no constant
            sig[name] = "i32"
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value == 1:
            sig[name], constexprs[name] = "constexpr", 1
            continue
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _PTR_TYPES[str(value.dtype).removeprefix("torch.")]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            sig[name], aligned = "fp32", False
        else:
            sig[name] = "i32"
            aligned = value % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in fn.arg_names[len(args):]:
        if name not in constexprs:
            raise ValueError(f"{fn.__name__}: no value for {name}")
        sig[name] = "constexpr"
    return sig, attrs, constexprs


def compile_launch(fn, args, constexprs, num_warps=4, num_stages=3) -> dict:
    """Compile one launch of ``fn`` for sm_90; its registers, stack (spill) and shared bytes, and
    the opcodes of its main loop."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs, constexprs = _signature(fn, args, constexprs)
    compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", ARCH, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(_tools() / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(_tools() / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    resources = {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    ops = _loop_opcodes(sass)
    return {**resources, "shared": compiled.metadata.shared,  # dynamic shared memory: what Triton allocates
            "loop_instructions": sum(ops.values()), "loop_top": dict(ops.most_common(8))}


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
    """Compile one LUT matmul case for sm_90 (x in bf16, one codebook per layer)."""
    import torch

    from hilt.kernels.lut_matmul import PackedWeight
    from hilt.kernels.lut_matmul_triton import lut_matmul_kernel, kernel_args
    from hilt.kernels.packing import packed_row_bytes

    n, k = shape
    x = torch.empty(m, k, dtype=torch.bfloat16)
    codes = torch.empty(n, packed_row_bytes(k, bits), dtype=torch.uint8)
    scales = torch.empty(n, k // block_size, dtype=torch.bfloat16)
    w = PackedWeight(codes, torch.zeros(1 << bits, dtype=torch.float16), scales, None, bits, block_size, k)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    args, flags = kernel_args(x, w, None, out, path, 1)
    row = compile_launch(lut_matmul_kernel, args, {**flags, **config.kwargs}, config.num_warps, config.num_stages)
    kw = config.kwargs
    weights = kw["BLOCK_N"] * kw["BLOCK_K"] / (32 * config.num_warps)  # per thread per loop iteration
    loop = row["loop_instructions"]
    return {"path": path, "m": m, "bits": bits, "config": {**kw, "num_warps": config.num_warps,
                                                           "num_stages": config.num_stages},
            "byte_table": flags["BYTE_TABLE"], **row, "weights_per_thread": weights,
            "instructions_per_weight": loop / weights if loop else None}


def attention_report(quick=False) -> list[dict]:
    """The FP8 attention kernels (Q/K/V quantization, the attention forward with each tuning
    configuration) compiled for sm_90: causal and not, V in FP8 and in bf16, with and without
    split_qk, grouped queries, head dim 128 (``quick``: two of these, the first configuration).
    Launches are captured from the public function on CPU tensors, so the arguments are exactly
    what it passes."""
    import torch

    from hilt.kernels import fp8_attention_triton as attention

    launches = []

    class Capture:  # stands in for a kernel: records what the launch would pass
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    real = {name: getattr(attention, name) for name in ("_quantize_kernel", "_attn_fwd_kernel")}
    rows = []
    b, h, g, t, d = 1, 4, 2, 1024, 128
    try:
        for name, fn in real.items():
            setattr(attention, name, Capture(fn))
        for causal in (False, True):
            for v_fp8 in (True, False):
                for split in (False, True):
                    if quick and (causal, v_fp8, split) not in ((False, True, False), (True, False, True)):
                        continue
                    q = torch.randn(b, h, t, d, dtype=torch.bfloat16)
                    k, v = (torch.randn(b, g, t, d, dtype=torch.bfloat16) for _ in range(2))
                    launches.clear()
                    attention.fp8_attention_triton(q, k, v, torch.ones(h), torch.ones(g),
                                                   torch.ones(g, d) if v_fp8 else None, causal, split_qk=split)
                    for fn, args, kwargs in launches:
                        configs = [(kwargs, 4, 3)] if fn is real["_quantize_kernel"] else [
                            ({**kwargs, **c.kwargs}, c.num_warps, c.num_stages)
                            for c in attention.TUNING_CONFIGS[:1 if quick else None]]
                        for constexprs, warps, stages in configs:
                            row = {"kernel": fn.__name__, "causal": causal, "v_fp8": v_fp8, "split_qk": split,
                                   "constexprs": constexprs, "num_warps": warps, "num_stages": stages,
                                   **compile_launch(fn, args, constexprs, warps, stages)}
                            rows.append(row)
                            tiles = f"{constexprs.get('BLOCK_M', '')}x{constexprs.get('BLOCK_N', '')}"
                            LOG.info(f"{fn.__name__:<18} causal={causal!s:<5} V fp8={v_fp8!s:<5} split_qk={split!s:<5} "
                                     f"{tiles:>7} w{warps} s{stages}  regs {row['reg']:>3}  stack {row['stack']:>4} B  "
                                     f"shared {row['shared']:>6} B  loop {row['loop_instructions']:>4} instr")
    finally:
        for name, fn in real.items():
            setattr(attention, name, fn)
    return rows


def report(batches=None, bits=(1, 2, 3, 4), quick=False) -> dict:
    """Every tuning configuration compiled for sm_90, for the batch sizes that take it
    (``batches``: only these M). ``quick``: one configuration per path and way to read codes,
    at 1, 3 and 4 bits (seconds: for the tests)."""
    from hilt.kernels.lut_matmul_triton import GEMM_CONFIGS, SPLIT_K_CONFIGS, reads_codes_distinctly, split_k_fits

    with_attention = not batches and tuple(bits) == (1, 2, 3, 4)  # no filter given
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
            LOG.info(f"{path} M={m:<3} {b} bit  BLOCK {kw['BLOCK_M']:>2}x{kw['BLOCK_N']:>3}x{kw['BLOCK_K']:>3} "
                     f"{'dot' if kw['USE_DOT'] else 'fma'} w{kw['num_warps']} s{kw['num_stages']} {kw['CODES']:<6}  regs {row['reg']:>3}  stack {row['stack']:>4} B  "
                     f"shared {row['shared']:>6} B  loop {row['loop_instructions']:>4} instr"
                     + (f" = {row['instructions_per_weight']:5.2f}/weight" if row["instructions_per_weight"] else ""))
    return {"target": f"sm_{ARCH}", "shape": list(SHAPE), "rows": rows,
            "attention": attention_report(quick) if with_attention else []}


def run(json_path=None, quick: bool = False, batches=None, bits=(1, 2, 3, 4)) -> int:
    """`hilt bench kernels --sass`: compile, print the summary, write ``json_path``; the exit status."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # kernels must be defined for the compiler, not the interpreter
        argv = ["--quick"] * quick + (["--json", str(json_path)] if json_path else [])
        return subprocess.run([sys.executable, "-m", "hilt.cli", "bench", "kernels", "--sass", *argv],
                              env={**os.environ, "TRITON_INTERPRET": "0"}, check=False).returncode
    if not available():
        print("hilt: this Triton has no CUDA backend tools (ptxas, cuobjdump); cannot compile for a GPU here",
              file=sys.stderr)
        return 1
    result = report(batches, bits, quick)
    rows, attention = result["rows"], result["attention"]
    spills = sum(r["stack"] > 0 for r in rows + attention)
    print(f"compiled for {result['target']}: {len(rows)} LUT matmul cases, {len(attention)} FP8 attention launches; "
          f"{spills} use stack (spilled registers)" + ("; --quick: one configuration per path and way of reading "
                                                        "codes, the full run compiles every one" if quick else ""))
    if json_path:
        write_json(json_path, result)
    return 0
