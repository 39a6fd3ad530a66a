#!/usr/bin/env bash
# The whole GPU check in one call (about 5 minutes on an H200): LUT matmul kernels (correctness,
# timings against cuBLAS bf16, SmolLM2 decode) and FP8 attention against bf16 flash SDPA.
# Results, with the GPU's name, clocks and versions, go to bench/results/ (or $OUT when set).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
export TRITON_INTERPRET=0
.venv/bin/python -m hilt.cli bench kernels --all --json "$out/kernels-gpu.json"
.venv/bin/python -m hilt.cli bench attention --json "$out/attention-gpu.json"
