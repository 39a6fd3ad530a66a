#!/usr/bin/env bash
# Packs what bench/perf/gpu_check.sh needs on a GPU machine without network whose python3 has
# torch, triton, numpy, safetensors, tokenizers and gguf's own dependencies (pyyaml, tqdm,
# requests): fills the ignored .gpu/ with common/ (the hilt and gguf wheels, the GGUF's sha256)
# and the SmolLM2 GGUF in two halves (98 MB whole; smaller files travel more easily). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
rm -rf .gpu && mkdir -p .gpu/common
version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('gguf'))")
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .gpu/common "gguf==$version"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .gpu/common .
gguf_file=$(.venv/bin/python -c "from hilt.models.llama import smollm2_path; print(smollm2_path())")
sha256sum <"$gguf_file" | cut -d' ' -f1 >.gpu/common/smollm2.gguf.sha256
split -n 2 "$gguf_file" .gpu/smollm2.gguf.part-
ls -l .gpu/common .gpu/smollm2.gguf.part-*
