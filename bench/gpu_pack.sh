#!/usr/bin/env bash
# Run here, before bench/gpu_check.sh goes to a lent GPU machine: fills the ignored .gpu/ with
# what that machine's python3 lacks (it has torch, triton, numpy, tokenizers, not gguf or the
# SmolLM2 package): the gguf wheel, and the SmolLM2 GGUF split in two halves, since one device
# call carries at most 64 MiB and the file is 98 MB. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
rm -rf .gpu && mkdir -p .gpu/wheels
version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('gguf'))")
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels "gguf==$version"
gguf_file=$(.venv/bin/python -c "from bench.llama import smollm2_path; print(smollm2_path())")
split -b 50000000 "$gguf_file" .gpu/smollm2.gguf.part-
ls -l .gpu/wheels .gpu/smollm2.gguf.part-*
